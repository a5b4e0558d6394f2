import math

import pytest

from producers import TrainingTelemetry
from rlpulse.settings import Settings, parse_duration


@pytest.mark.parametrize("text, seconds", [("500ms", 0.5), ("10s", 10.0), ("15m", 900.0), ("1h", 3600.0), ("2", 2.0)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


def test_bad_duration_names_the_variable():
    with pytest.raises(ValueError, match="RLPULSE_WINDOW: invalid duration '5 parsecs'"):
        Settings.load({"RLPULSE_WINDOW": "5 parsecs"})


def test_flags_override_environment_override_defaults():
    env = {"RLPULSE_TOPIC_PREFIX": "t1", "RLPULSE_WINDOW": "5s"}
    assert Settings.load(env).topic("spans") == "t1.spans"
    assert Settings.load(env, topic_prefix="t2").app_id == "t2-streams"
    assert Settings.load(env).window == 5.0 and Settings.load({}).window == 60.0


def test_password_never_in_repr():
    s = Settings.load({"RLPULSE_KAFKA_SASL_PASSWORD": "hunter2"})
    assert "hunter2" not in repr(s) and s.kafka_sasl_password == "hunter2"


@pytest.fixture
def tel():
    # Never started: validation happens before anything is queued.
    return TrainingTelemetry(project="p", run_id="r", settings=Settings.load({}))


@pytest.mark.parametrize(
    "call, kwargs, message",
    [
        ("grader", dict(step=1, rollout_id="x", term="judge", outcome="late", duration_s=1.0), "outcome must be one of"),
        ("rollout", dict(step=1, rollout_id="x", reward=math.nan), "reward must be a finite number"),
        ("rollout", dict(step=1, rollout_id="x", reward=math.inf), "reward must be a finite number"),
        ("rollout", dict(step=-1, rollout_id="x", reward=0.5), "step must be a non-negative integer"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares={"j": "high"}), r"term_shares\['j'\] must be a finite number"),
        ("step_completed", dict(step=1, duration_s=-2.0), "duration_s must be >= 0.0"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={"k": [1, 2]}), r"attributes\['k'\] must be a string, bool, int or float"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={f"k{i}": i for i in range(65)}), "attributes has 65 keys; at most 64"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares={f"t{i}": 0.1 for i in range(65)}), "term_shares has 65 keys; at most 64"),
        # the inline fast paths hand anything unusual to the full checks
        ("rollout", dict(step=True, rollout_id="x", reward=0.5), "step must be a non-negative integer"),
        ("rollout", dict(step=1.0, rollout_id="x", reward=0.5), "step must be a non-negative integer"),
        ("rollout", dict(step=1, rollout_id="", reward=0.5), "rollout_id must be a non-empty string"),
        ("rollout", dict(step=1, rollout_id=7, reward=0.5), "rollout_id must be a non-empty string"),
        ("rollout", dict(step=1, rollout_id="x", reward="0.5"), "reward must be a finite number"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares={"j": math.nan}), r"term_shares\['j'\] must be a finite number"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares={3: 0.1}), "term_shares key must be a non-empty string"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares=[("j", 0.1)]), "term_shares must be a mapping"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, completion_tokens=-1), "completion_tokens must be a non-negative integer"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, max_tokens=1.5), "max_tokens must be a non-negative integer"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, clipped=1), "clipped must be True, False or None"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, sample_id=""), "sample_id must be a non-empty string"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, duration_s=None), "duration_s must be a finite number"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, duration_s=-0.5), "duration_s must be >= 0.0"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={"k": math.inf}), r"attributes\['k'\] must be finite"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes=[1]), "attributes must be a mapping"),
        ("grader", dict(step=1, rollout_id="x", term="judge", outcome=["ok"], duration_s=1.0), "outcome must be one of"),
        ("grader", dict(step=1, rollout_id="x", term="", outcome="ok", duration_s=1.0), "term must be a non-empty string"),
        ("grader", dict(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=math.nan), "duration_s must be a finite number"),
        ("grader", dict(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=1.0, score=math.nan), "score must be a finite number"),
        ("grader", dict(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=1.0, input_tokens=-3), "input_tokens must be a non-negative integer"),
        ("step_completed", dict(step=-1), "step must be a non-negative integer"),
        ("step_completed", dict(step=1, mfu=math.nan), "mfu must be a finite number"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_field(tel, call, kwargs, message):
    with pytest.raises(ValueError, match=message):
        getattr(tel, call)(**kwargs)


def test_unknown_trainer_is_rejected():
    with pytest.raises(ValueError, match="trainer must be one of rl, sft"):
        TrainingTelemetry(project="p", run_id="r", trainer="ppo", settings=Settings.load({}))


def test_too_many_distinct_terms_per_run_is_a_clear_error(tel):
    for i in range(64):
        tel.grader(step=0, rollout_id="x", term=f"t{i}", outcome="ok", duration_s=0.1)
    with pytest.raises(ValueError, match="term 't64' would be distinct term number 65 for this run; at most 64"):
        tel.grader(step=0, rollout_id="x", term="t64", outcome="ok", duration_s=0.1)


def test_async_face_shares_the_sync_sender_and_validates_the_same(tel):
    import asyncio

    aio = tel.aio
    assert aio.sync is tel
    with pytest.raises(ValueError, match="outcome must be one of"):
        asyncio.run(aio.grader(step=1, rollout_id="x", term="judge", outcome="late", duration_s=1.0))
    asyncio.run(aio.rollout(step=1, rollout_id="x", reward=0.5))
    assert tel.pending == 1 and aio.sync.sender is tel.sender  # queued on the one sender (never started here)


def test_a_rejected_call_queues_nothing(tel):
    with pytest.raises(ValueError):
        tel.rollout(step=1, rollout_id="x", reward=math.nan)
    assert tel.pending == 0


def test_ints_where_floats_are_expected_are_accepted_as_floats(tel):
    tel.rollout(step=1, rollout_id="x", reward=1, term_shares={"judge": 1}, duration_s=2)
    tel.grader(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=1, score=1)
    [(_, _, rollout), (_, _, grader)] = tel.sender.queued_records()
    assert type(rollout["reward"]) is float and type(rollout["term_shares"]["judge"]) is float
    assert type(grader["score"]) is float

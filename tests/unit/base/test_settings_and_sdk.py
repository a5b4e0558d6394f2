import math

import pytest

from rlpulse.producers import TrainingTelemetry
from rlpulse.base.settings import Settings, parse_duration


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
        (
            "rollout",
            dict(step=1, rollout_id="x", reward=0.5, term_shares={"j": "high"}),
            r"term_shares\['j'\] must be a finite number",
        ),
        ("step_completed", dict(step=1, duration_s=-2.0), "duration_s must be >= 0.0"),
        (
            "rollout",
            dict(step=1, rollout_id="x", reward=0.5, attributes={"k": [1, 2]}),
            r"attributes\['k'\] must be a string, bool, int or float",
        ),
        (
            "rollout",
            dict(step=1, rollout_id="x", reward=0.5, attributes={f"k{i}": i for i in range(129)}),
            "attributes has 129 keys; at most 128",
        ),
        (
            "rollout",
            dict(step=1, rollout_id="x", reward=0.5, term_shares={f"t{i}": 0.1 for i in range(65)}),
            "term_shares has 65 keys; at most 64",
        ),
        # the inline fast paths hand anything unusual to the full checks
        ("rollout", dict(step=True, rollout_id="x", reward=0.5), "step must be a non-negative integer"),
        ("rollout", dict(step=1.0, rollout_id="x", reward=0.5), "step must be a non-negative integer"),
        ("rollout", dict(step=1, rollout_id="", reward=0.5), "rollout_id must be a non-empty string"),
        ("rollout", dict(step=1, rollout_id=7, reward=0.5), "rollout_id must be a non-empty string"),
        ("rollout", dict(step=1, rollout_id="x", reward="0.5"), "reward must be a finite number"),
        (
            "rollout",
            dict(step=1, rollout_id="x", reward=0.5, term_shares={"j": math.nan}),
            r"term_shares\['j'\] must be a finite number",
        ),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares={3: 0.1}), "term_shares key must be a non-empty string"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares=[("j", 0.1)]), "term_shares must be a mapping"),
        (
            "rollout",
            dict(step=1, rollout_id="x", reward=0.5, completion_tokens=-1),
            "completion_tokens must be a non-negative integer",
        ),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, max_tokens=1.5), "max_tokens must be a non-negative integer"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, clipped=1), "clipped must be True, False or None"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, sample_id=""), "sample_id must be a non-empty string"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, duration_s=None), "duration_s must be a finite number"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, duration_s=-0.5), "duration_s must be >= 0.0"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={"k": math.inf}), r"attributes\['k'\] must be finite"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes=[1]), "attributes must be a mapping"),
        ("grader", dict(step=1, rollout_id="x", term="judge", outcome=["ok"], duration_s=1.0), "outcome must be one of"),
        ("grader", dict(step=1, rollout_id="x", term="", outcome="ok", duration_s=1.0), "term must be a non-empty string"),
        (
            "grader",
            dict(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=math.nan),
            "duration_s must be a finite number",
        ),
        (
            "grader",
            dict(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=1.0, score=math.nan),
            "score must be a finite number",
        ),
        (
            "grader",
            dict(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=1.0, input_tokens=-3),
            "input_tokens must be a non-negative integer",
        ),
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


SPAN = dict(time_ns=2, trace_id=b"t" * 16, span_id=b"s" * 8, name="chat", kind="LLM", start_time_ns=1, end_time_ns=2)
SAMPLE = dict(
    project="p",
    run_id="r",
    attempt=1,
    time_ns=1,
    hw_id="GPU-a",
    index=0,
    host="h",
    power_w=300.0,
    temperature_c=60.0,
    gpu_utilization=0.5,
    memory_used_bytes=1,
    memory_total_bytes=2,
    memory_utilization=0.5,
    memory_activity=0.1,
    sm_clock_mhz=1500.0,
    throttle_reasons=0,
)
BIG = 2**64  # beyond Avro long
LONE = "\ud800"  # a lone surrogate: no UTF-8 encoding


@pytest.mark.parametrize(
    "call, kwargs, message",
    [
        ("rollout", dict(step=BIG, rollout_id="x", reward=0.5), "step must be a non-negative integer of at most"),
        ("rollout", dict(step=1, rollout_id=LONE, reward=0.5), "rollout_id is not valid text: surrogates not allowed"),
        ("rollout", dict(step=1, rollout_id="é" + LONE, reward=0.5), "rollout_id is not valid text"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, sample_id=LONE), "sample_id is not valid text"),
        (
            "rollout",
            dict(step=1, rollout_id="x", reward=0.5, completion_tokens=BIG),
            "completion_tokens must be a non-negative integer of at most",
        ),
        (
            "rollout",
            dict(step=1, rollout_id="x", reward=0.5, max_tokens=2**63),
            "max_tokens must be a non-negative integer of at most",
        ),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, duration_s=1e300), "duration_s must be <= 1e"),
        ("rollout", dict(step=1, rollout_id="x", reward=2**2000), "reward must be a finite number"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, term_shares={LONE: 0.1}), "term_shares key is not valid text"),
        (
            "rollout",
            dict(step=1, rollout_id="x", reward=0.5, term_shares={"j": 2**2000}),
            r"term_shares\['j'\] must be a finite number",
        ),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={"k": BIG}), r"attributes\['k'\] is beyond Avro long"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={"k": LONE}), r"attributes\['k'\] is not valid text"),
        ("rollout", dict(step=1, rollout_id="x", reward=0.5, attributes={LONE: 1}), "attributes key is not valid text"),
        (
            "grader",
            dict(step=BIG, rollout_id="x", term="judge", outcome="ok", duration_s=1.0),
            "step must be a non-negative integer of at most",
        ),
        ("grader", dict(step=1, rollout_id=LONE, term="judge", outcome="ok", duration_s=1.0), "rollout_id is not valid text"),
        ("grader", dict(step=1, rollout_id="x", term=LONE, outcome="ok", duration_s=1.0), "term is not valid text"),
        ("grader", dict(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=1e300), "duration_s must be <= 1e"),
        (
            "grader",
            dict(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=1.0, score=math.inf),
            "score must be a finite number",
        ),
        (
            "grader",
            dict(step=1, rollout_id="x", term="judge", outcome="ok", duration_s=1.0, output_tokens=BIG),
            "output_tokens must be a non-negative integer of at most",
        ),
        ("step_completed", dict(step=1, tokens=BIG), "tokens must be a non-negative integer of at most"),
        ("step_completed", dict(step=BIG), "step must be a non-negative integer of at most"),
        ("step_completed", dict(step=1, duration_s=1e300), "duration_s must be <= 1e"),
        ("step_completed", dict(step=1, mfu=math.inf), "mfu must be a finite number"),
        ("publish_span", dict(span=dict(SPAN, reward=math.nan)), "reward must be a finite number, got nan"),
        ("publish_span", dict(span=dict(SPAN, step=BIG)), "step must be an integer from"),
        ("publish_span", dict(span=dict(SPAN, step=-1)), "step must be a non-negative integer"),
        ("publish_span", dict(span=dict(SPAN, time_ns=BIG)), "time_ns must be an integer from"),
        ("publish_span", dict(span=dict(SPAN, name=LONE)), "name is not valid text"),
        ("publish_span", dict(span=dict(SPAN, rollout_id=LONE)), "rollout_id is not valid text"),
        ("publish_span", dict(span=dict(SPAN, attributes={"loss": math.inf})), r"attributes\['loss'\] must be a finite number"),
        ("publish_span", dict(span=dict(SPAN, attributes={"n": BIG})), r"attributes\['n'\] must be an integer from"),
        ("publish_span", dict(span=dict(SPAN, attributes={LONE: 1})), "attributes key is not valid text"),
        ("publish_span", dict(span=dict(SPAN, term_shares={"j": math.nan})), r"term_shares\['j'\] must be a finite number"),
        ("publish_span", dict(span=dict(SPAN, score=math.inf)), "score must be a finite number"),
        (
            "publish_hardware",
            dict(record_type="GpuSample", key="GPU-a", record=dict(SAMPLE, power_w=math.nan)),
            "power_w must be a finite number",
        ),
        (
            "publish_hardware",
            dict(record_type="GpuSample", key="GPU-a", record=dict(SAMPLE, memory_used_bytes=BIG)),
            "memory_used_bytes must be an integer from",
        ),
        (
            "publish_hardware",
            dict(record_type="GpuSample", key="GPU-a", record=dict(SAMPLE, index=2**40)),
            "index must be an integer from -2147483648",
        ),
        (
            "publish_hardware",
            dict(record_type="GpuSample", key="GPU-a", record=dict(SAMPLE, host=LONE)),
            "host is not valid text",
        ),
    ],
)
def test_nan_infinity_overflow_and_lone_surrogates_raise_naming_the_field(tel, call, kwargs, message):
    import asyncio

    with pytest.raises(ValueError, match=message):
        getattr(tel, call)(**kwargs)
    with pytest.raises(ValueError, match=message):  # the async face checks the same
        asyncio.run(getattr(tel.aio, call)(**kwargs))
    assert tel.pending == 0 and tel.step_count == 0 and not tel._terms  # nothing changed before the refusal


def test_every_check_runs_before_any_state_changes(tel):
    with pytest.raises(ValueError, match="completion_tokens"):  # a new term, then a bad value after it
        tel.rollout(step=1, rollout_id="x", reward=0.5, term_shares={"judge": 0.5}, completion_tokens=2**64)
    with pytest.raises(ValueError, match="output_tokens"):
        tel.grader(step=1, rollout_id="x", term="format", outcome="ok", duration_s=1.0, output_tokens=2**64)
    with pytest.raises(ValueError, match="duration_s"):
        tel.step_completed(step=1, tokens=10, duration_s=1e300)
    assert not tel._terms and tel.step_count == 0 and tel.pending == 0
    # and the calls that pass register their terms and count their step
    tel.rollout(step=1, rollout_id="x", reward=0.5, term_shares={"judge": 0.5}, completion_tokens=2**63 - 1)
    tel.step_completed(step=1, tokens=2**63 - 1, duration_s=1e9)
    assert tel._terms == {"judge"} and tel.step_count == 1 and tel.pending == 2


def test_valid_non_ascii_text_and_number_subclasses_are_accepted(tel):
    class Level(int):
        pass

    tel.rollout(
        step=1,
        rollout_id="rollout-é-雪",
        reward=0.5,
        sample_id="prompt-✓",
        attributes={"lang": "日本語", "level": Level(3), "ratio": 0.5},
    )
    tel.publish_span(dict(SPAN, name="chat ✓", attributes={"k": "é"}))
    [(_, _, rollout), (_, _, span)] = tel.sender.queued_records()
    assert rollout["rollout_id"] == "rollout-é-雪" and rollout["attributes"]["level"] == 3
    assert type(rollout["attributes"]["level"]) is int and span["name"] == "chat ✓"


def test_the_span_exporter_drops_and_counts_bad_spans_and_logs_once(tel, caplog):
    import logging

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()  # the job's spans, made with the plain OpenTelemetry API
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("agent")
    bad = [
        {"rlpulse.reward": math.nan},
        {"rlpulse.step": math.inf},
        {"rlpulse.step": 2**64},
        {"loss": -math.inf},
        {"tokens": 2**70},
        {"rlpulse.rollout_id": LONE},
        {"note": "a" + LONE},
    ]
    for i, attributes in enumerate(bad):
        with tracer.start_as_current_span(f"bad{i}", attributes={"rlpulse.kind": "REWARD", **attributes}):
            pass
    with tracer.start_as_current_span(
        "good", attributes={"rlpulse.kind": "REWARD", "rlpulse.reward": 0.5, "rlpulse.step": 4.0, "rlpulse.rollout_id": "r-1"}
    ):
        pass
    spans = memory.get_finished_spans()
    assert len(spans) == len(bad) + 1

    exporter = tel.span_exporter()
    with caplog.at_level(logging.WARNING, logger="rlpulse.producers.sdk.otel"):
        assert exporter.export(spans) == SpanExportResult.SUCCESS  # never raises into the exporter's thread
    assert exporter.refused == len(bad)
    [(_, _, record)] = tel.sender.queued_records()  # only the good one reaches the queue (and the streams)
    assert (record["name"], record["reward"], record["step"], record["rollout_id"]) == ("good", 0.5, 4, "r-1")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "span 'bad0' not exported: reward must be a finite number" in lines[0]  # rate-limited

"""Each rollout's prompt and completion as an LLM span (``rlpulse.producers.integrations.completions``), and
TRL's path to it: a stand-in ``GRPOTrainer`` (``test_integration_trl.FakeGRPO``, TRL 1.16's calls) whose
reward functions get ``prompts``, ``completions`` and ``completion_ids`` as TRL passes them, and whose
``_generate`` returns ``(prompt_ids, completion_ids, ...)`` as TRL 1.16's does. Every test reads the exact
records an ``InMemoryTransport`` received.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace
from typing import Any

import pytest

from rlpulse.producers.integrations import completions as cp
from rlpulse.producers.integrations.trl import instrument
from rlpulse.producers.sdk.memory import InMemoryTransport
from rlpulse.producers.sdk.records import span_id, trace_id
from rlpulse.producers.sdk.telemetry import TrainingTelemetry
from rlpulse.producers.tracing import content as tc
from rlpulse.base.settings import Settings
from tests.unit.producers.integrations.test_integration_trl import EOS, FakeGRPO

pytestmark = pytest.mark.full

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "mem", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def telemetry(transport: InMemoryTransport) -> TrainingTelemetry:
    return TrainingTelemetry("p", "r", settings=SETTINGS, transport=transport)


def of(spans: list[dict], kind: str) -> list[dict]:
    return [s for s in spans if s["kind"] == kind]


# -- the module ----------------------------------------------------------------------------------

def test_messages_a_plain_prompt_is_the_users_and_a_conversation_stays_as_it_is():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert cp.input_messages("2+2?") == [{"role": "user", "content": "2+2?"}]
    assert cp.input_messages(chat) == chat and cp.input_messages(chat[1]) == [chat[1]]
    assert cp.output_messages("4") == [{"role": "assistant", "content": "4"}]
    reply = [{"role": "assistant", "content": "4"}]
    assert cp.output_messages(reply) == reply and cp.output_messages(reply[0]) == reply


def test_scalars_reads_lists_arrays_and_columns_of_one():
    np = pytest.importorskip("numpy")
    assert cp.scalars(np.array([[0.5], [1.0]])) == [0.5, 1.0]
    assert cp.scalars(np.array([1, 2])) == [1, 2] and cp.scalars([3]) == [3] and cp.scalars(None) == []
    assert cp.scalars(np.array(2.0)) == [2.0]
    assert cp.finite(np.float32(0.25)) == 0.25 and cp.finite(float("nan")) is None and cp.finite("x") is None


def test_one_llm_span_under_the_rollouts_span_with_exact_attributes():
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        pub = cp.completion_publisher(tel, "trainer.generate", content=True, token_ids=True, model="tiny")
        assert pub is not None
        sent = pub.publish_with_rollouts(4, [(cp.Completion("s4-0", "red cat", "blue dog", 2, 3, [5, 6], [7, 8, 1],
                                                            "stop"), {"reward": 0.5, "sample_id": "s4-p0"})],
                                         start_ns=1_000, end_ns=5_000)
        assert sent == 1 and (pub.published, pub.refused, pub.content_cut) == (1, 0, 0)
    [rollout], [llm] = of(transport.records("spans"), "ROLLOUT"), of(transport.records("spans"), "LLM")
    assert (llm["trace_id"], llm["parent_span_id"]) == (rollout["trace_id"], rollout["span_id"])
    assert (llm["trace_id"], llm["parent_span_id"]) == (trace_id("r/1/s4-0"), span_id("r/1/s4-0/rollout"))
    assert (llm["name"], llm["status"], llm["rollout_id"], llm["step"], llm["start_time_ns"], llm["end_time_ns"]) == (
        "trainer.generate", "OK", "s4-0", 4, 1_000, 5_000)
    assert llm["span_id"] != rollout["span_id"] and rollout["reward"] == 0.5 and rollout["sample_id"] == "s4-p0"
    assert llm["attributes"] == {
        "gen_ai.operation.name": "text_completion", "gen_ai.request.model": "tiny",
        "gen_ai.usage.input_tokens": 2, "gen_ai.usage.output_tokens": 3, "gen_ai.response.finish_reasons": "stop",
        "gen_ai.input.messages": dumps([{"role": "user", "content": "red cat"}]),
        "gen_ai.output.messages": dumps([{"role": "assistant", "content": "blue dog"}]),
        "rlpulse.prompt_token_ids": "[5,6]", "rlpulse.response_token_ids": "[7,8,1]",
        "rlpulse.prompt_token_count": 2, "rlpulse.response_token_count": 3}


def test_the_cap_keeps_json_valid_counts_what_it_cut_and_secrets_are_masked():
    secret = "sk-test-0123456789abcdef"
    tc.register_secret(secret)
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        pub = cp.CompletionPublisher(tel, "x.generate", content_limit=256)
        pub.publish(1, [cp.Completion("r0", f"key {secret}", "y" * 1000)])
        assert (pub.published, pub.content_cut) == (1, 1)
    [llm] = of(transport.records("spans"), "LLM")
    a = llm["attributes"]
    assert json.loads(a["gen_ai.input.messages"]) == [{"role": "user", "content": "key ***"}]
    out = json.loads(a["gen_ai.output.messages"])  # still JSON: the string was cut, with a marker saying how much
    text = out[0]["content"]
    cut = 1000 - text.index("…")
    assert len(a["gen_ai.output.messages"]) <= 256 and text.endswith(tc.MARKER.format(cut))
    assert a[tc.CUT_CHARS] == cut and "gen_ai.usage.input_tokens" not in a and "rlpulse.prompt_token_ids" not in a


def test_content_off_gives_no_publisher_and_the_switch_reads_the_environment(monkeypatch):
    tel = telemetry(InMemoryTransport())
    monkeypatch.delenv("RLPULSE_TRACE_CONTENT", raising=False)
    assert cp.completion_publisher(tel, "x") is None and cp.completion_publisher(tel, "x", content=False) is None
    monkeypatch.setenv("RLPULSE_TRACE_CONTENT", "1")
    assert isinstance(cp.completion_publisher(tel, "x"), cp.CompletionPublisher)
    assert cp.completion_publisher(tel, "x", content=False) is None
    with pytest.raises(ValueError, match="content must be"):
        cp.completion_publisher(tel, "x", content="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="content_limit"):
        cp.completion_publisher(tel, "x", content=True, content_limit=10)
    monkeypatch.setenv("RLPULSE_TRACE_CONTENT", "maybe")
    with pytest.raises(ValueError, match="RLPULSE_TRACE_CONTENT"):
        cp.completion_publisher(tel, "x")


def test_a_rollout_the_sdk_refuses_is_counted_and_gets_no_llm_span(caplog):
    transport = InMemoryTransport()
    with telemetry(transport) as tel:
        pub = cp.CompletionPublisher(tel, "x.generate")
        rows = [(cp.Completion("a", "p", "c"), {"reward": None}), (cp.Completion("b", "p", "c"), {"reward": 1.0}),
                (cp.Completion("x" * 300, "p", "c"), {"reward": 1.0})]  # a rollout id the SDK refuses (too long)
        assert pub.publish_with_rollouts(0, rows) == 1
        assert (pub.published, pub.refused) == (1, 2)
    assert [s["rollout_id"] for s in transport.records("spans")] == ["b", "b"]
    assert "not published" in caplog.text


def test_generations_are_found_again_by_the_very_list_with_their_times():
    gens = cp.Generations()
    outputs = [[1, 2], [3]]
    timed = gens.timed(lambda n: ([[9], [9, 9]], outputs), lambda out: (out[1], out[0]))
    before = time.time_ns()
    assert timed(2)[1] is outputs
    prompt_ids, start, end = gens.of(outputs)
    assert prompt_ids == [[9], [9, 9]] and before <= start <= end <= time.time_ns()
    assert gens.of([[1, 2], [3]]) == (None, None, None)  # an equal list is not the list
    broken = gens.timed(lambda: None, lambda out: (out[1], out[0]))  # another shape: returned as it is, not timed
    assert broken() is None


# -- TRL --------------------------------------------------------------------------------------------

class GenerateGRPO(FakeGRPO):
    """FakeGRPO whose completions come out of ``_generate`` as TRL 1.16's: ``(prompt_ids, completion_ids, ...)``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.model = SimpleNamespace(training=True, name_or_path="/tmp/tiny-llama")
        self.generated: list[tuple[int, int, list[list[int]]]] = []

    def _generate(self, completion_ids: list[list[int]]) -> tuple:
        start = time.time_ns()
        prompt_ids = [[10 + i // self.num_generations] * (1 + i // self.num_generations) for i in range(len(completion_ids))]
        ids = [list(x) for x in completion_ids]
        self.generated.append((start, time.time_ns(), prompt_ids))
        return prompt_ids, ids, None, [], None, {}, None, []

    def _generate_and_score(self, completion_ids: list[list[int]]) -> dict[str, Any]:
        return super()._generate_and_score(self._generate(completion_ids)[1])


def score(prompts: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
    return [len(ids) / 4 for ids in completion_ids]


def fails(prompts: list[str], **_: Any) -> list[float]:
    raise RuntimeError("down")


BATCHES = [[[3, 4, EOS], [5, 6, 7, 8]], [[2, EOS], [9]]]


def run(trainer: FakeGRPO, **options: Any) -> list[dict]:
    transport = InMemoryTransport()
    instrument(trainer, project="p", run_id="r", transport=transport, settings=SETTINGS, **options)
    trainer.train()
    return transport.records("spans")


def test_trl_each_rollout_of_a_batch_has_its_prompt_and_completion_once():
    trainer = GenerateGRPO([score, fails], BATCHES, steps_per_generation=2)
    spans = run(trainer, content=True)
    rollouts, llms = of(spans, "ROLLOUT"), of(spans, "LLM")
    assert len(rollouts) == len(llms) == 4  # two reward functions, one text per rollout
    by_id = {s["rollout_id"]: s for s in rollouts}
    for g, batch in enumerate(BATCHES):
        step = 1 + 2 * g  # generated at global_step 2g: step 2g + 1
        start, end, prompt_ids = trainer.generated[g]
        for i, ids in enumerate(batch):
            [llm] = [s for s in llms if s["rollout_id"] == f"s{step}-{i}"]
            rollout = by_id[f"s{step}-{i}"]
            assert (llm["parent_span_id"], llm["trace_id"], llm["step"], llm["name"]) == (
                rollout["span_id"], rollout["trace_id"], step, "trl.generate")
            assert llm["start_time_ns"] <= start <= end <= llm["end_time_ns"] < start + 10**9  # the generation's time
            assert llm["attributes"] == {
                "gen_ai.operation.name": "text_completion", "gen_ai.request.model": "/tmp/tiny-llama",
                "gen_ai.usage.input_tokens": len(prompt_ids[i]), "gen_ai.usage.output_tokens": len(ids),
                "gen_ai.response.finish_reasons": rollout["finish_reason"],
                "gen_ai.input.messages": dumps([{"role": "user", "content": f"prompt {i // 2}"}]),
                "gen_ai.output.messages": dumps([{"role": "assistant", "content": " ".join(map(str, ids))}])}
            assert rollout["finish_reason"] == ("stop" if ids[-1] == EOS else "length")


def test_trl_token_ids_when_asked_for():
    trainer = GenerateGRPO([score], BATCHES[:1])
    llms = of(run(trainer, content=True, token_ids=True), "LLM")
    prompt_ids = trainer.generated[0][2]
    assert [(s["attributes"]["rlpulse.prompt_token_ids"], s["attributes"]["rlpulse.response_token_ids"]) for s in llms] \
        == [(json.dumps(p, separators=(",", ":")), json.dumps(c, separators=(",", ":"))) for p, c in zip(prompt_ids, BATCHES[0])]


def test_trl_content_off_sends_nothing_new(monkeypatch):
    monkeypatch.delenv("RLPULSE_TRACE_CONTENT", raising=False)
    off = run(GenerateGRPO([score], BATCHES))
    on = run(GenerateGRPO([score], BATCHES), content=True)
    assert of(off, "LLM") == [] and len(of(on, "LLM")) == 4
    assert [(s["kind"], s["rollout_id"]) for s in off] == [(s["kind"], s["rollout_id"]) for s in on if s["kind"] != "LLM"]
    trainer = GenerateGRPO([score], BATCHES)
    instrument(trainer, project="p", run_id="r", transport=InMemoryTransport(), settings=SETTINGS)
    assert "_generate" not in vars(trainer)  # content off: TRL's own method, untouched


def test_trl_without_generate_uses_the_reward_calls_time_and_env_switch(monkeypatch):
    monkeypatch.setenv("RLPULSE_TRACE_CONTENT", "1")
    before = time.time_ns()
    llms = of(run(FakeGRPO([score], BATCHES[:1])), "LLM")
    assert len(llms) == 2 and all(before <= s["start_time_ns"] == s["end_time_ns"] <= time.time_ns() for s in llms)
    assert all("gen_ai.usage.input_tokens" not in s["attributes"] for s in llms)


def test_trl_conversational_prompts_and_completions_stay_messages_and_eval_batches_are_left_out():
    trainer = FakeGRPO([score], [])
    transport = InMemoryTransport()
    instrument(trainer, project="p", run_id="r", transport=transport, settings=SETTINGS, content=True)
    chat = [{"role": "system", "content": "Answer in colours."}, {"role": "user", "content": "sky?"}]
    reply = [{"role": "assistant", "content": "blue"}]
    trainer.reward_funcs[0](prompts=[chat], completions=[reply], completion_ids=[[4, EOS]], trainer_state=trainer.state)
    trainer.model.training = False  # an evaluation batch: no rollout, no text
    trainer.reward_funcs[0](prompts=["x"], completions=["y"], completion_ids=[[4]], trainer_state=trainer.state)
    trainer.model.training = True
    trainer.train()  # on_train_end publishes the batch
    [llm] = of(transport.records("spans"), "LLM")
    assert llm["attributes"]["gen_ai.input.messages"] == dumps(chat)
    assert llm["attributes"]["gen_ai.output.messages"] == dumps(reply)
    assert llm["attributes"]["gen_ai.operation.name"] == "chat"


def test_trl_a_cut_completion_is_counted_and_training_goes_on():
    trainer = GenerateGRPO([score], [[[4] * 3, [5]]])
    spans = run(trainer, content=True, content_limit=256)
    assert len(of(spans, "LLM")) == 2 and all(tc.CUT_CHARS not in s["attributes"] for s in of(spans, "LLM"))
    long = FakeGRPO([score], [])
    transport = InMemoryTransport()
    hooks = instrument(long, project="p", run_id="r", transport=transport, settings=SETTINGS, content=True,
                       content_limit=256)
    long.reward_funcs[0](prompts=["p" * 600], completions=["c" * 600], completion_ids=[[4]], trainer_state=long.state)
    long.train()
    assert hooks.completions is not None and hooks.completions.content_cut == 1
    [llm] = of(transport.records("spans"), "LLM")
    assert llm["attributes"][tc.CUT_CHARS] > 0
    assert all(len(llm["attributes"][k]) <= 256 for k in ("gen_ai.input.messages", "gen_ai.output.messages"))

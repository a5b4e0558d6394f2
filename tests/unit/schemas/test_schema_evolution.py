"""Schema evolution through the real codec into the run processor, both ways.

Containers are written by fastavro with a modified writer schema (as a newer or an older SDK
would write them), decoded as the streams decode them (``rlpulse.streams.inputs``: the record type
checked, spans projected to the fields the processor reads; the C block decoder where the writer
schema is ours, fastavro with schema resolution where it is not) and fed to the processor
through the harness.
"""

from __future__ import annotations

import copy
import io

import fastavro
import pytest

import rlpulse.schemas.codec as codec_module
from rlpulse.schemas.codec import Codec, load_schemas
from rlpulse.streams.inputs import Inputs
from rlpulse.streams.runs import RunConfig
from rlpulse.streams.stage import load_state
from rlpulse.streams.testing import NS, Harness
from tests.conftest import unavailable

T0 = 1_700_000_000 * NS
CONFIG = RunConfig(window_s=10, lateness_s=2, idle_s=5, retention_s=30, stall_after_s=20, silent_after_s=3)
PATHS = ["c-extension", "fastavro"]


@pytest.fixture(params=PATHS)
def decoder(request, monkeypatch) -> Inputs:
    """Decoding as the agents do; ``fastavro``: as where the C extension is not built."""
    if request.param == "fastavro":
        monkeypatch.setattr(codec_module, "compile_schema", None)
    elif codec_module.compile_schema is None:
        unavailable("the C extension rlpulse.schemas._blockdecode is not built (pip install -e . builds it)")
    return Inputs(Codec())


def evolved(name: str, enums: dict[str, list[str]] | None = None, added: list[dict] | None = None,
            removed: tuple[str, ...] = ()) -> dict:
    """The .avsc of ``name`` with symbols added to enum fields, fields added, fields removed."""
    raw = copy.deepcopy(load_schemas()[f"rlpulse.v1.{name}"])
    fields = []
    for f in raw["fields"]:
        if f["name"] in removed:
            continue
        if f["name"] in (enums or {}):
            f["type"]["symbols"] += enums[f["name"]]
        fields.append(f)
    raw["fields"] = fields + (added or [])
    return raw


def container(schema: dict, records: list[dict], codec: str = "null") -> bytes:
    buf = io.BytesIO()
    fastavro.writer(buf, fastavro.parse_schema(schema), records, codec=codec)
    return buf.getvalue()


NEWER_STEP = evolved("Step", enums={"trainer": ["dpo"], "type": ["CHECKPOINT"]},
                     added=[{"name": "loss", "type": ["null", "double"], "default": None}])
NEWER_SPAN = evolved("Span", enums={"kind": ["RETRIEVAL"]},
                     added=[{"name": "model", "type": "string", "default": ""}])
OLDER_STEP = evolved("Step", removed=("stage", "writer_id", "sequence_id", "spans_sent", "dropped_events"))
OLDER_SPAN = evolved("Span", removed=("stage", "writer_id", "sample_id", "clipped", "attributes", "max_tokens"))


def step(t_s: float, type_: str, count: int, seq: int, **extra) -> dict:
    return {**dict(project="p", run_id="r1", attempt=1, stage="", time_ns=T0 + int(t_s * NS), type=type_, trainer="dpo",
                   step=-1, step_count=count, writer_id="w", sequence_id=seq), **extra}


def span(t_s: float, kind: str, seq: int, **extra) -> dict:
    t = T0 + int(t_s * NS)
    return {**dict(project="p", run_id="r1", attempt=1, stage="", time_ns=t, trace_id=b"t" * 16, span_id=b"s" * 8,
                   name="x", kind=kind, start_time_ns=t - NS, end_time_ns=t, status="OK", sequence_id=seq, writer_id="w"),
            **extra}


def feed(h: Harness, inputs: Inputs, topic: str, data: bytes) -> None:
    records = inputs.decode(topic, data, f"t.{topic}[0]")
    assert records, "the message must decode"
    h.feed(topic, records)


def test_a_newer_writers_new_trainer_and_step_type_still_count_as_reports(decoder):
    """trainer 'dpo' reads as 'other', StepType CHECKPOINT as HEARTBEAT: the job keeps reporting, no silent_run."""
    h = Harness(CONFIG)
    feed(h, decoder, "steps", container(NEWER_STEP, [step(0, "RUN_START", 0, 1, loss=None)]))
    for i in range(1, 12):
        h.advance(1)
        kind = "CHECKPOINT" if i % 2 else "HEARTBEAT"
        feed(h, decoder, "steps", container(NEWER_STEP, [step(i, kind, i // 3, i + 1, loss=0.5)]))
    assert h.alerts() == []  # 11 s of reports with silent_after 3 s: none silent, none stalled
    [run] = map(load_state, h.table.values())
    assert run["stalls"]["p/r1/1"]["step_count"] == 3
    h.advance(4)  # the job stops reporting: now it is silent, once
    assert h.alerts() == [("silent_run", "p/r1/1", "FIRING")]


def test_the_newer_writers_records_read_with_the_defaults_of_the_reader():
    data = container(NEWER_STEP, [step(0, "CHECKPOINT", 0, 1, loss=0.5)], codec="deflate")
    [record] = Codec().decode(data).records
    assert (record["type"], record["trainer"], record["step_count"]) == ("HEARTBEAT", "other", 0)
    assert "loss" not in record  # a field the reader does not know is dropped


def test_a_newer_writers_spans_with_an_added_field_and_kind_give_the_same_figures(decoder):
    h = Harness(CONFIG)
    rollouts = [span(1 + i * 0.1, "ROLLOUT", i + 1, step=0, reward=r, clipped=c, completion_tokens=100, model="m")
                for i, (r, c) in enumerate([(0.5, True), (0.0, False), (1.0, True)])]
    grader = [span(1.5, "GRADER", 4, step=0, term="judge", outcome="timeout", model="m"),
              span(1.6, "RETRIEVAL", 5, step=0, model="m")]  # an unknown kind: CUSTOM, counted nowhere
    current = Codec().encode("Span", [span(1.7, "GRADER", 6, step=0, term="judge", outcome="ok")])  # an up-to-date writer
    feed(h, decoder, "spans", container(NEWER_SPAN, rollouts + grader))
    feed(h, decoder, "spans", current)
    feed(h, decoder, "steps", Codec().encode("Step", [step(2, "STEP", 1, 1, step=0, trainer="rl"),
                                                      step(2.5, "RUN_END", 1, 2, trainer="rl", spans_sent=6)]))
    [stats] = h.emissions("step-stats")  # closed at once: RUN_END names the last span, and it is in
    assert (stats["rollouts"], stats["clipped"], stats["reward_zero_fraction"]) == (3, 2, 1 / 3)
    windows = h.latest("grader-windows")
    assert [(w["graded"], w["failures"]) for w in windows.values()] == [(2, 1)]


def test_an_older_writer_lacking_fields_the_processor_reads_takes_their_defaults(decoder):
    """Steps without writer_id or sequence_id (each applied), spans without writer_id, sample_id, clipped or stage."""
    h = Harness(CONFIG)
    spans = [span(1 + i * 0.1, "ROLLOUT", 100 + i, step=0, reward=0.5, completion_tokens=10) for i in range(4)]
    for s in spans:
        for f in ("stage", "writer_id", "clipped"):
            s.pop(f, None)
    feed(h, decoder, "steps", container(OLDER_STEP, [step(0, "RUN_START", 0, 0, trainer="rl")]))
    feed(h, decoder, "spans", container(OLDER_SPAN, spans))
    feed(h, decoder, "steps", container(OLDER_STEP, [step(2, "STEP", 1, 0, step=0, trainer="sft")]))
    for i in range(3, 6):
        h.advance(1)
        feed(h, decoder, "steps", container(OLDER_STEP, [step(i, "HEARTBEAT", 1, 0, trainer="rl")]))
    h.advance(2)  # reports stopped 2 s ago: the step closes by the clock (idle 5 s after the last span)
    h.advance(4)
    [stats] = h.emissions("step-stats")
    assert (stats["rollouts"], stats["clipped"], stats["samples"]) == (4, 0, 0)
    assert h.alerts() == [("silent_run", "p/r1/1", "FIRING")]  # silent only once reports stopped for 3 s
    [run] = map(load_state, h.table.values())
    assert run["marks"] == {"spans|1|": 103}  # steps without a sequence (0): always applied, never marked


# -- what trainers report (policy version, finish reason, metrics, status), both ways -----------------
BEFORE_TRAINERS_SPAN = evolved("Span", removed=("policy_version", "finish_reason"))
BEFORE_TRAINERS_STEP = evolved("Step", removed=("metrics", "status"))
BEFORE_TRAINERS_STEP["fields"][[f["name"] for f in BEFORE_TRAINERS_STEP["fields"]].index("type")]["type"]["symbols"].remove(
    "METRICS")


def test_a_writer_before_the_trainer_fields_reads_with_their_defaults(decoder):
    spans = [span(1 + i * 0.1, "ROLLOUT", i + 1, step=0, reward=1.0, completion_tokens=10) for i in range(2)]
    [first, _] = Codec().decode(container(BEFORE_TRAINERS_SPAN, spans)).records
    assert (first["policy_version"], first["finish_reason"]) == (None, None)
    [end] = Codec().decode(container(BEFORE_TRAINERS_STEP, [step(0, "RUN_END", 0, 1, trainer="rl")])).records
    assert (end["metrics"], end["status"]) == ({}, None)
    h = Harness(CONFIG)
    feed(h, decoder, "spans", container(BEFORE_TRAINERS_SPAN, spans))
    feed(h, decoder, "steps", container(BEFORE_TRAINERS_STEP, [step(2, "STEP", 1, 1, step=0, trainer="rl")]))
    h.advance(8)
    [stats] = h.emissions("step-stats")
    assert (stats["rollouts"], stats["staleness_max"], stats["staleness_mean"]) == (2, None, None)


def test_a_reader_before_the_trainer_fields_reads_a_new_writers_records():
    """A new SDK's METRICS event, RUN_END status and rollout fields, read with the schemas of before:
    METRICS reads as HEARTBEAT (the enum's default), the new fields are dropped."""
    new_step = Codec().encode("Step", [step(0, "METRICS", 0, 1, trainer="rl", step=3, metrics={"loss": 0.5}),
                                       step(1, "RUN_END", 0, 2, trainer="rl", status="failed")])
    old = fastavro.parse_schema(copy.deepcopy(BEFORE_TRAINERS_STEP))
    got = list(fastavro.reader(io.BytesIO(new_step), reader_schema=old))
    assert [(r["type"], r["step"]) for r in got] == [("HEARTBEAT", 3), ("RUN_END", -1)]
    assert all("metrics" not in r and "status" not in r for r in got)
    new_span = Codec().encode("Span", [span(1, "ROLLOUT", 1, step=0, reward=1.0, policy_version=0, finish_reason="length",
                                            clipped=True)])
    [r] = fastavro.reader(io.BytesIO(new_span), reader_schema=fastavro.parse_schema(copy.deepcopy(BEFORE_TRAINERS_SPAN)))
    assert (r["clipped"], "policy_version" in r) == (True, False)


def test_an_older_streams_counts_the_new_error_cause_as_unknown(decoder, monkeypatch):
    """Streams from before ``error`` existed knew four causes: the outcome still counts as a failure."""
    import rlpulse.streams.figures as figures

    monkeypatch.setattr(figures, "CAUSES", ("timeout", "unavailable", "unreadable", "ungradable"))
    h = Harness(CONFIG)
    graders = [span(1 + i * 0.1, "GRADER", i + 1, step=0, term="judge", outcome=o) for i, o in enumerate(["ok", "error"])]
    feed(h, decoder, "spans", Codec().encode("Span", graders))
    h.advance(20)
    windows = h.latest("grader-windows")
    assert [(w["graded"], w["failures"]) for w in windows.values()] == [(2, 1)]
    causes = {w["cause"]: w["failures"] for w in h.latest("grader-failures").values()}
    assert causes.get("unknown") == 1 and "error" not in causes

"""Checkpoint saves and restores: the SDK's CHECKPOINT spans through the real sender and
codec, the run processor's ``checkpoint_failed`` alert, and an older reader's view of the kind."""

from __future__ import annotations

import copy
import io

import fastavro
import pytest

from rlpulse.producers import InMemoryTransport, TrainingTelemetry
from rlpulse.schemas.codec import Codec, load_schemas
from rlpulse.base.settings import Settings
from rlpulse.streams.runs import RunConfig
from rlpulse.streams.testing import NS, Harness

SETTINGS = Settings.load({"RLPULSE_TOPIC_PREFIX": "mem", "RLPULSE_HEARTBEAT_INTERVAL": "1h"})
CONFIG = RunConfig(window_s=10, lateness_s=2, idle_s=5, retention_s=30, stall_after_s=20, silent_after_s=3)


def published(**kwargs) -> list[dict]:
    transport = InMemoryTransport()
    clock = iter(range(10 * NS, 100 * NS, NS))
    with TrainingTelemetry(project="p", run_id="r", settings=SETTINGS, clock=lambda: next(clock), transport=transport) as tel:
        tel.checkpoint(100, "restore", size_bytes=2_000_000, duration_s=2.0)
        with tel.checkpointing(step=200, op="save") as ck:
            ck.size_bytes = 5_000_000
        with pytest.raises(OSError, match="No space left"):
            with tel.checkpointing(step=300):
                raise OSError(28, "No space left on device")
        with pytest.raises(ValueError, match="op must be one of save, restore; got 'load'"):
            tel.checkpoint(1, "load")
        with pytest.raises(ValueError, match="outcome must be one of ok, failed"):
            tel.checkpoint(1, "save", outcome="error")
    return transport.records("spans")


def test_checkpoints_are_spans_of_the_runs_trace_with_their_own_times() -> None:
    spans = published()
    got = [(s["kind"], s["name"], s["step"], s["checkpoint_op"], s["outcome"], s["status"], s["status_message"],
            s["checkpoint_bytes"], s["end_time_ns"] - s["start_time_ns"]) for s in spans]
    assert got == [
        ("CHECKPOINT", "checkpoint restore", 100, "restore", "ok", "OK", "", 2_000_000, 2 * NS),
        ("CHECKPOINT", "checkpoint save", 200, "save", "ok", "OK", "", 5_000_000, NS),
        ("CHECKPOINT", "checkpoint save", 300, "save", "failed", "ERROR", "OSError: [Errno 28] No space left on device",
         None, NS)]
    assert len({s["trace_id"] for s in spans}) == 1 and all(s["time_ns"] == s["end_time_ns"] for s in spans)


def checkpoint(t_s: float, seq: int, step: int, op: str, outcome: str) -> dict:
    t = 1_000_000 * NS + int(t_s * NS)
    return dict(project="p", run_id="r", attempt=1, time_ns=t, kind="CHECKPOINT", start_time_ns=t - NS, end_time_ns=t,
                step=step, checkpoint_op=op, outcome=outcome, status_message="OSError: disk full" if outcome == "failed" else "",
                writer_id="w", sequence_id=seq, term=None)


def test_a_failed_save_fires_once_and_the_next_good_save_resolves_it() -> None:
    h = Harness(CONFIG)
    h.feed("spans", [checkpoint(1, 1, 10, "save", "failed")])
    h.feed("spans", [checkpoint(2, 2, 11, "save", "failed"), checkpoint(3, 3, 11, "restore", "ok")])  # still open
    h.feed("spans", [checkpoint(4, 4, 12, "restore", "failed")])  # a restore says nothing about saving
    assert [a for a in h.alert_rows() if a[0] == "checkpoint_failed"] == [("checkpoint_failed", "p/r/1", "FIRING")]
    h.feed("spans", [checkpoint(5, 5, 13, "save", "ok")])
    rows = [a for a in h.alert_rows() if a[0] == "checkpoint_failed"]
    assert rows == [("checkpoint_failed", "p/r/1", "FIRING"), ("checkpoint_failed", "p/r/1", "RESOLVED")]
    [firing] = [a for a in h.emissions("alerts") if a["rule"] == "checkpoint_failed" and a["state"] == "FIRING"]
    assert (firing["severity"], firing["summary"]) == ("critical", "checkpoint save at step 10 failed: OSError: disk full")


def test_an_older_reader_reads_a_checkpoint_as_a_custom_span() -> None:
    old = copy.deepcopy(load_schemas()["rlpulse.v1.Span"])
    old["fields"] = [f for f in old["fields"] if f["name"] not in ("checkpoint_op", "checkpoint_bytes")]
    next(f for f in old["fields"] if f["name"] == "kind")["type"]["symbols"].remove("CHECKPOINT")
    data = Codec().encode("Span", published()[:1])
    [span] = fastavro.reader(io.BytesIO(data), reader_schema=fastavro.parse_schema(old))
    assert (span["kind"], span["outcome"], "checkpoint_op" in span) == ("CUSTOM", "ok", False)

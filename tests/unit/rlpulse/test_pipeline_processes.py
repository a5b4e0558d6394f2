"""Pipeline process names: the command, optionally -N for a second or later worker of it."""

from __future__ import annotations

import pytest

from rlpulse.pipeline import Pipeline
from rlpulse.base.settings import Settings


@pytest.mark.parametrize("name", ["worker", "streams2", "streams-", "streams-x", "sink-2-b", "Sink", "otlp", "otlp-x"])
def test_unknown_process_names_are_refused(name: str, tmp_path) -> None:
    pipeline = Pipeline(Settings(home=tmp_path))
    with pytest.raises(ValueError) as info:
        pipeline.start((name,))
    assert str(info.value) == f"unknown pipeline process {name!r}: streams, sink or otlp-ingest, optionally -N (streams-2)"
    assert pipeline.procs == {}


def test_running_lists_the_processes_of_one_command(tmp_path) -> None:
    pipeline = Pipeline(Settings(home=tmp_path))
    pipeline.procs = dict.fromkeys(["streams", "streams-2", "sink", "sink-3", "streams-10"])
    assert pipeline.running("streams") == ["streams", "streams-2", "streams-10"]
    assert pipeline.running("sink") == ["sink", "sink-3"]
    pipeline.procs = dict.fromkeys(["otlp-ingest", "otlp-ingest-2", "streams"])
    assert pipeline.running("otlp-ingest") == ["otlp-ingest", "otlp-ingest-2"]

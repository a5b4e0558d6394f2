"""The SDK while the broker is down: calls stay fast, the byte-bounded buffer drops and counts
what does not fit, and everything buffered is delivered once the broker is back.

Runs its own broker (port 19292, a throwaway RLPULSE_HOME) so it can stop and restart it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import time
from pathlib import Path

import pytest

from rlpulse.producers import TrainingTelemetry
from rlpulse import services
from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec
from rlpulse.schemas.topics import read_topic

pytestmark = [
    pytest.mark.integration,
    pytest.mark.full,  # a fault (the broker stopped), with a broker of its own: make test-all
    pytest.mark.skipif(shutil.which("java") is None or shutil.which("mvn") is None, reason="needs java and mvn"),
]
BOOTSTRAP = "127.0.0.1:19292"
BUFFER_BYTES = 40_000  # room for the first 50 events (about 440 bytes each in memory), not for 2000


async def sequence_ids(settings: Settings, writer_id: str) -> list[int]:
    """Publish-order ids (``writer_sequence``) of the spans topic, in the order the messages and their containers hold them."""
    codec = Codec()
    messages = await read_topic(settings.kafka_client_kwargs(), settings.topic("spans"))
    records = [r for m in sorted(messages, key=lambda m: (m.partition, m.offset)) for r in codec.decode(m.value).records]
    assert {r["writer_id"] for r in records} == {writer_id}
    return [r["writer_sequence"] for r in records]


def test_broker_down_calls_stay_fast_drops_are_counted_and_the_buffer_is_delivered(tmp_path: Path) -> None:
    settings = dataclasses.replace(Settings.load(), kafka_bootstrap=BOOTSTRAP, home=tmp_path, topic_prefix="down",
                                   heartbeat_interval=3600.0)
    services.up(settings)
    try:
        # No ensure_topics here: the SDK creates its topics before its first send.
        tel = TrainingTelemetry(project="p", run_id="r", settings=settings, buffer_bytes=BUFFER_BYTES)
        tel.start()
        for i in range(50):
            tel.grader(step=0, rollout_id=f"up{i}", term="judge", outcome="ok", duration_s=0.1)
        assert tel.flush(30) == 0 and tel.dropped == 0

        services.down(settings)
        calls = []
        for i in range(2000):
            started = time.perf_counter_ns()
            tel.grader(step=1, rollout_id=f"down{i}", term="judge", outcome="timeout", duration_s=0.1)
            calls.append(time.perf_counter_ns() - started)
        buffered = tel.flush(0.0)
        calls.sort()
        median, p99, slowest = calls[len(calls) // 2] / 1e6, calls[int(len(calls) * 0.99)] / 1e6, calls[-1] / 1e6
        print(f"SDK calls with the broker down: median {median * 1e3:.0f} us, p99 {p99:.3f} ms, max {slowest:.3f} ms; "
              f"{buffered} buffered, {tel.dropped} dropped")
        # What a call costs with the broker down is a figure of make bench (bench/sdk.py,
        # measure_sdk_call_broker_down: median < 0.25 ms, p99 < 1 ms), not a limit of this test
        # on a shared machine. Here: no call waited for the network (2000 of them, the broker
        # gone, took less than a second in all), and the buffer bounded what it kept.
        assert sum(calls) / 1e9 < 1.0, f"2000 calls took {sum(calls) / 1e9:.2f} s: a call waited for the broker"
        assert 0 < buffered < 2000 and tel.dropped == 2000 - buffered  # the budget held `buffered`, dropped the rest

        services.up(settings)
        assert tel.flush(120) == 0  # every buffered event delivered once the broker is back
        assert tel.close(30) == 0
        ids = asyncio.run(sequence_ids(settings, tel.writer_id))
        # exactly the 50 from before, then the first `buffered` of the 2000; the dropped ones are the tail
        assert sorted(set(ids)) == list(range(1, 50 + buffered + 1))
        # and in order: a resend after the restart may repeat a container, never put one before its predecessor
        firsts = [i for n, i in enumerate(ids) if n == 0 or i > max(ids[:n])]
        assert firsts == list(range(1, 50 + buffered + 1))

        # A job that ends while the broker is down: close() returns near its timeout with the count.
        late = TrainingTelemetry(project="p", run_id="late", settings=settings)
        late.start()
        assert late.flush(30) == 0
        services.down(settings)
        for i in range(10):
            late.rollout(step=0, rollout_id=f"late{i}", reward=0.0)
        started = time.monotonic()
        assert late.close(2.0) == 11  # the 10 rollouts and RUN_END
        assert time.monotonic() - started < 10
    finally:
        services.down(settings)

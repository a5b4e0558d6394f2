"""The GPU poller's real NVML code path on a machine with a GPU and no broker (the device machine):
``GpuPoller`` over pynvml publishes through the real ``Sender`` (schema checks, Avro encoding) into
an ``InMemoryTransport``; the messages are decoded back and printed, one line a record.

    PYTHONPATH=<site with rlpulse and the SDK's deps> python3 bench/gpu_check.py [SECONDS]

Where a broker runs, ``rlpulse gpu-poller`` is the same code publishing to Kafka.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time

import pynvml

from rlpulse.producers.pollers.gpu_poller import GpuPoller, Placement
from rlpulse.producers.sdk.memory import InMemoryTransport
from rlpulse.producers.sdk.sender import Sender
from rlpulse.schemas.codec import Codec
from rlpulse.base.settings import Settings


def main(seconds: float) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = Settings()
    transport = InMemoryTransport()
    sender = Sender(settings, transport=transport)
    sender.start()
    poller = GpuPoller(pynvml, sender.offer, settings, sample_interval_s=0.5, export_interval_s=2.0,
                       node="device-node", pod="device-pod",
                       placement=Placement("gpu-check", 1, "trainer", 0, "rlpulse-device", ""))
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    started = time.monotonic()
    poller.run(stop)
    print(f"available={poller.available} gpus={len(poller.gpus)} ran {time.monotonic() - started:.1f}s")
    print(f"undelivered={sender.close()} messages={len(transport.messages)}")
    codec = Codec()
    for topic, key, value in transport.messages:
        decoded = codec.decode(value)
        for record in decoded.records:
            shown = {k: (v.hex() if isinstance(v, bytes) else v) for k, v in record.items()}
            print(topic, key.decode(), decoded.name, json.dumps(shown, default=str, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(float(sys.argv[1]) if len(sys.argv) > 1 else 7.0))

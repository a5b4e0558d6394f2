"""``rlpulse alerts``: prints alerts as they arrive and, optionally, POSTs each to a webhook.

The webhook gets each alert as JSON from a bounded queue drained by a worker task, with
retries and backoff; when it fails for good the alert is logged and counted, and a slow or
dead webhook never holds up reading (a full queue drops the oldest, counted).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request
from typing import Any, Callable

from aiokafka import AIOKafkaConsumer

from rlpulse.settings import Settings
from schemas.codec import Codec, DecodeError
from schemas.topics import topic_partitions
from sinks.clickhouse import mask_url

log = logging.getLogger(__name__)


def format_alert(alert: dict[str, Any]) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(alert["time_ns"] / 1e9))
    return (f"{when} {alert['state']:<8} {alert['rule']:<21} {alert['key']} [{alert['severity']}] "
            f"{alert['summary']} (value {alert['value']:g}, threshold {alert['threshold']:g})")


class Webhook:
    def __init__(self, url: str, tries: int = 4, timeout_s: float = 5.0, queue_size: int = 1000):
        self.url = url
        self.tries = tries
        self.timeout_s = timeout_s
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=queue_size)
        self.delivered = 0
        self.failed = 0
        self.dropped = 0

    def offer(self, alert: dict[str, Any]) -> None:
        if self.queue.full():
            self.queue.get_nowait()
            self.dropped += 1
            log.warning("webhook queue full: dropped the oldest alert (%d so far)", self.dropped)
        self.queue.put_nowait(alert)

    async def run(self) -> None:
        while True:
            alert = await self.queue.get()
            try:
                await self._deliver(alert)
            finally:
                self.queue.task_done()

    async def _deliver(self, alert: dict[str, Any]) -> None:
        body = json.dumps(alert).encode()
        backoff = 0.2
        for attempt in range(1, self.tries + 1):
            try:
                await asyncio.to_thread(self._post, body)
                self.delivered += 1
                return
            except Exception as exc:  # HTTP error, refused, timeout: all retried the same way
                reason = f"{type(exc).__name__}: {exc}"
                if attempt < self.tries:
                    await asyncio.sleep(backoff)
                    backoff *= 2
        self.failed += 1
        log.error("webhook %s failed %d times for %s %s %s; last error %s",
                  mask_url(self.url), self.tries, alert["rule"], alert["state"], alert["key"], reason)

    def _post(self, body: bytes) -> None:
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
            response.read()


async def follow_alerts(settings: Settings, on_alert: Callable[[dict[str, Any]], None], from_beginning: bool,
                        once: bool, stop: asyncio.Event) -> int:
    """Read the alerts topic (from its end, or from the beginning) and call ``on_alert`` for each.

    With ``once`` it stops at the end offsets it found at start. Returns the number of alerts read.
    """
    kafka = settings.kafka_client_kwargs()
    codec = Codec()
    consumer = AIOKafkaConsumer(enable_auto_commit=False, auto_offset_reset="earliest", **kafka)
    await consumer.start()
    count = 0
    try:
        tps = await topic_partitions(consumer, settings.topic("alerts"))
        if not tps:
            raise RuntimeError(f"topic {settings.topic('alerts')} does not exist on {settings.kafka_bootstrap}")
        consumer.assign(tps)
        end = await consumer.end_offsets(tps)
        if from_beginning:
            await consumer.seek_to_beginning(*tps)
        else:
            for tp in tps:
                consumer.seek(tp, end[tp])
        while not stop.is_set():
            if once and not [tp for tp in tps if await consumer.position(tp) < end[tp]]:
                break
            for messages in (await consumer.getmany(timeout_ms=500)).values():
                for msg in messages:
                    try:
                        alerts = codec.decode(msg.value, expect=("rlpulse.v1.Alert",)).records
                    except DecodeError as exc:
                        log.warning("undecodable alert at %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, exc)
                        continue
                    for alert in alerts:
                        on_alert(alert)
                        count += 1
    finally:
        await consumer.stop()
    return count


async def serve_alerts(settings: Settings, webhook_url: str | None, from_beginning: bool, once: bool) -> int:
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    webhook = Webhook(webhook_url) if webhook_url else None
    worker = asyncio.create_task(webhook.run()) if webhook else None

    def on_alert(alert: dict[str, Any]) -> None:
        print(format_alert(alert), flush=True)
        if webhook:
            webhook.offer(alert)

    try:
        count = await follow_alerts(settings, on_alert, from_beginning, once, stop)
        if webhook:
            await webhook.queue.join()  # deliver (or give up on) what was read
            print(f"webhook: {webhook.delivered} delivered, {webhook.failed} failed, {webhook.dropped} dropped", flush=True)
    finally:
        if worker:
            worker.cancel()
    return count

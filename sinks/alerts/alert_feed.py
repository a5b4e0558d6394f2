"""``rlpulse alerts``: prints alerts as they arrive and, optionally, POSTs each to a webhook.

Nothing lost, nothing stuck:

* The feed reads ``<prefix>.alerts`` in a consumer group (``<prefix>-alerts`` unless ``--group``)
  and commits a partition's offset only once every alert up to it was accepted by the webhook
  (a 2xx answer) or given up on (logged and counted). Alerts fired while the feed was down, and
  those it had read but not delivered when it stopped, are posted when it starts again: at least
  once. Without a webhook an alert counts as done once printed.
* Each POST carries an id the receiver can drop duplicates by: ``alert_id`` in the JSON body and
  the ``Idempotency-Key`` header, the same value. It is derived from the alert transition
  (project, rule, key, state, first_seen_ns), so a re-post after a restart, and the same
  transition published twice by the streams after a crash, carry the same id; the FIRING and the
  RESOLVED of one episode have different ids. The body is the Alert record's fields plus
  ``alert_id``.
* ``--webhook-timeout`` (5 s) bounds each POST whole: connecting, sending, the status line, the
  headers and the body, however slowly the receiver drips them; a POST past it is a timeout. A
  2xx status is the acceptance: of the body, at most 64 KiB is read before the connection is closed.
* Transient failures (connection refused, timeout, 5xx, 408, 425, 429) are retried with backoff
  (0.5 s doubling to 30 s). Once the webhook has failed every call for ``give_up_after`` (10 min by
  default), each further alert gets one try and is given up on if it fails, so a long outage does
  not hold the feed for hours; a success resets that clock. Other 4xx answers and redirects mean
  the receiver refuses this body: given up at once. Alerts are posted one at a time, in order.
* SIGTERM/SIGINT stop the feed within about a second whatever the webhook does: an in-flight POST
  is abandoned (it runs on a daemon thread), nothing undelivered is committed.
* Where the group starts: from its committed offsets. A group with none (first start, or offsets
  expired after the broker's ``offsets.retention.minutes`` of the feed being down) starts at the
  end of the topic, or at its beginning with ``--from-beginning`` (as ``kafka-console-consumer``).
  The first start records its start position at once, so a feed stopped before any alert
  arrived still resumes where it began. ``--once`` stops after the alerts that were on the topic
  when its partitions were assigned are delivered (or given up on) and committed.
* Webhook URLs carry secrets (Slack puts the token in the path): logs and output name only the
  scheme, host and port (``rlpulse.base.urls.mask_url``), and a failure in rlpulse's own words, never
  an exception's text (urllib's quote the URL). ``user:password@`` in the URL is sent as HTTP Basic
  authorization; a URL whose password holds an unencoded ``/``, ``?`` or ``#`` cannot be read (where
  does the password end?) and is refused at the start, saying to percent-encode it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any
from collections.abc import Awaitable, Callable

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from rlpulse.base.settings import Settings
from rlpulse.schemas.codec import Codec, DecodeError
from rlpulse.base.terminal import terminal_safe
from rlpulse.schemas.topics import topic_partitions
from rlpulse.sinks.alerts.webhook import Webhook

log = logging.getLogger(__name__)


def format_alert(alert: dict[str, Any]) -> str:
    """One printed line per alert. Its key and summary name runs, GPUs and terms chosen by whoever
    wrote to a raw topic: every text field is made terminal-safe before it is padded, so the line
    stays one line and drives no terminal."""
    when = time.strftime("%H:%M:%S", time.localtime(alert["time_ns"] / 1e9))
    text = {name: terminal_safe(str(alert[name])) for name in ("state", "rule", "key", "severity", "summary")}
    return (f"{when} {text['state']:<8} {text['rule']:<21} {text['key']} [{text['severity']}] "
            f"{text['summary']} (value {alert['value']:g}, threshold {alert['threshold']:g})")


def default_group(settings: Settings) -> str:
    return f"{settings.topic_prefix}-alerts"


@dataclass
class _Item:
    tp: TopicPartition
    offset: int
    alert: dict[str, Any] | None  # None: a message without alerts, done once those before it are
    last: bool  # the message's last alert: when it is done, the offset after it may be committed


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, feed: AlertFeed):
        self.feed = feed

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.feed.commit(set(revoked))
        self.feed.forget(set(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        pass


class AlertFeed:
    """Consumes the alerts topic in a group, prints each alert, hands it to the webhook in order,
    and commits per partition the offset up to which every alert is done."""

    def __init__(self, settings: Settings, *, webhook: Webhook | None = None, group: str | None = None,
                 from_beginning: bool = False, once: bool = False, queue_size: int = 1000,
                 out: Callable[[str], None] = lambda line: print(line, flush=True)):
        self.settings, self.webhook, self.out = settings, webhook, out
        self.group = group or default_group(settings)
        self.topic = settings.topic("alerts")
        self.from_beginning, self.once = from_beginning, once
        # Undelivered alerts. Past queue_size, reading pauses (partitions paused, polling goes on:
        # the group membership, the commits and a SIGTERM are never held up by a slow webhook).
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()
        self.queue_size = queue_size
        self.done: dict[TopicPartition, int] = {}  # offset to commit: all before it delivered or given up
        self.committed: dict[TopicPartition, int] = {}
        self.end: dict[TopicPartition, int] = {}  # --once: where to stop
        self.first: dict[TopicPartition, int] = {}  # offset of the first message read since assignment
        self.codec = Codec()
        self.read = 0
        self.consumer: AIOKafkaConsumer | None = None
        self._following = False

    async def run(self, stop: asyncio.Event) -> int:
        """Until ``stop`` (or, with ``once``, the end found at start); returns the alerts read."""
        self.consumer = consumer = AIOKafkaConsumer(
            group_id=self.group, enable_auto_commit=False,
            auto_offset_reset="earliest" if self.from_beginning else "latest", **self.settings.kafka_client_kwargs())
        await consumer.start()
        worker = asyncio.create_task(self._deliver_all()) if self.webhook else None
        try:
            if not await topic_partitions(consumer, self.topic):
                raise RuntimeError(f"topic {self.topic} does not exist on {self.settings.kafka_bootstrap}")
            consumer.subscribe([self.topic], listener=_Rebalance(self))
            while not stop.is_set():
                if self.queue.qsize() >= self.queue_size:
                    consumer.pause(*consumer.assignment())
                else:
                    consumer.resume(*consumer.paused())
                for tp, messages in (await consumer.getmany(timeout_ms=200, max_records=500)).items():
                    for msg in messages:
                        self._take(tp, msg)
                await self._anchor()
                await self.commit()
                if self.once and await self._at_end():
                    break
            # --once: what was read is delivered (or given up on) and committed before the feed ends
            while self.once and worker and not stop.is_set():
                if await _until(self.queue.join(), stop, 0.5):
                    break
                await self.commit()
        finally:
            if worker:
                worker.cancel()  # an in-flight POST is abandoned: its alert stays uncommitted
                await asyncio.gather(worker, return_exceptions=True)
            try:
                await asyncio.wait_for(self._last_commit(), 3.0)
            except (asyncio.TimeoutError, KafkaError) as exc:
                log.warning("alerts: last commit failed (%s); the next start posts those alerts again", type(exc).__name__)
            try:
                await asyncio.wait_for(consumer.stop(), 5.0)
            except asyncio.TimeoutError:
                log.warning("alerts: the Kafka consumer did not stop within 5s")
        return self.read

    @property
    def pending(self) -> int:
        """Alerts read but neither delivered nor given up on (posted again at the next start)."""
        return self.read - self.webhook.delivered - self.webhook.failed if self.webhook else 0

    def _take(self, tp: TopicPartition, msg: Any) -> None:
        """Print one message's alerts and queue them for the webhook."""
        self.first.setdefault(tp, msg.offset)
        try:
            alerts = self.codec.decode(msg.value, expect=("rlpulse.v1.Alert",)).records
        except DecodeError as exc:
            log.warning("undecodable alert at %s[%d]@%d skipped: %s", msg.topic, msg.partition, msg.offset, exc)
            alerts = []
        for alert in alerts:
            self.out(format_alert(alert))
        self.read += len(alerts)
        if not self.webhook:
            self.done[tp] = msg.offset + 1
            return
        items = [_Item(tp, msg.offset, a, i == len(alerts) - 1) for i, a in enumerate(alerts)] or [
            _Item(tp, msg.offset, None, True)]
        for item in items:
            self.queue.put_nowait(item)

    async def _deliver_all(self) -> None:
        assert self.webhook is not None
        while True:
            item = await self.queue.get()
            if item.alert is not None:
                await self.webhook.deliver(item.alert)
            if item.last and item.offset + 1 > self.done.get(item.tp, -1):
                self.done[item.tp] = item.offset + 1
            self.queue.task_done()

    async def _last_commit(self) -> None:
        """The commit before the feed ends, tried again while the group is rebalancing (a member that
        joined moments ago, on a busy broker): refused, the next start would post those alerts again."""
        while True:
            try:
                return await self.commit(raise_errors=True)
            except KafkaError as exc:
                log.info("alerts: commit refused (%s); trying again", type(exc).__name__)
                await asyncio.sleep(0.2)

    async def commit(self, only: set[TopicPartition] | None = None, raise_errors: bool = False) -> None:
        consumer = self.consumer
        if consumer is None:
            return
        assigned = consumer.assignment()
        offsets = {tp: off for tp, off in self.done.items()
                   if tp in assigned and (only is None or tp in only) and self.committed.get(tp) != off}
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except KafkaError as exc:  # a rebalance under way: the new owner re-posts (at least once)
            if raise_errors:
                raise
            log.warning("alerts: commit failed (%s); those alerts may be posted again", type(exc).__name__)
            return
        self.committed.update(offsets)

    def forget(self, revoked: set[TopicPartition]) -> None:
        for tp in revoked:
            self.done.pop(tp, None)
            self.committed.pop(tp, None)
            self.end.pop(tp, None)
            self.first.pop(tp, None)
        self._following = False

    async def _anchor(self) -> None:
        """A partition without a committed offset gets its start position committed now, so a
        later start resumes there instead of at the then end of the topic. The start is the first
        message read (its alerts may still be queued), else the position the reset chose."""
        consumer = self.consumer
        assert consumer is not None
        assigned = consumer.assignment()
        if not assigned or self._following:
            return
        try:
            for tp in assigned:
                if tp not in self.done and tp not in self.committed and await consumer.committed(tp) is None:
                    self.done[tp] = self.first[tp] if tp in self.first else await consumer.position(tp)
                if self.once and tp not in self.end:
                    self.end[tp] = (await consumer.end_offsets([tp]))[tp]
        except KafkaError as exc:  # revoked meanwhile: the next assignment anchors again
            log.debug("alerts: anchoring deferred (%s)", exc)
            return
        self._following = True
        log.info("alerts: following %s as group %s (%d partitions)%s", self.topic, self.group, len(assigned),
                 f", posting to {self.webhook.origin}" if self.webhook else "")

    async def _at_end(self) -> bool:
        consumer = self.consumer
        assert consumer is not None
        if not self._following:
            return False
        try:
            for tp in consumer.assignment():
                if await consumer.position(tp) < self.end[tp]:
                    return False
            return True
        except (KafkaError, KeyError):
            return False


async def _until(awaitable: Awaitable[Any], stop: asyncio.Event, timeout: float | None = None) -> bool:
    """Await ``awaitable`` unless ``stop`` is set first (or ``timeout`` passes); True when it finished."""
    task = asyncio.ensure_future(awaitable)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return False


async def serve_alerts(settings: Settings, webhook_url: str | None, from_beginning: bool, once: bool,
                       group: str | None = None, give_up_after_s: float = 600.0, timeout_s: float = 5.0) -> int:
    import signal

    webhook = Webhook(webhook_url, give_up_after_s=give_up_after_s, timeout_s=timeout_s) if webhook_url else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    feed = AlertFeed(settings, webhook=webhook, group=group, from_beginning=from_beginning, once=once)
    count = await feed.run(stop)
    if webhook:
        print(f"webhook {webhook.origin}: {webhook.delivered} delivered, {webhook.failed} failed, "
              f"{feed.pending} not delivered (posted again at the next start)", flush=True)
    return count

"""The asyncio face of :class:`~producers.telemetry.TrainingTelemetry`, for agent frameworks.

It shares the sync object's sender: the recording calls are coroutines that never await the
network (they validate and enqueue, as the sync calls do); ``flush`` and ``close``
wait for delivery in a worker thread, so the event loop keeps running meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlpulse.producers.telemetry import TrainingTelemetry


class AsyncTrainingTelemetry:
    """``async with AsyncTrainingTelemetry(project=..., run_id=...) as tel: await tel.rollout(...)``.

    Pass ``telemetry=`` to share an existing sync object (and its sender) instead.
    """

    def __init__(self, *args: Any, telemetry: TrainingTelemetry | None = None, **kwargs: Any):
        self.sync = telemetry or TrainingTelemetry(*args, **kwargs)

    async def __aenter__(self) -> "AsyncTrainingTelemetry":
        self.sync.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def rollout(self, **kwargs: Any) -> None:
        self.sync.rollout(**kwargs)

    async def grader(self, **kwargs: Any) -> None:
        self.sync.grader(**kwargs)

    async def step_completed(self, **kwargs: Any) -> None:
        self.sync.step_completed(**kwargs)

    async def heartbeat(self) -> None:
        self.sync.heartbeat()

    async def publish_span(self, span: Any) -> bool:
        return self.sync.publish_span(span)

    async def publish_hardware(self, record_type: str, key: str, record: Any) -> bool:
        return self.sync.publish_hardware(record_type, key, record)

    @property
    def dropped(self) -> int:
        return self.sync.dropped

    @property
    def delivered(self) -> int:
        return self.sync.delivered

    async def flush(self, timeout: float = 30.0) -> int:
        return await asyncio.to_thread(self.sync.flush, timeout)

    async def close(self, timeout: float = 30.0) -> int:
        return await asyncio.to_thread(self.sync.close, timeout)

    def span_exporter(self):  # noqa: ANN201 - see TrainingTelemetry.span_exporter
        return self.sync.span_exporter()

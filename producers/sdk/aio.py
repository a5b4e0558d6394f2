"""The asyncio face of a :class:`~rlpulse.producers.sdk.telemetry.TrainingTelemetry`, for agent frameworks.

It shares the sync object's sender: the recording calls are coroutines that never await the
network (they validate and enqueue, as the sync calls do); ``flush`` and ``close`` wait for
delivery in a worker thread, so the event loop keeps running meanwhile.

The public class is ``AsyncTrainingTelemetry`` (``rlpulse.producers``), which builds its sync
object from the same arguments; it lives beside ``TrainingTelemetry`` so that this module needs
only the calls it forwards (:class:`SyncTelemetry`) and the import arrows run one way:
``telemetry`` -> ``aio``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from rlpulse.producers.sdk.process import run_status


class SyncTelemetry(Protocol):
    """The calls of ``TrainingTelemetry`` the async face forwards."""

    @property
    def dropped(self) -> int: ...

    @property
    def delivered(self) -> int: ...

    def start(self) -> None: ...

    def rollout(self, *args: Any, **kwargs: Any) -> None: ...

    def grader(self, *args: Any, **kwargs: Any) -> None: ...

    def step_completed(self, *args: Any, **kwargs: Any) -> None: ...

    def discard_step(self, step: int) -> int: ...

    def log(self, step: int, metrics: Any) -> None: ...

    def heartbeat(self) -> None: ...

    def publish_span(self, span: Any) -> bool: ...

    def publish_hardware(self, record_type: str, key: str, record: Any) -> bool: ...

    def flush(self, timeout: float = 30.0) -> int: ...

    def close(self, timeout: float = 30.0, status: str = "finished") -> int: ...

    def span_exporter(self) -> Any: ...

    def set_config(self, config: Any) -> dict[str, str]: ...


class AsyncTelemetry:
    """Coroutines over the sync telemetry ``sync``: ``async with face: await face.rollout(...)``."""

    def __init__(self, sync: SyncTelemetry):
        self.sync = sync

    async def __aenter__(self) -> AsyncTelemetry:
        self.sync.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        await self.close(status=run_status(exc_type))

    async def rollout(self, **kwargs: Any) -> None:
        self.sync.rollout(**kwargs)

    async def grader(self, **kwargs: Any) -> None:
        self.sync.grader(**kwargs)

    async def step_completed(self, **kwargs: Any) -> None:
        self.sync.step_completed(**kwargs)

    async def discard_step(self, step: int) -> int:
        return self.sync.discard_step(step)

    async def log(self, step: int, metrics: Any) -> None:
        self.sync.log(step, metrics)

    async def heartbeat(self) -> None:
        self.sync.heartbeat()

    async def publish_span(self, span: Any) -> bool:
        return self.sync.publish_span(span)

    async def publish_hardware(self, record_type: str, key: str, record: Any) -> bool:
        return self.sync.publish_hardware(record_type, key, record)

    async def set_config(self, config: Any) -> dict[str, str]:
        return self.sync.set_config(config)

    @property
    def dropped(self) -> int:
        return self.sync.dropped

    @property
    def delivered(self) -> int:
        return self.sync.delivered

    async def flush(self, timeout: float = 30.0) -> int:
        return await asyncio.to_thread(self.sync.flush, timeout)

    async def close(self, timeout: float = 30.0, status: str = "finished") -> int:
        return await asyncio.to_thread(self.sync.close, timeout, status)

    def span_exporter(self) -> Any:
        """The sync object's OpenTelemetry exporter (see ``TrainingTelemetry.span_exporter``)."""
        return self.sync.span_exporter()

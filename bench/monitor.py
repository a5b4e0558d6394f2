"""Watching the pipeline while it drains: consumer-group offsets, process memory, profiles.

Offsets are sampled with long-lived clients (one consumer for end offsets, one admin client
for committed offsets), so a sample every half second costs two requests, not two client
start-ups. Memory comes from /proc (psutil is not installed); profiles from py-spy, which
attaches to a running process without changing it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from rlpulse.base.settings import Settings
from rlpulse.schemas.topics import topics_partitions


# -- process memory ---------------------------------------------------------------------------
def _status_kib(pid: int, field_name: str) -> int:
    """A ``kB`` field of /proc/<pid>/status (VmRSS, VmHWM); 0 when the process is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (by the parent pid in /proc/*/stat)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # the command name is in parentheses and may hold spaces: split after the last ')'
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            parents.setdefault(ppid, []).append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo.extend(parents.get(current, []))
    return tree


@dataclass
class RssSampler:
    """Peak resident memory of named process trees, from samples of VmRSS and each process's VmHWM."""

    pids: dict[str, int]
    peak_kib: Counter = field(default_factory=Counter)
    samples: int = 0

    def sample(self) -> None:
        self.samples += 1
        for name, pid in self.pids.items():
            tree = process_tree(pid)
            now = sum(_status_kib(p, "VmRSS") for p in tree)
            # VmHWM is the kernel's own peak of one process: it catches a spike between two samples
            self.peak_kib[name] = max(self.peak_kib[name], now, _status_kib(pid, "VmHWM"))

    def peaks_mib(self) -> dict[str, float]:
        return {name: round(kib / 1024, 1) for name, kib in self.peak_kib.items()}


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (0 for one that is gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
        except (OSError, ValueError, IndexError):
            continue
    return total / tick


@dataclass
class CpuMeter:
    """CPU seconds each named process tree spends between :meth:`start` and :meth:`stop`.

    The drain's rate moves with whatever else the machine runs; the CPU a process spends per
    event barely does, so it is the figure that shows a change to a hot path on a busy machine.
    """

    pids: dict[str, int]
    started: dict[str, float] = field(default_factory=dict)
    spent: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self.started = {name: cpu_seconds(process_tree(pid)) for name, pid in self.pids.items()}

    def stop(self) -> dict[str, float]:
        self.spent = {name: cpu_seconds(process_tree(pid)) - self.started.get(name, 0.0) for name, pid in self.pids.items()}
        return self.spent


# -- consumer-group offsets -------------------------------------------------------------------
@dataclass
class OffsetSample:
    t: float  # time.monotonic() when the sample was taken
    end: dict[TopicPartition, int]
    committed: dict[str, dict[TopicPartition, int]]  # group -> committed offset (0 when none)

    def lag(self, group: str, topics: tuple[str, ...]) -> int:
        done = self.committed.get(group, {})
        return sum(max(n - done.get(tp, 0), 0) for tp, n in self.end.items() if tp.topic in topics)


class OffsetWatcher:
    """Samples end offsets of ``topics`` and the committed offsets of ``groups`` on them."""

    def __init__(self, settings: Settings, topics: tuple[str, ...], groups: tuple[str, ...]):
        self.kafka = settings.kafka_client_kwargs()
        self.topics = topics  # full names
        self.groups = groups
        self.tps: list[TopicPartition] = []
        self.consumer: AIOKafkaConsumer | None = None
        self.admin: AIOKafkaAdminClient | None = None

    async def __aenter__(self) -> OffsetWatcher:
        self.consumer = AIOKafkaConsumer(**self.kafka)
        self.admin = AIOKafkaAdminClient(**self.kafka)
        await self.consumer.start()
        await self.admin.start()
        self.tps = await topics_partitions(self.consumer, self.topics)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.admin is not None:
            await self.admin.close()
        if self.consumer is not None:
            await self.consumer.stop()

    async def committed(self, group: str) -> dict[TopicPartition, int]:
        assert self.admin is not None
        offsets = await self.admin.list_consumer_group_offsets(group)
        return {tp: meta.offset for tp, meta in offsets.items() if tp.topic in self.topics and meta.offset >= 0}

    async def stable(self, group: str) -> bool:
        """True when ``group`` is a Stable consumer group with members: it has its partitions and reads."""
        assert self.admin is not None
        try:
            described = await self.admin.describe_consumer_groups([group])
        except KafkaError:  # coordinator not elected yet, offsets topic still being created
            return False
        # each group is (error_code, group_id, state, protocol_type, protocol, members, ...)
        return any(g[1] == group and g[2] == "Stable" and len(g[5]) > 0 for r in described for g in r.groups)

    async def sample(self) -> OffsetSample:
        assert self.consumer is not None
        t = time.monotonic()
        end = await self.consumer.end_offsets(self.tps)
        committed = {g: await self.committed(g) for g in self.groups}
        return OffsetSample(t, dict(end), committed)


class EventIndex:
    """Events (records) before each offset of the raw topics, from what the backlog publisher sent,
    so committed offsets (messages) convert exactly to events."""

    def __init__(self) -> None:
        self._offsets: dict[TopicPartition, list[int]] = {}
        self._cumulative: dict[TopicPartition, list[int]] = {}

    def add(self, tp: TopicPartition, offset: int, records: int) -> None:
        offsets = self._offsets.setdefault(tp, [])
        cumulative = self._cumulative.setdefault(tp, [])
        if offsets and offset <= offsets[-1]:
            raise ValueError(f"offsets of {tp} must be added in increasing order")
        offsets.append(offset)
        cumulative.append((cumulative[-1] if cumulative else 0) + records)

    def events_before(self, tp: TopicPartition, offset: int) -> int:
        """Records in the messages of ``tp`` with an offset below ``offset`` (a committed offset)."""
        offsets = self._offsets.get(tp, [])
        i = bisect_left(offsets, offset)
        return self._cumulative[tp][i - 1] if i else 0

    def events_committed(self, committed: dict[TopicPartition, int]) -> int:
        return sum(self.events_before(tp, committed.get(tp, 0)) for tp in self._offsets)

    @property
    def total(self) -> int:
        return sum(c[-1] for c in self._cumulative.values() if c)


# -- profiles -----------------------------------------------------------------------------
def py_spy() -> str | None:
    """The py-spy executable next to this interpreter, or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


async def start_profile(pid: int, seconds: float, out: Path, rate: int = 50) -> asyncio.subprocess.Process | None:
    """py-spy record in collapsed-stack form; nonblocking so the target is never paused."""
    exe = py_spy()
    if exe is None:
        return None
    return await asyncio.create_subprocess_exec(
        exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", str(rate),
        "--nonblocking", "--format", "raw", "--output", str(out),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)


_LINE_NO = re.compile(r":\d+\)$")


def summarize_profile(collapsed: str, top: int = 25) -> list[str]:
    """Top functions by own samples and by inclusive samples, from py-spy's collapsed stacks.

    Line numbers are dropped so one function's lines add up to one entry.
    """
    own: Counter = Counter()
    inclusive: Counter = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        total += count
        frames = [_LINE_NO.sub(")", f) for f in stack.split(";")]
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    if total == 0:
        return ["(no samples)"]
    lines = [f"{total} samples; own time (the frame itself was running):"]
    lines += [f"{100 * n / total:6.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines.append("inclusive time (the frame or something it called was running):")
    lines += [f"{100 * n / total:6.1f}%  {frame}" for frame, n in inclusive.most_common(top)]
    return lines


def profile_report(name: str, raw: Path, output: str, top: int = 25) -> dict[str, Any]:
    """Summarize a finished py-spy recording into bench/results/profile-<name>.txt's text."""
    if not raw.exists():
        return {"error": f"py-spy wrote no profile: {output.strip()[-500:]}"}
    lines = summarize_profile(raw.read_text(errors="replace"), top)
    return {"lines": lines, "text": f"py-spy profile of rlpulse {name} during the drain\n" + "\n".join(lines) + "\n"}

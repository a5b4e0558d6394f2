"""``rlpulse status``: the local services, then one line per consumer group (its total lag, its
partitions and its members); with ``--detail`` each group's partitions under it.

A two-partition demo has 26 partitions across the streams' and the sink's groups: a line per
partition is what one reads to find *where* a group is behind, not *whether* it is, so the
summary names only the topics with a lag and the partitions come on request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from rlpulse.base.settings import Settings

# (topic, partition, committed, end), as rlpulse.pipeline.partition_lag gives them
Row = tuple[str, int, int, int]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


# Kafka's group states whose member count is settled: Stable (members, partitions assigned), Empty
# (no member, offsets kept) and Dead (no member, no metadata: a group that never committed).
SETTLED = ("Stable", "Empty", "Dead")
# The others, in a user's words: the member count is about to change.
UNSETTLED = {"PreparingRebalance": "rebalancing", "CompletingRebalance": "rebalancing",
             "Unknown": "state unknown: its coordinator did not answer"}


def group_lines(group: str, rows: Sequence[Row], committed: bool, state: str, members: int,
                detail: bool = False) -> list[str]:
    """The lines of one consumer group: its summary, then (``detail``) one line per partition,
    ``topic[partition]  committed / end = lag``.

    The summary: ``consumer group G: lag N, P partitions (T topics), M members`` then, when behind,
    ``; behind on topic n, ...`` (the topics with a lag, in the group's topic order). ``state`` is
    Kafka's group state: a group whose member count is not settled (rebalancing, its coordinator
    not elected yet) says so after the count."""
    per_topic: dict[str, int] = {}
    for topic, _partition, done, end in rows:
        per_topic[topic] = per_topic.get(topic, 0) + max(end - done, 0)
    total = sum(per_topic.values())
    who = _plural(members, "member") + ("" if state in SETTLED else f" ({UNSETTLED.get(state, state)})")
    line = (f"consumer group {group}: lag {total}, {_plural(len(rows), 'partition')} "
            f"({_plural(len(per_topic), 'topic')}), {who}")
    behind = [f"{topic} {n}" for topic, n in per_topic.items() if n > 0]
    if behind:
        line += "; behind on " + ", ".join(behind)
    if not committed:
        line += " (the group has not committed yet)"
    out = [line]
    if detail:
        names = [f"{topic}[{partition}]" for topic, partition, _, _ in rows]
        width = max(map(len, names), default=0)
        digits = max((len(str(end)) for *_, end in rows), default=1)
        out += [f"  {name.ljust(width)}  {done:>{digits}} / {end:>{digits}} = {max(end - done, 0)}"
                for name, (_, _, done, end) in zip(names, rows)]
    return out


def print_status(settings: Settings, detail: bool) -> int:
    """What ``rlpulse status`` prints; its exit code (the services' when they are not up)."""
    from rlpulse import services
    from rlpulse.pipeline import STREAMS_TOPICS, describe_group_async, existing_groups, partition_lag
    from rlpulse.producers.otlp.ingest import ingest_group
    from rlpulse.schemas.catalogue import OTLP_TOPICS, RAW_TOPICS, sink_topics

    code = services.main(settings, "status")
    if code != 0:
        return code
    groups = [(settings.app_id, STREAMS_TOPICS), (settings.sink_group, sink_topics(settings.sink_raw))]
    known = existing_groups(settings)
    # Shown when they exist: `rlpulse alerts`' group, the OTLP ingest's, and ClickHouse's Kafka engine
    # (migrate --kafka-engine).
    groups += [(g, t) for g, t in ((f"{settings.topic_prefix}-alerts", ("alerts",)), (ingest_group(settings), OTLP_TOPICS),
                                   (f"{settings.topic_prefix}-ch-kafka", RAW_TOPICS)) if g in known]
    for group, topics in groups:
        try:
            rows = partition_lag(settings, group, topics)
        except RuntimeError as exc:  # topics not created yet
            print(f"consumer group {group}: {exc}")
            continue
        state, members = asyncio.run(describe_group_async(settings, group))
        for line in group_lines(group, rows, group in known, state, len(members), detail):
            print(line)
    return 0

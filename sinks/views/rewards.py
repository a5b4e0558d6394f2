"""A trajectory's rewards in Python (seed 003's ``find_reward_spans`` / ``find_final_reward``), read as
``rlpulse export`` and the saved queries ``reward-spans`` and ``final-rewards`` read them.

A reward is the ``reward`` of the rollout's ROLLOUT span, of a REWARD entry, or of a reward annotation
(``emit_reward``: an ANNOTATION span, ``rlpulse.reward.final`` saying whether it is the final one). The
final reward is the ROLLOUT span's, else the latest REWARD entry's, else the latest final annotation's;
intermediate rewards never stand in for it. Positions are ``sequence_id`` (start order).

::

    from rlpulse.sinks.views.rewards import find_final_reward, find_reward_spans, reward_spans
    rewards = reward_spans(store, "run-1", 1, "r-17")      # from ClickHouse, in start order
    final = find_final_reward(rewards)                       # or over SpanRow lists of trajectories.select
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from rlpulse.schemas.enums import SPAN_KINDS
from rlpulse.sinks.read.queries import load_saved
from rlpulse.sinks.store.clickhouse import Store
from rlpulse.sinks.views.trajectories import SpanRow

SOURCES = ("rollout", "reward_entry", "annotation")  # the final reward's precedence, first wins
_ROLLOUT, _REWARD, _, _, _, _ANNOTATION = SPAN_KINDS[:6]  # the kinds that carry a reward, from the Span schema
SOURCE_OF = {_ROLLOUT: "rollout", _REWARD: "reward_entry", _ANNOTATION: "annotation"}
FINAL_MARK = "rlpulse.reward.final"


@dataclass(frozen=True)
class Reward:
    value: float
    source: str  # rollout, reward_entry or annotation
    sequence_id: int
    span_id: str
    final: bool  # an annotation emitted with final=True (the ROLLOUT's and REWARD entries' are final by kind)
    name: str = ""  # an annotation's rlpulse.reward.name


def _marked_final(attributes: Any) -> bool:
    return str((attributes or {}).get(FINAL_MARK, "")).lower() in ("true", "1")


def find_reward_spans(spans: Iterable[SpanRow]) -> list[Reward]:
    """Every reward among ``spans`` (one rollout's), in start order."""
    found: dict[str, Reward] = {}
    for s in spans:
        value = s.typed.get("reward")
        source = SOURCE_OF.get(s.kind)
        if value is None or source is None:
            continue
        found.setdefault(s.span_id, Reward(float(value), source, s.sequence_id, s.span_id,
                                           source == "annotation" and _marked_final(s.attributes),
                                           str(s.attributes.get("rlpulse.reward.name", ""))))
    return sorted(found.values(), key=lambda r: (r.sequence_id, r.span_id))


def final_reward_of(rewards: Sequence[Reward]) -> Reward | None:
    """The final one of a rollout's rewards (see the module docstring), or None."""
    for source in SOURCES:
        of = [r for r in rewards if r.source == source and (source != "annotation" or r.final)]
        if of:
            return max(of, key=lambda r: (r.sequence_id, r.span_id))
    return None


def find_final_reward(spans_or_rewards: Iterable[SpanRow] | Iterable[Reward]) -> float | None:
    """The trajectory's final reward, from its spans or from ``find_reward_spans``' answer."""
    items = list(spans_or_rewards)
    rewards = [r for r in items if isinstance(r, Reward)] or find_reward_spans(r for r in items if isinstance(r, SpanRow))
    final = final_reward_of(rewards)
    return None if final is None else final.value


def reward_spans(store: Store, run_id: str, attempt: int, rollout_id: str) -> list[Reward]:
    """One rollout's rewards from ClickHouse (the saved query ``reward-spans``), in start order."""
    sql = load_saved("reward-spans").replace("{db}", store.database)
    # no per-query readonly: on chDB it would stay on the caller's client (open_reader's is read-only already)
    rows = store.client.query(sql, parameters={"run_id": run_id, "attempt": attempt, "rollout_id": rollout_id}).named_results()
    return [Reward(float(r["reward"]), r["source"], int(r["sequence_id"]), r["span_id"], r["role"] == "final",
                   r["reward_name"]) for r in rows]

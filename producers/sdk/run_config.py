"""A run's configuration as the ``config`` map of its RUN_START: flat dotted names, values as text.

Seed 001's "training settings": ``TrainingTelemetry(config=...)`` and the trainer integrations send
the settings a run started with once, and the store keeps them per attempt (``steps.config``, read
by the saved query ``run-config``). ``flatten_config`` turns what a training script holds into that
map:

* **Accepted**: a Mapping, an object with ``to_dict()`` (transformers' ``TrainingArguments``, TRL's
  ``GRPOConfig``: their own serialization, which hides tokens, is preferred to their dataclass
  fields), a dataclass instance, an ``argparse.Namespace`` or ``types.SimpleNamespace`` (its ``vars``;
  OpenRLHF nests the latter), an OmegaConf ``DictConfig`` (``to_container(resolve=True)``; omegaconf
  is never imported here: such an object comes from it, so it is loaded already). Nested ones of
  these flatten to dotted names: ``{"optim": {"lr": 1e-5}}`` -> ``{"optim.lr": "1e-05"}``; an empty
  nested one is the text ``{}``, so that its name is still there.
* **Values as text**: str as is; bool ``true``/``false``; None ``null``; int and float as Python
  writes them (``repr``), NaN and infinities as ``nan``/``inf``/``-inf``; an Enum its value; a list,
  tuple or set as JSON text (sets sorted); anything else ``str(value)``.
* **Secrets never leave**: a key any of whose dotted parts looks like a credential (``is_secret``:
  contains ``api_key``, ``apikey``, ``password``, ``passwd``, ``secret``, ``credential``,
  ``private_key`` or ``access_key``, or is ``key`` (OpenRLHF's ``logger.wandb.key``) or ``token``, or
  ends in ``_token``, except a tokenizer's special tokens such as ``pad_token``, or in ``_key``, except
  dataset fields such as ``prompt_key`` and ``*metric_key``; ``-`` reads as ``_``; the parts of a
  flat name such as ``wandb.key`` count too) has its value, or its whole subtree, replaced by ``***``.
* **Bounds** (``MAX_DEPTH``, ``MAX_KEYS``, ``MAX_KEY``, ``MAX_VALUE``, ``MAX_BYTES``): a mapping nested
  deeper than ``MAX_DEPTH`` levels becomes one JSON-text value; a value longer than ``MAX_VALUE``
  characters is cut and ends in a ``…(+N chars)`` mark (counted in ``_rlpulse.config_truncated_values``);
  a key longer than ``MAX_KEY`` characters, and the keys past ``MAX_KEYS`` or past ``MAX_BYTES`` of
  UTF-8 in all (the first ones in sorted order are kept), are left out and counted in
  ``_rlpulse.config_dropped_keys``. Nothing is dropped without that count; the two marks count
  towards ``MAX_KEYS``.
* **Errors** (ValueError naming the key): a top level that is none of the above, a key that is not a
  non-empty string, two settings that flatten to the same name (``{"a.b": 1, "a": {"b": 2}}``), a
  key under the reserved prefix ``_rlpulse.``, text that is not valid UTF-8.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import math
import sys
import types
from typing import Any
from collections.abc import Callable, Mapping

from rlpulse.schemas.enums import enum_symbols

MAX_DEPTH = 8  # levels of nesting flattened; deeper mappings become one JSON-text value
MAX_KEYS = 2048  # settings kept per run: a TRL GRPOConfig has ~200, verl's whole PPO config ~900
MAX_KEY = 256  # characters of a flattened name (as the SDK's attribute keys)
MAX_VALUE = 1024  # characters of a value's text
MAX_BYTES = 256 * 1024  # UTF-8 bytes of names and values together: the RUN_START stays far below a message
RESERVED = "_rlpulse."
DROPPED_KEY = "_rlpulse.config_dropped_keys"
TRUNCATED_KEY = "_rlpulse.config_truncated_values"
REDACTED = "***"
NO_CONFIG: dict[str, str] = {}  # shared, never mutated: a run without settings
_RUN_START = enum_symbols("Step", "type")[0]  # the Step type a run's settings ride on

_SECRET_PARTS = ("api_key", "apikey", "password", "passwd", "secret", "credential", "private_key", "access_key")
# Tokenizer special tokens are text such as "<pad>", not credentials.
_NOT_SECRET_TOKENS = frozenset({"pad_token", "eos_token", "bos_token", "unk_token", "sep_token", "cls_token", "mask_token",
                                "chat_template_token", "image_token", "video_token", "audio_token"})


# Names ending in _key that are dataset fields, not credentials (OpenRLHF's input_key, verl's data.prompt_key), and
# any *metric_key (verl's best_eval_metric_key): every other *_key is taken for a credential (openai_key, wandb_key).
_NOT_SECRET_KEYS = frozenset({"input_key", "output_key", "prompt_key", "label_key", "response_key", "chosen_key",
                              "rejected_key", "reward_key", "image_key", "images_key", "text_key", "query_key",
                              "answer_key", "completion_key", "messages_key", "group_key", "sort_key", "data_key",
                              "video_key", "audio_key", "teacher_key", "reward_fn_key", "tools_key"})


def is_secret(name: str) -> bool:
    """Does any dotted part of a setting's name (``wandb.key``, ``hf.token``: a flat mapping's or an OTel
    attribute's name holds the dots itself) look like a credential? Its value is then never sent."""
    return any(_secret_part(part) for part in name.lower().replace("-", "_").split("."))


def _secret_part(lower: str) -> bool:
    if lower.endswith("_key") and lower not in _NOT_SECRET_KEYS and not lower.endswith("metric_key"):
        return True
    if any(part in lower for part in _SECRET_PARTS):
        return True
    # "key" alone is a credential (wandb's); "input_key", "prompt_key" name dataset columns
    return lower in ("key", "token") or (lower.endswith("_token") and lower not in _NOT_SECRET_TOKENS)


def flatten_config(obj: Any) -> dict[str, str]:
    """``obj`` (a run's settings) as flat dotted names to text, within the bounds; see the module docstring."""
    top = _as_mapping(obj)
    if top is None:
        raise ValueError(f"config must be a mapping, a dataclass, an object with to_dict() (TrainingArguments), an "
                         f"argparse Namespace, a SimpleNamespace or an OmegaConf DictConfig; got {type(obj).__name__}")
    flat: dict[str, str] = {}
    truncated = _flatten(top, "", 1, flat)
    return _bounded(flat, truncated)


def _as_mapping(obj: Any) -> Mapping[Any, Any] | None:
    """``obj`` as a mapping if it is one of the accepted kinds of settings, else None."""
    if isinstance(obj, Mapping):
        return obj
    if type(obj).__module__.startswith("omegaconf"):  # DictConfig is no Mapping; omegaconf is loaded if it is here
        omegaconf = sys.modules.get("omegaconf")
        if omegaconf is not None and isinstance(obj, omegaconf.DictConfig):
            try:  # an unresolvable interpolation raises omegaconf's own errors, not ValueError
                container = omegaconf.OmegaConf.to_container(obj, resolve=True)
            except Exception as exc:
                raise ValueError(f"config: OmegaConf could not resolve it: {type(exc).__name__}: {exc}") from None
            return container if isinstance(container, Mapping) else None
        return None
    if isinstance(obj, type):
        return None  # a class, not settings
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        try:
            result = to_dict()
        except Exception as exc:  # a setting's own serializer failed: said as any bad config is
            raise ValueError(f"config: {type(obj).__name__}.to_dict() raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(result, Mapping):
            raise ValueError(f"config: {type(obj).__name__}.to_dict() returned {type(result).__name__}, not a mapping")
        return result
    if dataclasses.is_dataclass(obj):
        # fields one level at a time (not dataclasses.asdict, which deep-copies every value)
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, (argparse.Namespace, types.SimpleNamespace)):
        return vars(obj)
    return None


def _flatten(mapping: Mapping[Any, Any], prefix: str, depth: int, out: dict[str, str]) -> int:
    """Add ``mapping``'s settings under ``prefix`` to ``out``; returns how many values were cut."""
    truncated = 0
    for key, value in mapping.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"config key {prefix + repr(key) if prefix else repr(key)} must be a non-empty string "
                             f"(got {type(key).__name__})")
        name = prefix + key
        if name.startswith(RESERVED):
            raise ValueError(f"config key {name!r} uses the prefix {RESERVED!r}, which rlpulse reserves for its own marks")
        if is_secret(key):
            _put(out, name, REDACTED)
            continue
        nested = None if isinstance(value, (str, int, float, type(None))) else _as_mapping(value)
        if nested and depth < MAX_DEPTH:
            truncated += _flatten(nested, name + ".", depth + 1, out)
            continue
        text = _text(name, value if nested is None else nested)
        if len(text) > MAX_VALUE:
            keep = MAX_VALUE - len(f"…(+{len(text)} chars)")  # the mark's count is no longer than len(text)
            text = text[:keep] + f"…(+{len(text) - keep} chars)"
            truncated += 1
        _put(out, name, text)
    return truncated


def _put(out: dict[str, str], name: str, text: str) -> None:
    if name in out:
        raise ValueError(f"config key {name!r} is given twice once nested names are joined with dots")
    if not name.isascii():
        try:
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"config key {name!r} is not valid text ({exc.reason} at position {exc.start})") from None
    out[name] = text


def _text(name: str, value: Any) -> str:
    """One value as text (the module docstring's rules)."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, bool):
        return "true" if value else "false"
    elif value is None:
        return "null"
    elif isinstance(value, enum.Enum):
        return _text(name, value.value)
    elif isinstance(value, int):
        return repr(int(value))
    elif isinstance(value, float):
        return repr(float(value)) if math.isfinite(value) else ("nan" if math.isnan(value) else "inf" if value > 0 else "-inf")
    elif isinstance(value, (list, tuple, set, frozenset, Mapping)):
        text = json.dumps(_jsonable(value, MAX_DEPTH), ensure_ascii=False, separators=(",", ":"))
    else:
        text = str(value)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"config key {name!r}: value is not valid text ({exc.reason} at position {exc.start})") from None
    return text


def _jsonable(value: Any, depth: int) -> Any:
    """``value`` as what ``json.dumps`` writes: containers element by element (bounded depth), NaN as text."""
    if isinstance(value, (str, bool, type(None))):
        return value
    if isinstance(value, enum.Enum):
        return _jsonable(value.value, depth)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth <= 0:
        return str(value)
    if isinstance(value, (set, frozenset)):
        return sorted((_jsonable(v, depth - 1) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, depth - 1) for v in value]
    nested = _as_mapping(value)
    if nested is not None:
        return {str(k): REDACTED if is_secret(str(k)) else _jsonable(v, depth - 1) for k, v in nested.items()}
    return str(value)


def _bounded(flat: dict[str, str], truncated: int) -> dict[str, str]:
    """The first settings in sorted order within MAX_KEYS and MAX_BYTES (long names left out), with the counts."""
    kept: dict[str, str] = {}
    dropped, size = 0, 0
    room = MAX_KEYS - 2  # the two marks may be needed
    for name in sorted(flat):
        text = flat[name]
        cost = len(name.encode()) + len(text.encode())
        if len(name) > MAX_KEY or len(kept) >= room or size + cost > MAX_BYTES:
            dropped += 1
            continue
        kept[name] = text
        size += cost
    if dropped:
        kept[DROPPED_KEY] = str(dropped)
    if truncated:
        kept[TRUNCATED_KEY] = str(truncated)
    return kept


class ConfigCalls:
    """``set_config`` and ``config`` of ``TrainingTelemetry`` (a base class of it, which sets the attributes)."""

    _config: dict[str, str]
    _started_ns: int | None
    _open: bool
    _forked: bool
    _counts_steps: bool
    _step_event: Callable[..., None]

    def set_config(self, config: Any) -> dict[str, str]:
        """Give the run's settings (what ``config=`` takes) once the object exists; returns them flattened.

        Before ``start()`` they ride on its RUN_START. After it (an integration handed a started
        object) they go out at once on a second RUN_START that carries only them, stamped with the
        first one's time and the current ``step_count``: it moves no step boundary (the saved queries
        that bound a run's first step by its RUN_START read the same time) and no step count (the
        stall detector takes it as a heartbeat; the streams do nothing else with a RUN_START). The
        saved query ``run-config`` reads the attempt's latest RUN_START with settings. Only rank 0
        sends it, as every run event; a forked worker sends none; empty settings send nothing (an
        integration handing over a trainer's empty arguments says nothing new). A bad ``config``
        raises ValueError and changes nothing.
        """
        flat = flatten_config(config)
        self._config = flat
        if flat and self._open and self._started_ns is not None and not self._forked and self._counts_steps:
            self._step_event(_RUN_START, config=flat, time_ns=self._started_ns)
        return dict(flat)

    @property
    def config(self) -> dict[str, str]:
        """The run's settings as sent (flattened; a copy); empty when none were given."""
        return dict(self._config)

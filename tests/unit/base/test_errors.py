"""``except rlpulse.Error`` catches every error rlpulse raises on purpose, and each keeps the
built-in class it had, so code that caught ``ValueError`` or ``RuntimeError`` still does."""

from __future__ import annotations

import ast
import importlib

import pytest

import rlpulse
from tests import layers

# Errors that stand for someone else's: the simulated agent's LLM provider failing, as a real
# client's error would (what the tracing records of a failed call).
NOT_OURS = {"rlpulse.producers.simulators.tracing_sim.SimulatedAPIError"}


def _exception_classes() -> list[type]:
    found = []
    for module, path in layers.MODULES.items():
        names = [n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)]
        if not names:
            continue
        mod = importlib.import_module(module)
        found += [c for n in names if isinstance(c := getattr(mod, n), type) and issubclass(c, BaseException)
                  and f"{module}.{n}" not in NOT_OURS]
    return found


def test_every_error_class_is_an_rlpulse_error() -> None:
    classes = _exception_classes()
    assert len(classes) >= 23
    assert [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, rlpulse.Error)] == []


def test_an_error_is_caught_as_rlpulse_error_and_as_its_builtin() -> None:
    from rlpulse.schemas.codec import Codec, DecodeError

    with pytest.raises(rlpulse.Error) as caught:
        Codec().decode(b"not a container")
    assert isinstance(caught.value, DecodeError) and isinstance(caught.value, ValueError)
    from rlpulse.sinks.write.inserter import InsertStillRunning

    assert issubclass(InsertStillRunning, OSError) and issubclass(InsertStillRunning, rlpulse.Error)

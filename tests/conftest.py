"""Options and helpers for the whole suite.

* ``--backend=local|containers|all`` picks the backends the integration tests run against
  (``tests/integration/conftest.py``): ``local`` (the default) is the broker of ``rlpulse
  services up`` and chDB; ``containers`` is Kafka and ClickHouse server containers
  (testcontainers, needs a Docker engine; ``make test-containers``). What a backend does not run
  is deselected, not skipped: a normal run shows no containers variants skipped for want of Docker.
* The tiers are markers (pyproject.toml): ``make test`` runs ``-m "not full"``, ``make test-all``
  everything.
* :func:`unavailable`: what a test calls when a tool it needs is missing (chromium, tmux, the C
  decoder). It skips on a developer's machine and fails under ``CI=true``, where a missing tool
  would otherwise turn a tested component into a quiet SKIPPED.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

BACKENDS = ("local", "containers")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--backend", choices=(*BACKENDS, "all"), default="local",
                     help="the integration tests' backend: local (the local broker and chDB, the default), "
                          "containers (Kafka and ClickHouse server containers, needs Docker) or all")


def backends(config: pytest.Config) -> tuple[str, ...]:
    """The backends ``--backend`` asks for."""
    chosen = config.getoption("backend")
    return BACKENDS if chosen == "all" else (chosen,)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (rather than skip) what the chosen backends do not run: tests marked ``containers``
    unless the containers backend is asked for, and under ``--backend=containers`` the tests that
    take no backend (they would only repeat the local run)."""
    chosen = backends(config)
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        backend_param = params.params.get("backend") if params is not None else None
        if item.get_closest_marker("containers"):
            wanted = "containers" in chosen
        elif backend_param is not None:
            wanted = backend_param in chosen
        else:
            wanted = "local" in chosen
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test because ``reason`` (a missing tool, said with how to install it);
    under ``CI=true`` fail it instead: CI installs every tool, so its absence is a broken set-up."""
    if in_ci():
        pytest.fail(f"CI=true, and {reason}", pytrace=False)
    pytest.skip(reason)

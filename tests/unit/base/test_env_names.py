"""Environment variable names are listed once: ``rlpulse.base.env``.

* every ``RLPULSE_*`` name anywhere in the repository (code, tests, compose, deploy files, the
  docs) is one of its variables, so a misspelt name in a message or a test cannot go unnoticed;
* the settings' variables are exactly ``Settings._ENV``'s, and a child process given
  ``Settings.env()`` gets the same settings back;
* outside ``base/env.py`` no code under the five packages or ``bench/`` writes a variable's
  name in a string (docstrings and comments, which document, aside): it imports the constant;
* the settings reference (docs/reference/settings.md) names every variable.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import re
from pathlib import Path

from rlpulse.base import env as envvars
from rlpulse.base.faults import Faults
from rlpulse.base.settings import Settings

ROOT = Path(__file__).resolve().parents[3]
NAME = re.compile(r"RLPULSE_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])")
# Files a person or a tool reads the names from; caches, the venv and the homes are not ours.
TEXT_SUFFIXES = {".py", ".pyx", ".md", ".yml", ".yaml", ".xml", ".toml", ".cfg", ".ini", ".sql", ".json", ".sh", ".txt"}
TEXT_NAMES = {"Makefile", "Dockerfile", "run"}
SKIP_DIRS = {".git", ".venv", ".rlpulse", ".cache", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis",
             "__pycache__", "node_modules", "test-artifacts", "build", "dist"}
CODE = ("rlpulse", "base", "schemas", "producers", "streams", "sinks", "bench", "examples")


def _files() -> list[Path]:
    found = []
    for top, dirs, names in os.walk(ROOT):
        # pruned, not walked: .venv-trl, .venv-agentlightning ... (the trainers' and clients' own venvs,
        # gigabytes in a clone that ran make test-all: walking them took this test from 1 s to 40 s)
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv") and not d.endswith(".egg-info")]
        for name in names:
            path = Path(top) / name
            if (path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES) and path.is_file():
                found.append(path)
    return found


def test_every_name_in_the_repository_is_listed() -> None:
    unknown = sorted({(str(path.relative_to(ROOT)), name) for path in _files()
                      for name in NAME.findall(path.read_text(errors="replace"))
                      if name not in envvars.VARIABLES})
    assert unknown == [], "add these to rlpulse.base.env (or fix the spelling)"


def test_each_variable_says_what_it_means_and_is_used() -> None:
    assert all(meaning.strip() for _, meaning in envvars.VARIABLES.values())
    constants = {
        value: key
        for key, value in vars(envvars).items()
        if key.isupper() and isinstance(value, str) and value in envvars.VARIABLES
    }
    assert sorted(constants) == sorted(envvars.VARIABLES)  # one constant each
    texts = [p.read_text(errors="replace") for p in _files() if p != ROOT / "base" / "env.py"]
    importers = "".join(t for t in texts if "rlpulse.base" in t and "env" in t)
    unused = [
        name
        for name in envvars.VARIABLES
        if not any(name in t for t in texts) and not re.search(rf"\b{constants[name]}\b", importers)
    ]
    assert unused == [], "listed but neither named nor read anywhere: remove them"


def test_the_settings_variables_are_settings_env_table() -> None:
    assert set(Settings._ENV) == set(envvars.of_kind(envvars.SETTINGS))


def test_a_child_given_settings_env_gets_the_same_settings(tmp_path: Path) -> None:
    parent = Settings.load(
        {
            envvars.HOME: str(tmp_path),
            envvars.WINDOW: "5s",
            envvars.SINK_RAW: "0",
            envvars.KAFKA_BOOTSTRAP: "10.0.0.1:9092",
            envvars.ALERT_XID_QUIET_AFTER: "1m",
            envvars.TTL_RAW_DAYS: "7",
            envvars.FAULTS: "drop_first=1",
        }
    )
    env = parent.env()
    assert set(env) == set(Settings._ENV) - {envvars.FAULTS}  # faults go to the one process a test names
    assert env[envvars.CLICKHOUSE_URL] == f"chdb://{tmp_path / 'clickhouse'}"  # the store in full
    child = Settings.load(env)
    assert dataclasses.replace(child, clickhouse_url="", faults=parent.faults) == parent
    assert child.faults == Faults()


def _documenting(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (statements of their own)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def test_code_names_variables_through_the_constants() -> None:
    literal = []
    for folder in CODE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == ROOT / "base" / "env.py":
                continue
            tree = ast.parse(path.read_text(), str(path))
            docs = _documenting(tree)
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and id(node) not in docs
                    and NAME.search(node.value)
                ):
                    literal.append(f"{path.relative_to(ROOT)}:{node.lineno}: {NAME.findall(node.value)}")
    assert literal == [], "import the name from rlpulse.base.env:\n" + "\n".join(literal)


def test_the_settings_reference_documents_every_variable() -> None:
    page = (ROOT / "docs" / "reference" / "settings.md").read_text()
    missing = [name for name in envvars.VARIABLES if name not in page]
    assert missing == [], "run `rlpulse reference`: docs/reference/settings.md is generated from rlpulse.base.env"

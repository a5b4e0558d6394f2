"""What the docstrings, comments, the README and the guides in docs/ point to exists.

Read from the docstrings (module, class, function) and ``#`` comments of every module under
``rlpulse/ base/ schemas/ producers/ streams/ sinks/ bench/ tests/``, and from README.md and docs/:

* every ``*.py`` path names a file of the repository (``sinks/write/writer.py``, or ``writer.py`` beside
  the module that says it), so a file that moved leaves no pointer behind;
* every dotted name of our modules resolves as it imports: ``rlpulse.schemas.codec.Codec.encode``
  is a module, then a name defined at its top level, then one in that class. The repository's
  folders install under ``rlpulse``, so a module named by its folder alone, without the
  ``rlpulse.`` in front, names nothing importable and is reported (``python -m`` included);
  ``bench.<name>`` is a file of ``bench/``, run from the checkout;
* ``rlpulse.<name>`` that is not a module is one of the names the pipeline gives things of its
  own: a topic, a ClickHouse table, an OpenTelemetry attribute key the code reads, the Avro namespace;
* nothing names the wire format after the codec it replaced (``WIRE_BEFORE``): each Kafka message
  is an Avro Object Container File.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

import rlpulse
from rlpulse.schemas.catalogue import TABLES, TOPICS
from rlpulse.schemas.codec import NAMESPACE
from rlpulse.sinks.store.kafka_engine import ERRORS_TABLE

ROOT = Path(__file__).resolve().parents[2]
CODE = ("rlpulse", "base", "schemas", "producers", "streams", "sinks", "bench", "tests")
PACKAGES = {"base": "rlpulse.base", "schemas": "rlpulse.schemas", "producers": "rlpulse.producers", "streams": "rlpulse.streams",
            "sinks": "rlpulse.sinks"}
SKIP_DIRS = {".git", ".venv", ".rlpulse", ".cache", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis",
             "__pycache__", "node_modules", "test-artifacts", "build", "dist"}
# Files named on purpose that are not ours: another project's, or one a test writes elsewhere.
NOT_OURS = {
    "checkpointing/checkpoint.py",  # quixstreams' module, which sinks/write/checkpoint.py follows
    "train.py",  # the training job tests/integration/producers/sdk/test_sdk_foreign_repo.py writes into a temporary folder
}
PY_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.py)\b")
WIRE_BEFORE = re.compile("single[- ]" + "object", re.IGNORECASE)  # split: this module names it too
DOTTED = re.compile(r"(?<![\w./-])((?:rlpulse|base|schemas|producers|streams|sinks|bench)(?:\.[A-Za-z_]\w*)+)")


def _sources() -> list[Path]:
    return [p for folder in CODE for p in sorted((ROOT / folder).rglob("*.py"))
            if not any(part in SKIP_DIRS for part in p.relative_to(ROOT).parts)]


def _docs(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of each docstring line and each comment of a module."""
    src = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                for i, line in enumerate(first.value.value.splitlines()):
                    yield first.value.lineno + i, line


def _all_docs() -> Iterator[tuple[str, str]]:
    """(where, text): every docstring and comment line of the code, then every line of the README
    and of the guides under docs/."""
    for path in _sources():
        for line, text in _docs(path):
            yield f"{path.relative_to(ROOT)}:{line}", text
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, text in enumerate(page.read_text().splitlines(), 1):
            yield f"{page.relative_to(ROOT)}:{i}", text


def _repo_files() -> list[str]:
    return [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")
            if not any(part in SKIP_DIRS or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts[:-1])]


def _module_file(dotted: list[str]) -> tuple[Path | None, list[str]]:
    """The file of the longest module prefix of a dotted name under ``rlpulse`` and the names after it."""
    if len(dotted) > 1 and f"rlpulse.{dotted[1]}" in PACKAGES.values():
        folder, rest = ROOT / dotted[1], dotted[2:]
    else:
        folder, rest = ROOT / "rlpulse", dotted[1:]
    found: Path | None = folder / "__init__.py"
    while rest:
        sub = folder / rest[0]
        if (sub / "__init__.py").exists():
            folder, found, rest = sub, sub / "__init__.py", rest[1:]
        elif sub.with_suffix(".py").exists():
            return sub.with_suffix(".py"), rest[1:]
        elif sub.with_suffix(".pyx").exists():  # the C block decoder: a module, its names not read here
            return None, []
        else:
            break
    return found, rest


def _defined(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            names |= _defined(node.body) | _defined(getattr(node, "orelse", []))
    return names


def _resolves(dotted: str) -> bool:
    path, rest = _module_file(dotted.split("."))
    if path is None or not path.exists():
        return path is None
    if not rest:
        return True
    tree = ast.parse(path.read_text())
    top = _defined(tree.body)
    if rest[0] not in top:
        lazy = "__getattr__" in top and re.search(rf"['\"]{rest[0]}['\"]", path.read_text()) is not None
        return lazy
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == rest[0]), None)
    return cls is None or len(rest) == 1 or rest[1] in _defined(cls.body)


def _our_names() -> set[str]:
    """What ``rlpulse.<name>`` may be besides a module: topics (default prefix), tables (default
    database), the OpenTelemetry attribute keys the code reads, the Avro namespace."""
    names = {t.short for t in TOPICS} | set(TABLES.values()) | {ERRORS_TABLE, NAMESPACE.split(".", 1)[1]}
    for path in _sources():
        if path.parts[len(ROOT.parts)] in ("tests", "bench"):  # their SQL names tables of their own
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names |= set(re.findall(r"(?<![\w.])rlpulse\.([a-z_]+)\b", node.value))
    return names


def test_every_py_path_named_exists() -> None:
    files = _repo_files()
    missing = []
    for where, text in _all_docs():
        here = (ROOT / where.split(":")[0]).parent
        for ref in PY_PATH.findall(text):
            if ref in NOT_OURS or (ROOT / ref).exists() or (here / ref).exists():
                continue
            if any(f == ref or f.endswith("/" + ref) for f in files):
                continue
            missing.append(f"{where}: {ref}")
    assert missing == []


def test_every_module_named_imports_as_written() -> None:
    ours = _our_names()
    wrong = []
    for where, text in _all_docs():
        for ref in DOTTED.findall(text):
            head, *rest = ref.split(".")
            if head == "bench":
                ok = (ROOT / "bench" / f"{rest[0]}.py").exists()
            elif head in PACKAGES:
                ok = not ((ROOT / head / f"{rest[0]}.py").exists() or (ROOT / head / f"{rest[0]}.pyx").exists()
                          or (ROOT / head / rest[0] / "__init__.py").exists())
            else:
                known = (rest[0] in PACKAGES or (ROOT / "rlpulse" / f"{rest[0]}.py").exists()
                         or rest[0] in rlpulse.__all__)
                ok = _resolves(ref) if known else rest[0] in ours
            if not ok:
                wrong.append(f"{where}: {ref}")
    assert wrong == []


def test_no_single_object_encoding_is_described() -> None:
    said = [where for where, text in _all_docs() if WIRE_BEFORE.search(text)]
    assert said == []


def test_the_check_sees_a_stale_reference() -> None:
    """The checks themselves: names that moved are reported, names that exist are not."""
    assert not _resolves("rlpulse.settings.Settings") and _resolves("rlpulse.base.settings.Settings")
    assert _resolves("rlpulse.schemas.codec.Codec.encode") and not _resolves("rlpulse.schemas.codec.Codec.nothing")
    assert _resolves("rlpulse.TrainingTelemetry") and _resolves("rlpulse.schemas._blockdecode")
    assert not _resolves("rlpulse.streams.windows") and "settings" not in _our_names()
    assert PY_PATH.findall("see ``rlpulse/settings.py`` and sinks/*.py") == ["rlpulse/settings.py"]

"""The house's ground is at the bottom: facts anyone can check by reading the imports.

Every ``import`` and ``from ... import`` in the five packages is read with ``ast`` (imports inside
functions count too), each folder mapped to the name it installs as (``producers/`` ->
``rlpulse.producers``). Then:

* the ground (``rlpulse.schemas``: schemas, codec, catalogue, settings, file helpers, faults)
  imports nothing of producers, streams, sinks or the wiring;
* producers, streams and sinks never import one another, nor the CLI, nor the service launchers;
  of the wiring package they may import nothing at all (their configuration is at the ground);
* no import circles between modules;
* no module imports another module's private (``_name``) names;
* nothing imports the bare folder names (``schemas``, ``producers``, ...), which a training
  repository's own packages would shadow.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"schemas": "rlpulse.schemas", "producers": "rlpulse.producers", "streams": "rlpulse.streams",
           "sinks": "rlpulse.sinks", "rlpulse": "rlpulse"}
PARTS = ("rlpulse.producers", "rlpulse.streams", "rlpulse.sinks")


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


MODULES = _modules()


def _package_of(module: str) -> str:
    """The part a module belongs to: rlpulse.schemas, rlpulse.producers, ... or rlpulse (the wiring)."""
    for part in ("rlpulse.schemas", *PARTS):
        if module == part or module.startswith(part + "."):
            return part
    return "rlpulse"


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, str | None, int]] = []
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = module.split(".") if is_pkg else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                found.append((base, a.name, node.lineno))
    return found


def _edges() -> dict[str, set[str]]:
    """module -> the project modules it imports (a ``from pkg import mod`` counts as importing mod)."""
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for base, name, _ in _imports(module):
            target = f"{base}.{name}" if name and f"{base}.{name}" in MODULES else base
            if target in MODULES and target != module:
                edges[module].add(target)
    return edges


def test_every_folder_module_is_seen() -> None:
    assert "rlpulse.producers.telemetry" in MODULES and "rlpulse.schemas.settings" in MODULES
    assert "rlpulse.streams.app" in MODULES and "rlpulse.sinks.sink" in MODULES and "rlpulse.cli" in MODULES


def test_no_bare_folder_imports() -> None:
    bare = [(m, base, line) for m in MODULES for base, _, line in _imports(m)
            if base.split(".")[0] in ("schemas", "producers", "streams", "sinks")]
    assert bare == [], "import these as rlpulse.<folder>: a user's own package of that name would shadow them"


def test_the_ground_imports_nothing_above_it() -> None:
    edges = _edges()
    upward = sorted((m, t) for m, ts in edges.items() if _package_of(m) == "rlpulse.schemas"
                    for t in ts if _package_of(t) != "rlpulse.schemas")
    assert upward == []


def test_parts_import_only_themselves_and_the_ground() -> None:
    edges = _edges()
    wrong = sorted((m, t) for m, ts in edges.items() if _package_of(m) in PARTS
                   for t in ts if _package_of(t) not in (_package_of(m), "rlpulse.schemas"))
    assert wrong == [], "producers, streams and sinks import only themselves and rlpulse.schemas (the ground)"


def test_no_import_circles() -> None:
    edges = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(MODULES):
        if v not in index:
            visit(v)
    assert circles == [], "\n".join(" <-> ".join(c) for c in circles)


def _private_attributes(module: str) -> list[tuple[str, str, int]]:
    """``alias._name`` where ``alias`` is a project module this module imported (``from rlpulse
    import services`` then ``services._kafka_dir``): a private name reached through the module."""
    tree = ast.parse(MODULES[module].read_text())
    aliases: dict[str, str] = {}
    for base, name, _ in _imports(module):
        target = f"{base}.{name}" if name else base
        if target in MODULES and target != module:
            aliases[(name or base).split(".")[-1] if name else base] = target
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in MODULES:
                    aliases[a.asname] = a.name
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append((module, f"{aliases[node.value.id]}.{node.attr}", node.lineno))
    return found


def test_no_private_names_across_modules() -> None:
    crossing = sorted((m, f"{base}.{name}", line) for m in MODULES for base, name, line in _imports(m)
                      if name and name.startswith("_") and not name.startswith("__")
                      and base.split(".")[0] == "rlpulse" and base != m)
    # A C extension's own module is private by name (rlpulse.schemas._blockdecode): importing
    # it from its one user is the point of the underscore, not a crossing.
    crossing = [c for c in crossing if not c[1].startswith("rlpulse.schemas._blockdecode")]
    crossing += [c for m in MODULES for c in _private_attributes(m)]
    assert crossing == [], "\n".join(f"{m}:{line} imports {name}" for m, name, line in crossing)

"""The import-layer check of ``make lint`` (``python -m tests.layers``), also run by the unit tests.

Every ``import`` and ``from ... import`` in the installed folders is read with ``ast`` (imports
inside functions count too), each folder mapped to the name it installs as (``sinks/write/`` ->
``rlpulse.sinks.write``), so the check sees the arrows that tools reading the file tree miss.
It fails on:

* an arrow from a room to a room it may not import (:data:`ROOMS`: each room names the rooms
  below it; anything else is above it or beside it);
* a circle between modules. ``from package import module`` counts as an arrow to the package's
  ``__init__`` as well, since it reads the package first: a module that takes anything from the
  ``__init__`` which imports it is a circle;
* a module reaching another module's private (``_name``) names;
* an import of a bare folder name (``schemas``, ``producers``, ...), which a training
  repository's own package of that name would shadow.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"base": "rlpulse.base", "schemas": "rlpulse.schemas", "producers": "rlpulse.producers",
           "streams": "rlpulse.streams", "sinks": "rlpulse.sinks", "rlpulse": "rlpulse"}
GROUND = ("rlpulse.base", "rlpulse.schemas")
# Each room, lowest first, with the rooms it may import besides itself. The wiring (``rlpulse``:
# the CLI, the launchers) may import any room; no room imports the wiring.
ROOMS: dict[str, tuple[str, ...]] = {
    "rlpulse.base": (),
    "rlpulse.schemas": ("rlpulse.base",),
    "rlpulse.producers.sdk": GROUND,
    "rlpulse.producers.tracing": (*GROUND, "rlpulse.producers.sdk"),
    "rlpulse.producers.pollers": (*GROUND, "rlpulse.producers.sdk"),
    "rlpulse.producers.integrations": (*GROUND, "rlpulse.producers.sdk", "rlpulse.producers.tracing"),
    "rlpulse.producers.otlp": (*GROUND, "rlpulse.producers.sdk", "rlpulse.producers.tracing"),
    "rlpulse.producers.simulators": (*GROUND, "rlpulse.producers.sdk", "rlpulse.producers.tracing",
                                     "rlpulse.producers.pollers"),
    # the package's __init__ hands the SDK's and tracing's public names on
    "rlpulse.producers": (*GROUND, "rlpulse.producers.sdk", "rlpulse.producers.tracing"),
    "rlpulse.streams": GROUND,
    "rlpulse.sinks.store": GROUND,
    "rlpulse.sinks.write": (*GROUND, "rlpulse.sinks.store"),
    "rlpulse.sinks.read": (*GROUND, "rlpulse.sinks.store"),
    "rlpulse.sinks.views": (*GROUND, "rlpulse.sinks.store", "rlpulse.sinks.read"),
    "rlpulse.sinks.alerts": GROUND,
    "rlpulse.sinks.prometheus": (*GROUND, "rlpulse.sinks.store", "rlpulse.sinks.read"),
    "rlpulse.sinks": (),
}
BARE = ("base", "schemas", "producers", "streams", "sinks")
# A C extension's own module is private by name: importing it from its one user is the point of
# the underscore, not a crossing.
PRIVATE_OK = ("rlpulse.schemas._blockdecode", "rlpulse.schemas._blockencode")


def modules() -> dict[str, Path]:
    """Every module of the installed folders, by the name it installs as."""
    mods: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if folder == "rlpulse" and parts and parts[0] in ("kafka",):
                continue
            mods[".".join([package, *parts])] = path
    return mods


MODULES = modules()


def room_of(module: str) -> str:
    """The room a module lives in: the longest room name that is a prefix of it, else the wiring."""
    best = "rlpulse"
    for room in ROOMS:
        if (module == room or module.startswith(room + ".")) and len(room) > len(best):
            best = room
    return best


def imports(module: str) -> list[tuple[str, str | None, int]]:
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


def edges() -> dict[str, set[str]]:
    """module -> the project modules it imports. ``from pkg import mod`` is an arrow to ``mod`` and,
    where ``pkg`` is one of ours, to ``pkg`` (its ``__init__``) too."""
    out: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for base, name, _ in imports(module):
            targets = {base}
            if name and f"{base}.{name}" in MODULES:
                targets.add(f"{base}.{name}")
            out[module] |= {t for t in targets if t in MODULES and t != module}
    return out


def allowed(module: str, target: str) -> bool:
    """Whether ``module`` may import ``target``: same room, a room below, or ``module`` is the wiring."""
    room, other = room_of(module), room_of(target)
    return room == "rlpulse" or other == room or other in ROOMS[room]


def layer_violations() -> list[str]:
    return [f"{module} ({room_of(module)}) imports {target} ({room_of(target)}): not a room below it"
            for module, targets in edges().items() for target in sorted(targets) if not allowed(module, target)]


def circles(graph: dict[str, set[str]] | None = None) -> list[list[str]]:
    """Strongly connected components of more than one module: each is a circle of imports."""
    graph = edges() if graph is None else graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _private_attributes(module: str) -> list[str]:
    """``alias._name`` where ``alias`` is a project module this module imported."""
    tree = ast.parse(MODULES[module].read_text())
    aliases: dict[str, str] = {}
    for base, name, _ in imports(module):
        target = f"{base}.{name}" if name else base
        if target in MODULES and target != module:
            aliases[(name or base).split(".")[-1] if name else base] = target
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name in MODULES:
                    aliases[a.asname] = a.name
    return [f"{module}:{node.lineno} reaches {aliases[node.value.id]}.{node.attr}" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def private_crossings() -> list[str]:
    found = [f"{m}:{line} imports {base}.{name}" for m in MODULES for base, name, line in imports(m)
             if name and name.startswith("_") and not name.startswith("__") and base.split(".")[0] == "rlpulse"
             and base != m and base not in PRIVATE_OK]
    return found + [c for m in MODULES for c in _private_attributes(m)]


def bare_imports() -> list[str]:
    return [f"{m}:{line} imports {base}: import it as rlpulse.{base}" for m in MODULES for base, _, line in imports(m)
            if base.split(".")[0] in BARE]


def main() -> int:
    problems = (layer_violations() + [" <-> ".join(c) for c in circles()] + private_crossings() + bare_imports())
    for p in problems:
        print(p)
    print(f"layers: {len(MODULES)} modules in {len(ROOMS) + 1} rooms, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""The trainer venv (``.venv-trl`` in the checkout): TRL and its pinned stack plus the SDK, as a user's
training job would have it, and none of the pipeline's extras.

It is built in two layers so that a change to the SDK costs seconds, not a 5 GB download:

* the framework: ``requirements-trl.txt`` installed into a fresh venv, keyed on that file's text
  and the interpreter's version (a new pin rebuilds the venv from nothing);
* the SDK: a wheel built from a copy of the checkout (never in-tree: a build would write
  ``build/`` and an egg-info folder into the working tree of the developer's editable install)
  and installed over the previous one, keyed on the digest of the files the wheel is built from.

Run as a script to build it ahead of the test: ``.venv/bin/python tests/trainers/trainer_venv.py``.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable, Iterator

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = Path(__file__).with_name("requirements-trl.txt")
VENV = ROOT / ".venv-trl"
FRAMEWORK_KEY = ".rlpulse-framework-key"
SDK_KEY = ".rlpulse-sdk-key"
# What `pip install <checkout>` builds the SDK from (pyproject.toml lists every package folder, so all must be there).
SDK_SOURCES = ("pyproject.toml", "setup.py", "README.md", "rlpulse", "base", "schemas", "producers", "streams", "sinks")
SKIP = ("__pycache__", "*.so", "*.c", "*.pyc")


class VenvError(RuntimeError):
    """The trainer venv could not be built; the message ends with the failing command's output."""


def _files(root: Path) -> Iterator[Path]:
    for name in SDK_SOURCES:
        path = root / name
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.is_file() and not any(p.match(s) for s in SKIP))


def sdk_key(root: Path = ROOT) -> str:
    digest = hashlib.sha256()
    for path in _files(root):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def framework_key(requirements: Path = REQUIREMENTS) -> str:
    version = ".".join(map(str, sys.version_info[:3]))
    return hashlib.sha256(f"python {version}\n{requirements.read_text()}".encode()).hexdigest()


def _run(cmd: list[str], what: str, log: Callable[[str], None]) -> None:
    started = time.monotonic()
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise VenvError(f"{what} failed ({' '.join(cmd)} exited {done.returncode}):\n{done.stdout[-4000:]}")
    log(f"{what}: {time.monotonic() - started:.0f}s")


def _read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


def python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def is_current(venv: Path = VENV, root: Path = ROOT, requirements: Path = REQUIREMENTS) -> bool:
    return (python(venv).exists() and _read(venv / FRAMEWORK_KEY) == framework_key(requirements)
            and _read(venv / SDK_KEY) == sdk_key(root))


def ensure(venv: Path = VENV, root: Path = ROOT, log: Callable[[str], None] = print,
           requirements: Path = REQUIREMENTS) -> Path:
    """The venv's python, building what is missing or stale; raises VenvError (with pip's output).

    ``requirements``: the framework layer's pinned packages (another file makes another venv, as
    ``tests/agents/agent_venv.py`` does for the agent stacks)."""
    key = framework_key(requirements)
    if not python(venv).exists() or _read(venv / FRAMEWORK_KEY) != key:
        shutil.rmtree(venv, ignore_errors=True)
        # the interpreter behind this one (a venv's python makes a venv of its base interpreter)
        _run([sys.executable, "-m", "venv", str(venv)], "create the venv", log)
        _run([str(python(venv)), "-m", "pip", "install", "--quiet", "--upgrade", "pip"], "upgrade pip", log)
        _run([str(python(venv)), "-m", "pip", "install", "--quiet", "-r", str(requirements)],
             f"install {requirements.name}", log)
        (venv / FRAMEWORK_KEY).write_text(key + "\n")
        (venv / SDK_KEY).unlink(missing_ok=True)
    key = sdk_key(root)
    if _read(venv / SDK_KEY) != key:
        with tempfile.TemporaryDirectory(prefix="rlpulse-sdk-") as tmp:
            source, wheels = Path(tmp) / "src", Path(tmp) / "wheels"
            source.mkdir()
            for name in SDK_SOURCES:
                path = root / name
                if path.is_dir():
                    shutil.copytree(path, source / name, ignore=shutil.ignore_patterns(*SKIP))
                elif path.exists():
                    shutil.copy2(path, source / name)
            _run([str(python(venv)), "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(source)],
                 "build the SDK wheel", log)
            wheel = next(wheels.glob("rlpulse-*.whl"))
            # uninstall first: the version number does not change with the code, so pip would keep the old one
            _run([str(python(venv)), "-m", "pip", "uninstall", "--quiet", "-y", "rlpulse"], "remove the old SDK", log)
            _run([str(python(venv)), "-m", "pip", "install", "--quiet", str(wheel)], "install the SDK", log)
        (venv / SDK_KEY).write_text(key + "\n")
    return python(venv)


if __name__ == "__main__":
    started = time.monotonic()
    print(ensure(), f"ready in {time.monotonic() - started:.0f}s")

"""The real OpenTelemetry Collector (``deploy/otelcol/builder.yaml``: otlpreceiver -> kafkaexporter),
built once and cached outside the clone, for tests that put it between a job and rlpulse.

* :func:`ensure`: the ``otelcol-rlpulse`` binary, built with the pinned Collector builder
  (``go install go.opentelemetry.io/collector/cmd/builder@v0.165.0`` into a cache-local GOBIN) and
  cached under ``$XDG_CACHE_HOME/rlpulse/otelcol/<sha256 of builder.yaml>/`` (``~/.cache`` without
  it): a new manifest builds a new binary; the same manifest never builds twice, and a file lock
  keeps two processes (two pytest workers, two sessions) from building at once. The build costs
  about 90 s and 830 MB of memory cold (module and build caches empty), about a second warm.
* :func:`start`: the Collector on a config, with an environment of its own; :func:`wait_ready`
  polls its OTLP/HTTP port.

Run as a script to build it ahead: ``.venv/bin/python tests/otelcol.py``.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = ROOT / "deploy" / "otelcol" / "builder.yaml"
CONFIG = ROOT / "deploy" / "otelcol" / "otelcol.yaml"
BUILDER = "go.opentelemetry.io/collector/cmd/builder"
BUILDER_VERSION = "v0.165.0"  # the release of every core module in builder.yaml
NAME = "otelcol-rlpulse"  # dist.name in builder.yaml
OUTPUT_KEY = "  output_path:"  # the manifest's one output_path line, replaced by an absolute one


class CollectorError(RuntimeError):
    """The Collector could not be built or started; the message ends with the tool's output."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rlpulse" / "otelcol"


def manifest_key(manifest: Path = MANIFEST) -> str:
    return hashlib.sha256(manifest.read_bytes()).hexdigest()


def binary_path(manifest: Path = MANIFEST) -> Path:
    """Where the binary of this manifest is (or will be) cached."""
    return cache_root() / manifest_key(manifest) / NAME


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes, or the process dies
        yield


def _run(cmd: list[str], env: dict[str, str], cwd: Path, what: str, log: Callable[[str], None]) -> None:
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise CollectorError(f"{what} failed ({' '.join(cmd)} exited {done.returncode}):\n{done.stdout[-4000:]}")
    log(f"{what}: {time.monotonic() - started:.0f}s")


def _go_env(gobin: Path) -> dict[str, str]:
    # GOTOOLCHAIN=local: the machine's Go builds it; a go.mod asking for a newer toolchain must not
    # make `go` download one (nothing but the module proxy is reachable, and it is not the point).
    return {**os.environ, "GOTOOLCHAIN": "local", "GOBIN": str(gobin), "CGO_ENABLED": "0"}


def _builder(log: Callable[[str], None]) -> Path:
    gobin = cache_root() / f"builder-{BUILDER_VERSION}"
    builder = gobin / "builder"
    if not builder.exists():
        _run(["go", "install", f"{BUILDER}@{BUILDER_VERSION}"], _go_env(gobin), cache_root(),
             f"install the Collector builder {BUILDER_VERSION}", log)
    return builder


def _manifest_with_output(manifest: Path, output: Path) -> str:
    """The manifest with its output_path made absolute: the builder resolves a relative one against
    its current folder, which would put the sources and the binary in the clone."""
    lines = manifest.read_text().splitlines()
    hits = [i for i, line in enumerate(lines) if line.startswith(OUTPUT_KEY)]
    if len(hits) != 1:
        raise CollectorError(f"{manifest}: expected one '{OUTPUT_KEY.strip()}' line under dist:, found {len(hits)}")
    lines[hits[0]] = f"{OUTPUT_KEY} {output}"
    return "\n".join(lines) + "\n"


def ensure(log: Callable[[str], None] = print, manifest: Path = MANIFEST) -> Path:
    """The Collector binary of ``manifest``, built when not cached; raises CollectorError with the
    tail of the failing command's output (``go`` missing raises it too, saying so)."""
    binary = binary_path(manifest)
    if binary.exists():
        return binary
    if shutil.which("go") is None:
        raise CollectorError("`go` is not on PATH: building the Collector needs Go (1.26 was used)")
    with _locked(cache_root() / ".build.lock"):
        if binary.exists():  # another process built it while this one waited
            return binary
        builder = _builder(log)
        with tempfile.TemporaryDirectory(prefix="otelcol-build-", dir=cache_root()) as tmp:
            work = Path(tmp)
            (work / "builder.yaml").write_text(_manifest_with_output(manifest, work / "dist"))
            _run([str(builder), "--config", str(work / "builder.yaml")], _go_env(work / "bin"), work,
                 f"build {NAME} (about 90 s cold)", log)
            built = work / "dist" / NAME
            if not built.exists():
                raise CollectorError(f"the builder exited 0 but wrote no {built}")
            binary.parent.mkdir(parents=True, exist_ok=True)
            partial = binary.with_suffix(".partial")
            shutil.copy2(built, partial)
            partial.replace(binary)  # atomic: a reader sees the whole binary or none
            (binary.parent / "builder.yaml").write_bytes(manifest.read_bytes())  # what it was built from
    return binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(config: Path, env: dict[str, str], binary: Path | None = None, log_path: Path | None = None) -> subprocess.Popen:
    """The Collector running ``config``, with ``env`` added to this process's environment (the
    config's ``${env:...}`` values); its output goes to ``log_path`` (else is discarded)."""
    out = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115 - the child holds it
    try:
        return subprocess.Popen([str(binary or ensure()), "--config", str(config)], env={**os.environ, **env},
                                stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log_path is not None:
            out.close()  # type: ignore[union-attr]


def wait_ready(port: int, process: subprocess.Popen | None = None, timeout: float = 30.0, log_path: Path | None = None) -> float:
    """Seconds until the OTLP/HTTP receiver on 127.0.0.1:``port`` accepts connections; raises
    CollectorError when ``process`` exits first (a config it refused) or the time runs out."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if process is not None and process.poll() is not None:
            tail = log_path.read_text(errors="replace")[-4000:] if log_path and log_path.exists() else ""
            raise CollectorError(f"the Collector exited {process.returncode} before its port {port} answered:\n{tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return time.monotonic() - started
        except OSError:
            time.sleep(0.1)
    raise CollectorError(f"the Collector's OTLP/HTTP port {port} did not answer in {timeout:.0f}s")


def stop(process: subprocess.Popen, timeout: float = 15.0) -> int:
    """SIGTERM (the Collector drains its queue and closes the Kafka producer), SIGKILL if it hangs."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return int(process.returncode)


if __name__ == "__main__":
    began = time.monotonic()
    print(ensure(), f"ready in {time.monotonic() - began:.0f}s")

"""The sources of verl and OpenRLHF, for the integration tests that run those frameworks' own code.

Neither installs here (both pull torch, Ray and GPU libraries), and their modules that the tests
use are pure Python: each framework's wheel is fetched from PyPI once without its dependencies
(``pip download --no-deps``), unpacked under ``.cache/frameworks/`` and put at the end of
``sys.path``, where it is found but never shadows an installed package. Without a registry the
tests skip, and fail under ``CI=true`` (``tests.conftest.unavailable``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tests.conftest import unavailable

REPO = Path(__file__).resolve().parents[1]
WHEELS = {"verl": "0.9.1", "openrlhf": "0.11.2"}
SITE = REPO / ".cache" / "frameworks" / "-".join(f"{n}-{v}" for n, v in WHEELS.items())


def framework_sources(name: str) -> None:
    """Make ``name``'s package findable (``importlib.util.find_spec``), fetching it once."""
    if not (SITE / name).is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            run = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                                  "-d", tmp, *(f"{n}=={v}" for n, v in WHEELS.items())],
                                 capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                unavailable(f"{name} {WHEELS[name]}'s wheel could not be fetched from PyPI: {run.stderr.strip()[-300:]}")
            SITE.mkdir(parents=True, exist_ok=True)
            for wheel in Path(tmp).glob("*.whl"):
                with zipfile.ZipFile(wheel) as z:
                    z.extractall(SITE)
            # A platform-tagged wheel (OpenRLHF's) keeps its modules under <name>.data/purelib: where pip puts them
            for lib in [*SITE.glob("*.data/purelib/*"), *SITE.glob("*.data/platlib/*")]:
                if not (SITE / lib.name).exists():
                    lib.rename(SITE / lib.name)
    if str(SITE) not in sys.path:
        sys.path.append(str(SITE))

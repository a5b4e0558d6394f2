"""The ClickHouse users of the compose stack, read from deploy/clickhouse/users.d/rlpulse.xml.

That file is the one place the grants are written. Tests read it here and either parse its GRANTs
or hand a user's definition to chDB: ``chdb_config`` writes a chDB config whose only user
(``default``, the user chDB always runs as) has that user's grants and settings profile, so chDB's
own access control checks every statement against exactly those grants.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USERS_FILE = REPO / "deploy" / "clickhouse" / "users.d" / "rlpulse.xml"
CONFIG_FILE = REPO / "deploy" / "clickhouse" / "config.d" / "rlpulse.xml"
SINK, READER = "rlpulse_sink", "rlpulse_reader"
_GRANT = re.compile(r"^GRANT\s+(?P<privileges>.+?)\s+ON\s+(?P<target>\S+)$", re.I | re.S)


def _root() -> ET.Element:
    return ET.parse(USERS_FILE).getroot()


def _user(name: str) -> ET.Element:
    user = _root().find(f"users/{name}")
    if user is None:
        raise KeyError(f"{USERS_FILE} defines no user {name}")
    return user


def grants(name: str) -> list[str]:
    """The GRANT statements of user ``name``, whitespace collapsed."""
    return [" ".join((q.text or "").split()) for q in _user(name).findall("grants/query")]


def privileges(name: str) -> dict[str, set[str]]:
    """User ``name``'s privileges by target (``rlpulse.*``, ``*.*``): {target: {"SELECT", "ALTER ADD COLUMN", ...}}."""
    out: dict[str, set[str]] = {}
    for grant in grants(name):
        m = _GRANT.match(grant)
        if not m:
            raise ValueError(f"{USERS_FILE}: cannot read {grant!r} (expected GRANT <privileges> ON <db>.<table>)")
        out.setdefault(m["target"], set()).update(p.strip().upper() for p in m["privileges"].split(","))
    return out


def profile(name: str) -> str:
    """The settings profile user ``name`` logs in with."""
    return (_user(name).findtext("profile") or "default").strip()


def chdb_config(name: str, directory: Path) -> Path:
    """A chDB config file (under ``directory``) whose ``default`` user is user ``name`` of the users file.

    chDB runs every query as ``default``; giving that user only ``name``'s grants and profile makes
    chDB refuse what ``name`` may not do, with the error a server gives (ACCESS_DENIED, READONLY)."""
    root = _root()
    users = ET.Element("clickhouse")
    profiles = ET.SubElement(users, "profiles")
    ET.SubElement(profiles, "default")  # the profile chDB's built-in settings refer to
    mine = root.find(f"profiles/{profile(name)}")
    if mine is not None:
        # chDB (clickhouse-local) does not apply access_control_improvements, so it refuses a
        # changeable_in_readonly constraint (a server with config.d/rlpulse.xml accepts it):
        # the profile goes to chDB without those constraints, i.e. stricter.
        for constraints in mine.findall("constraints"):
            for setting in list(constraints):
                if setting.find("changeable_in_readonly") is not None:
                    constraints.remove(setting)
        profiles.append(mine)
    default = ET.SubElement(ET.SubElement(users, "users"), "default")
    ET.SubElement(default, "password").text = ""
    ET.SubElement(ET.SubElement(default, "networks"), "ip").text = "::/0"
    ET.SubElement(default, "profile").text = profile(name)
    default.append(_user(name).find("grants"))
    ET.SubElement(users, "quotas").append(ET.Element("default"))
    users_path = directory / f"users-{name}.xml"
    ET.ElementTree(users).write(users_path, encoding="unicode")
    config = directory / f"config-{name}.xml"
    # The server settings of the compose stack's config.d file, and the users file above.
    config_root = ET.parse(CONFIG_FILE).getroot()
    directories = ET.SubElement(config_root, "user_directories")
    ET.SubElement(ET.SubElement(directories, "users_xml"), "path").text = str(users_path)
    ET.ElementTree(config_root).write(config, encoding="unicode")
    return config

"""Least privilege on a ClickHouse server: the compose stack's users (deploy/clickhouse/users.d/rlpulse.xml).

The sink user (rlpulse_sink) may write rows and run the migrations' DDL on the rlpulse database
only; the reader (rlpulse_reader, Grafana's data source) may only SELECT there, with readonly=1.

Each statement migrate() runs is classified here by the privilege it needs and checked against the
file's GRANTs; then chDB, given exactly the sink's grants (its own access control checks every
statement, as a server does), runs all migrations and an insert like the sink's, and refuses what
the grants leave out; dropping any one grant makes migrate() fail, so none is spare. The reader is
checked the same way. Each chDB run is a subprocess: chDB opens one engine per process.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from rlpulse.sinks.store.clickhouse import MIGRATIONS, bootstrap_statements, migration_statements
from rlpulse.sinks.store.cluster_ddl import top_level_clauses
from tests.clickhouse_users import READER, SINK, USERS_FILE, chdb_config, grants, privileges, profile

REPO = Path(__file__).resolve().parents[4]
DB = "rlpulse"
ALL_OF_A_MOVE = {"SELECT", "DROP TABLE", "CREATE TABLE", "INSERT"}  # RENAME / EXCHANGE: both names
ALTERS = {r"ADD COLUMN": "ALTER ADD COLUMN", r"MODIFY ORDER BY": "ALTER ORDER BY", r"MODIFY SETTING": "ALTER SETTINGS"}


def needed(statement: str) -> set[str]:
    """The privileges (on rlpulse.*) a migration statement needs, as ClickHouse names them."""
    s = " ".join(statement.split()).upper()
    if s.startswith("CREATE DATABASE"):
        return {"CREATE DATABASE"}
    if s.startswith("CREATE TABLE"):
        return {"CREATE TABLE"} | ({"SELECT", "INSERT"} if re.search(r"\bAS SELECT\b", s) else set())
    if s.startswith("CREATE VIEW"):
        # ClickHouse checks a plain (not materialized) view's creation as CREATE TABLE, and its
        # SELECT: migrate ran 006 without a CREATE VIEW grant (test_each_sink_grant_is_needed_by_migrate).
        return {"CREATE TABLE", "SELECT"}
    if s.startswith("INSERT INTO"):
        return {"INSERT"} | ({"SELECT"} if re.search(r"\bSELECT\b", s) else set())
    if s.startswith("SELECT"):
        return {"SELECT"}
    if s.startswith("DROP TABLE"):
        return {"DROP TABLE"}
    if s.startswith(("RENAME TABLE", "EXCHANGE TABLES")):
        return set(ALL_OF_A_MOVE)
    if s.startswith("ALTER TABLE"):
        out = set()
        for clause in top_level_clauses(s.split(" ", 3)[3]):
            kind = next((grant for op, grant in ALTERS.items() if clause.startswith(op)), None)
            if kind is None:
                raise AssertionError(f"unclassified ALTER clause {clause!r}: add it to ALTERS here and grant it to "
                                     f"{SINK} in {USERS_FILE.relative_to(REPO)}")
            out.add(kind)
        return out
    raise AssertionError(f"unclassified migration statement: {statement[:200]!r}: classify it in needed() here and "
                         f"grant what it needs to {SINK} in {USERS_FILE.relative_to(REPO)}")


def all_statements() -> list[str]:
    """What migrate() runs on an empty store with the default TTLs, in order."""
    out = [*bootstrap_statements(DB), f"SELECT version FROM {DB}.schema_migrations"]
    for path in sorted(MIGRATIONS.glob("*.sql")):
        out += migration_statements(path, DB)
        out.append(f"INSERT INTO {DB}.schema_migrations (version) VALUES")  # client.insert()
    return out


def test_the_users_file_grants_the_rlpulse_database_only() -> None:
    assert privileges(SINK) == {"rlpulse.*": {"SELECT", "INSERT", "CREATE DATABASE", "CREATE TABLE", "DROP TABLE",
                                              "ALTER ADD COLUMN", "ALTER ORDER BY", "ALTER SETTINGS"}}
    assert grants(READER) == ["GRANT SELECT ON rlpulse.*"]
    root = ET.parse(USERS_FILE).getroot()
    reader_profile = root.find(f"profiles/{profile(READER)}")
    assert reader_profile.findtext("readonly") == "1"
    # The one setting Grafana's plugin sends on every query (clickhouse-go's query timeout).
    changeable = [s.tag for s in reader_profile.find("constraints") if s.find("changeable_in_readonly") is not None]
    assert changeable == ["max_execution_time"]
    assert profile(SINK) == "default"
    for name in (SINK, READER):
        password = root.find(f"users/{name}/password")
        assert password.text is None and password.get("from_env"), f"{name}: the password must come from the environment"
    # The image's passwordless administrator answers only inside the container.
    assert [ip.text for ip in root.findall("users/default/networks/ip")] == ["::1", "127.0.0.1"]
    assert root.find("users/default/networks").get("replace") == "replace"


def test_every_statement_migrate_runs_is_covered_by_the_sink_grants() -> None:
    statements = all_statements()
    assert len(statements) > 20  # every migration's statements, not a stale subset
    granted = privileges(SINK)["rlpulse.*"]
    for statement in statements:
        tables = re.findall(r"\b(\w+)\.(\w+)\b", statement.split("(")[0] if statement.startswith("CREATE") else statement)
        assert all(db == DB for db, _ in tables if not db.isdigit()), f"outside {DB}: {statement[:120]!r}"
        missing = needed(statement) - granted
        assert not missing, f"{SINK} lacks {sorted(missing)} for {statement[:120]!r}"
    # And every grant is used by some statement (the chDB test below shows each is needed).
    assert set().union(*(needed(s) for s in statements)) == granted


def test_needed_names_the_clickhouse_privileges() -> None:
    assert needed("ALTER TABLE rlpulse.steps ADD COLUMN IF NOT EXISTS w String, MODIFY ORDER BY (a, w)") == {
        "ALTER ADD COLUMN", "ALTER ORDER BY"}
    assert needed("EXCHANGE TABLES rlpulse.a AND rlpulse.b") == ALL_OF_A_MOVE
    assert needed("INSERT INTO rlpulse.a (x) SELECT x FROM rlpulse.b") == {"INSERT", "SELECT"}
    with pytest.raises(AssertionError, match="unclassified ALTER clause 'MODIFY TTL"):
        needed("ALTER TABLE rlpulse.spans MODIFY TTL toDateTime(end_time) + INTERVAL 1 DAY")
    with pytest.raises(AssertionError, match="unclassified migration statement: 'TRUNCATE"):
        needed("TRUNCATE TABLE rlpulse.spans")


# Runs in a subprocess: opens a chDB store as user argv[1] of the users file (its grants and profile),
# then runs argv[2]'s steps; prints one JSON line per step: [name, "ok", result] or [name, "error", message].
SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    from pathlib import Path
    import clickhouse_connect
    from rlpulse.sinks.store.clickhouse import Store, migrate
    from tests.clickhouse_users import chdb_config
    user, store_dir, steps = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    config = chdb_config(user, Path(tempfile.mkdtemp(dir=store_dir.parent)))
    if len(sys.argv) > 4:  # drop one privilege from the grants, to show it is needed
        text = config.read_text()
        users = Path(text.split("<path>")[1].split("</path>")[0])
        body = users.read_text()
        grant = body.split("<query>GRANT ")[1].split(" ON rlpulse.*")[0]
        kept = ", ".join(p.strip() for p in grant.split(",") if p.strip() != sys.argv[4])
        users.write_text(body.replace(grant, kept))
    client = clickhouse_connect.get_client(interface="chdb", path=str(store_dir), chdb_options={"config-file": str(config)})
    store = Store(client=client, database="rlpulse", url=f"chdb://{store_dir}")
    for name, sql in steps:
        try:
            if sql == "migrate":
                result = migrate(store)
            elif sql.startswith(("SELECT", "SHOW")):
                result = client.query(sql).result_rows
            else:
                result = str(client.command(sql))
            print(json.dumps([name, "ok", result], default=str), flush=True)
        except Exception as exc:
            print(json.dumps([name, "error", str(exc).splitlines()[0][:400]]), flush=True)
""")


def run_as(user: str, store: Path, steps: list[tuple[str, str]], drop: str | None = None) -> dict[str, tuple[str, object]]:
    args = [sys.executable, "-c", SCRIPT, user, str(store), json.dumps(steps)] + ([drop] if drop else [])
    run = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = {}
    for line in run.stdout.splitlines():
        if line.startswith("["):
            name, status, result = json.loads(line)
            out[name] = (status, result)
    assert set(out) == {name for name, _ in steps}, run.stdout + run.stderr[-2000:]
    return out


# The sink's INSERT on a server: the Avro container is the request body, read by the input() table
# function (sinks/store/avro_sql.py). chDB passes no body (the inline row is not read), so this one inserts
# nothing; that it runs shows the grants allow input(). The rows go in with VALUES (time_ns now: a row past the table's TTL
# would be dropped on insert).
SINK_INPUT = ("INSERT INTO rlpulse.steps (project, run_id, step, time_ns) SELECT project, run_id, step, time_ns "
              "FROM input('project String, run_id String, step Int64, time_ns Int64') FORMAT CSV\n\"p\",\"r0\",1,1\n")
SINK_INSERT = f"INSERT INTO rlpulse.steps (project, run_id, step, time_ns) VALUES ('p', 'r1', 7, {time.time_ns()})"


def test_migrations_and_inserts_run_under_exactly_the_sink_grants(tmp_path: Path) -> None:
    pytest.importorskip("chdb")
    out = run_as(SINK, tmp_path / "store", [
        ("grants", "SHOW GRANTS"),
        ("migrate", "migrate"),
        ("migrate again", "migrate"),
        ("input", SINK_INPUT),
        ("insert", SINK_INSERT),
        ("count", "SELECT run_id, step FROM rlpulse.steps"),
        ("columns", "SELECT count() FROM system.columns WHERE database = 'rlpulse' AND table = 'steps'"),
        ("other database", "CREATE TABLE default.x (a Int8) ENGINE = Memory"),
        ("ttl", "ALTER TABLE rlpulse.spans MODIFY TTL toDateTime(end_time) + INTERVAL 1 DAY"),
        ("truncate", "TRUNCATE TABLE rlpulse.steps"),
        ("users", "SELECT name FROM system.users"),
    ])
    assert out["grants"] == ("ok", [["GRANT SELECT, INSERT, ALTER ADD COLUMN, ALTER ORDER BY, ALTER SETTINGS, CREATE DATABASE, "
                                      "CREATE TABLE, DROP TABLE ON rlpulse.* TO default"]])
    assert out["migrate"] == ("ok", sorted(p.stem for p in MIGRATIONS.glob("*.sql")))
    assert out["migrate again"] == ("ok", [])
    assert out["input"][0] == "ok" and out["insert"][0] == "ok" and out["count"] == ("ok", [["r1", 7]])
    assert out["columns"] == ("ok", [[20]])  # migration 018 added steps.config
    for step, grant in [("other database", "CREATE TABLE ON default.x"), ("ttl", "ALTER TTL ON rlpulse.spans"),
                        ("truncate", "TRUNCATE ON rlpulse.steps"), ("users", "SHOW USERS ON *.*")]:
        status, message = out[step]
        assert status == "error" and "ACCESS_DENIED" in message and f"the grant {grant}" in message, (step, message)


@pytest.mark.parametrize("privilege", sorted(privileges(SINK)["rlpulse.*"]))
def test_each_sink_grant_is_needed_by_migrate(tmp_path: Path, privilege: str) -> None:
    pytest.importorskip("chdb")
    status, message = run_as(SINK, tmp_path / "store", [("migrate", "migrate")], drop=privilege)["migrate"]
    assert status == "error" and "ACCESS_DENIED" in message and f"the grant {privilege}" in message, message


def test_the_reader_selects_and_cannot_write(tmp_path: Path) -> None:
    pytest.importorskip("chdb")
    store = tmp_path / "store"
    assert run_as(SINK, store, [("migrate", "migrate"), ("insert", SINK_INSERT)])["insert"][0] == "ok"
    out = run_as(READER, store, [
        ("select", "SELECT run_id, step FROM rlpulse.steps"),
        ("readonly", "SELECT getSetting('readonly')"),
        ("insert", SINK_INSERT),
        ("input", SINK_INPUT),
        ("create", "CREATE TABLE rlpulse.x (a Int8) ENGINE = Memory"),
        ("drop", "DROP TABLE rlpulse.steps"),
        ("other database", "SELECT * FROM system.users"),
    ])
    assert out["select"] == ("ok", [["r1", 7]])
    assert out["readonly"] == ("ok", [[1]])
    for step, grant in [
        ("insert", "INSERT(project, run_id, step, time_ns) ON rlpulse.steps"),
        ("input", "INSERT(project, run_id, step, time_ns) ON rlpulse.steps"),
        ("create", "CREATE TABLE ON rlpulse.x"),
        ("drop", "DROP TABLE ON rlpulse.steps"),
        ("other database", "SHOW USERS ON *.*"),
    ]:
        status, message = out[step]
        assert status == "error" and "ACCESS_DENIED" in message and f"the grant {grant}" in message, (step, message)


def test_chdb_config_is_that_users_grants(tmp_path: Path) -> None:
    config = chdb_config(READER, tmp_path)
    users = ET.parse(config.read_text().split("<path>")[1].split("</path>")[0]).getroot()
    assert [q.text for q in users.findall("users/default/grants/query")] == grants(READER)
    assert users.findtext("users/default/profile") == "rlpulse_reader"
    assert users.findtext(f"profiles/{profile(READER)}/readonly") == "1"


def test_compose_gives_the_server_these_users_and_the_sink_its_own() -> None:
    yaml = pytest.importorskip("yaml")
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    clickhouse = compose["services"]["clickhouse"]
    assert f"./{USERS_FILE.relative_to(REPO)}:/etc/clickhouse-server/users.d/rlpulse.xml:ro" in clickhouse["volumes"]
    assert "./deploy/clickhouse/config.d/rlpulse.xml:/etc/clickhouse-server/config.d/rlpulse.xml:ro" in clickhouse["volumes"]
    env = clickhouse["environment"]
    # No CLICKHOUSE_USER/PASSWORD: the image would make that user an administrator reachable from outside.
    assert not {"CLICKHOUSE_USER", "CLICKHOUSE_PASSWORD", "CLICKHOUSE_DEFAULT_ACCESS_MANAGEMENT"} & set(env)
    root = ET.parse(USERS_FILE).getroot()
    for name in (SINK, READER):  # each from_env variable is set in the container
        assert root.find(f"users/{name}/password").get("from_env") in env
    sink_password = env["RLPULSE_SINK_PASSWORD"]
    assert sink_password.startswith("${RLPULSE_SINK_PASSWORD:-")
    for service in ("sink", "streams"):
        assert (
            compose["services"][service]["environment"]["RLPULSE_CLICKHOUSE_URL"]
            == f"http://{SINK}:{sink_password}@clickhouse:8123/rlpulse"
        )
    assert READER in " ".join(clickhouse["healthcheck"]["test"])

"""Retention and the sink's content caps: every input checked by allowlist, every value quoted.

The TTL text round-trips through ClickHouse's own printing in tests/integration/sinks/store/test_retention.py;
here, without a store: the checks, the literal quoting, the rules built and parsed back, the CLI's
refusals before any store is opened, the caps' settings, and the SQL of a bounded insert.
"""

from __future__ import annotations

import pytest

from rlpulse import cli
from rlpulse.base import env as envvars
from rlpulse.schemas.catalogue import TABLES
from rlpulse.base.settings import Settings
from rlpulse.sinks.store import retention
from rlpulse.sinks.store.avro_sql import InsertPlan
from rlpulse.sinks.write.content_bounds import Bounds, BoundedPlan, bounded_plan

HOSTILE = ["a'b", "a\\'; DROP TABLE rlpulse.spans; --", "line\nbreak", "nul\0byte", "tab\tand\x01\x7f", "é😀/x", "'"]


@pytest.mark.parametrize("table", sorted(TABLES.values()))
def test_every_table_of_the_catalogue_has_retention(table: str) -> None:
    assert retention.check_table(table) == table


@pytest.mark.parametrize("table", ["", "schema_migrations", "step_metrics", "spans; DROP TABLE x", "SPANS", None, 3,
                                   "spans_local", "../spans"])
def test_tables_outside_the_allowlist_are_refused(table: object) -> None:
    with pytest.raises(ValueError, match="unknown table"):
        retention.check_table(table)


@pytest.mark.parametrize("project", ["", None, 7, "x" * 257, "bad\ud800surrogate"])
def test_projects_outside_the_sdk_limits_are_refused(project: object) -> None:
    with pytest.raises(ValueError, match="project"):
        retention.check_project(project)


@pytest.mark.parametrize("project", [*HOSTILE, "x" * 256])
def test_any_name_the_sdk_accepts_is_a_project(project: str) -> None:
    assert retention.check_project(project) == project


@pytest.mark.parametrize("days", [0, -1, retention.MAX_DAYS + 1, 1.5, "7", True, None, 10**30])
def test_days_are_a_bounded_whole_number(days: object) -> None:
    with pytest.raises(ValueError, match="days must be a whole number"):
        retention.check_days(days)


@pytest.mark.parametrize("text", HOSTILE)
def test_a_quoted_literal_holds_no_raw_quote_nul_or_newline_and_reads_back(text: str) -> None:
    literal = retention.quote(text)
    body = literal[1:-1].replace("\\\\", "").replace("\\'", "")
    assert "'" not in body and "\0" not in literal and "\n" not in literal
    assert retention.unquote(literal) == text


def test_rules_put_each_project_under_one_rule_and_parse_back() -> None:
    wanted = retention.Retention("spans", 30, {"a'b": 7, "line\nbreak": 365})
    rules = wanted.rules()
    assert rules.startswith("toDateTime(end_time) + INTERVAL 7 DAY DELETE WHERE project = 'a\\'b', ")
    assert rules.endswith("toDateTime(end_time) + INTERVAL 30 DAY DELETE WHERE project NOT IN ('a\\'b', 'line\\nbreak')")
    # As ClickHouse prints it back (INTERVAL n DAY -> toIntervalDay(n), DELETE left out):
    printed = rules.replace(" DELETE", "").replace("INTERVAL 7 DAY", "toIntervalDay(7)") \
        .replace("INTERVAL 365 DAY", "toIntervalDay(365)").replace("INTERVAL 30 DAY", "toIntervalDay(30)")
    back = retention.parse("spans", printed)
    assert (back.default_days, back.projects) == (30, {"a'b": 7, "line\nbreak": 365})
    assert retention.Retention("steps", 90).rules() == "toDateTime(time) + INTERVAL 90 DAY"
    assert retention.Retention("steps", None).rules() == ""


def test_on_a_cluster_the_ttl_changes_on_every_nodes_local_part() -> None:
    wanted = retention.Retention("steps", 30, {"a": 7})
    assert retention.alter_statements("rlpulse", wanted) == [f"ALTER TABLE rlpulse.steps MODIFY TTL {wanted.rules()}"]
    assert retention.alter_statements("rlpulse", wanted, "rlpulse") == [
        f"ALTER TABLE rlpulse.steps_local ON CLUSTER rlpulse MODIFY TTL {wanted.rules()}"]
    assert retention.alter_statements("db", retention.Retention("steps", None)) == ["ALTER TABLE db.steps REMOVE TTL"]


@pytest.mark.parametrize("ttl", ["toDateTime(time) + toIntervalDay(7) WHERE kind = 'x'",
                                 "toDateTime(end_time) + toIntervalMonth(1)",
                                 "toDateTime(emitted_at) + toIntervalDay(3)"])  # another table's time column
def test_a_ttl_written_by_hand_is_not_taken_for_ours(ttl: str) -> None:
    with pytest.raises(retention.RetentionError, match="not written by rlpulse retention"):
        retention.parse("spans", ttl)


def test_the_ttl_clause_is_cut_from_engine_full_outside_quotes() -> None:
    engine = ("ReplacingMergeTree PARTITION BY toDate(end_time) ORDER BY (project) TTL toDateTime(end_time) + "
              "toIntervalDay(7) WHERE project = ' SETTINGS x', toDateTime(end_time) + toIntervalDay(9) "
              "WHERE project NOT IN (' SETTINGS x') SETTINGS index_granularity = 8192")
    clause = retention.ttl_clause(engine)
    assert clause.endswith("NOT IN (' SETTINGS x')")
    assert retention.parse("spans", clause).projects == {" SETTINGS x": 7}
    assert retention.ttl_clause("MergeTree ORDER BY x SETTINGS index_granularity = 8192") == ""


@pytest.mark.parametrize("argv, message", [
    (["retention", "set", "--table", "spans"], "set needs --days"),
    (["retention", "clear", "--table", "spans", "--days", "3"], "clear takes no --days"),
    (["retention", "set", "--days", "3"], "set needs --table"),
    (["retention", "show", "--table", "spans"], "show takes only --project"),
    (["retention", "set", "--table", "nope", "--days", "3"], "unknown table 'nope'"),
    (["retention", "set", "--table", "spans", "--days", "0"], "days must be a whole number from 1 to 36500"),
    (["retention", "set", "--table", "spans", "--days", "3", "--project", ""], "project must be a non-empty name"),
])
def test_the_command_refuses_bad_input_before_it_opens_a_store(argv: list[str], message: str, tmp_path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(envvars.HOME, str(tmp_path))
    monkeypatch.delenv(envvars.CLICKHOUSE_URL, raising=False)
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "clickhouse").exists()  # nothing was opened, nothing created


def test_caps_are_settings_with_bounds() -> None:
    assert (Settings.load(env={}).span_cap, Settings.load(env={}).sink_content_max_chars) == (0, 65536)
    got = Settings.load(env={envvars.SPAN_CAP: "4", envvars.SINK_CONTENT_MAX_CHARS: "0"})
    assert (got.span_cap, got.sink_content_max_chars) == (4, 0)
    assert Settings.load(env=got.env()).span_cap == 4
    for var, value in ((envvars.SPAN_CAP, "-1"), (envvars.SINK_CONTENT_MAX_CHARS, str((1 << 30) + 1))):
        with pytest.raises(ValueError, match=var):
            Settings.load(env={var: value})
    with pytest.raises(ValueError, match=envvars.SPAN_CAP):
        Settings.load(env={envvars.SPAN_CAP: "eight"})


PLAN = InsertPlan(table="spans", columns=("project", "run_id", "attempt", "step", "rollout_id", "attributes"),
                  structure="`project` String", select="...",
                  expressions=("`project`", "`run_id`", "`attempt`", "`step`", "`rollout_id`", "`attributes`"))


def test_with_both_caps_off_the_insert_is_the_plain_one() -> None:
    assert bounded_plan(PLAN, Bounds(0, 0), [b"p/r"]) is PLAN
    other = InsertPlan(table="steps", columns=("project",), structure="", select="", expressions=("`project`",))
    assert bounded_plan(other, Bounds(3, 100), [b"p/r"]) is other


def test_message_keys_reach_the_sql_only_quoted() -> None:
    keys = [b"p/run", b"x'/y\n\0", None, b"a/b/c"]
    plan = bounded_plan(PLAN, Bounds(3, 100), keys)
    assert isinstance(plan, BoundedPlan) and plan.columns[-2:] == ("content_capped", "content_cut_chars")
    sql = plan.sql_from_file("rlpulse", "/tmp/x.avro", "token")
    assert "'x\\'/y\\n\\0'" in sql and "\0" not in sql and "\n" not in sql
    assert "project IN ('a', 'a/b', 'p', 'x\\'')" in sql  # each prefix before a '/' may be the project
    assert "_n + _rank <= 3" in sql and "length(v) > 100" in sql
    assert bounded_plan(PLAN, Bounds(3, 0), [None]).sql_from_input("db").startswith("INSERT INTO db.spans (")
    assert " WHERE 0 AND step IS NOT NULL" in bounded_plan(PLAN, Bounds(3, 0), [None]).sql_from_input("db")

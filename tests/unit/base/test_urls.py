"""``mask_url``, the one function every URL rlpulse prints goes through, never prints any part of a
URL's user information nor a query value, whatever the password holds; what it keeps reads as the
URL did; ``request_failure`` never quotes an exception's text; and every path that prints a URL
(the ClickHouse errors, the Settings' repr) goes through it. The webhook's paths are
``tests/unit/sinks/alerts/test_webhook.py``'s, the CLI's ``tests/integration/sinks/alerts/test_webhook_cli.py``'s."""

from __future__ import annotations

import http.client
import re
import socket
import urllib.error
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from rlpulse.base.settings import Settings
from rlpulse.base.urls import mask_url, request_failure, url_problem
from rlpulse.sinks.store.clickhouse import open_store
from tests.secret_passwords import PASSWORDS, SPECIAL, encoded, leaks

pytestmark = pytest.mark.full  # the fast tier is at its time limit


def forms(password: str) -> list[tuple[str, str]]:
    """(URL holding ``password``, the same URL with a neutral password): every shape a user gives."""
    out = []
    for pw, neutral in ((password, "NEUTRAL"), (encoded(password), "NEUTRAL")):
        out += [
            (f"http://alice:{pw}@127.0.0.1:8123/rlpulse", f"http://alice:{neutral}@127.0.0.1:8123/rlpulse"),
            (f"https://alice:{pw}@hooks.example.com/services/T0/B0?sig=abc", "https://alice:N@hooks.example.com/services/T0/B0?sig=abc"),
            # a token as the user (a ':' in it would start its password: the token then is what precedes it)
            (f"http://{pw.replace(':', '%3A')}@127.0.0.1/hook", "http://NEUTRAL@127.0.0.1/hook"),
            (f"alice:{pw}@127.0.0.1:8123/db", "alice:NEUTRAL@127.0.0.1:8123/db"),  # no scheme
            (f"//alice:{pw}@127.0.0.1/db", "//alice:NEUTRAL@127.0.0.1/db"),
            (f"http://alice:{pw}@[::1]:8123/db", "http://alice:NEUTRAL@[::1]:8123/db"),  # IPv6
            (f"clickhouse://alice:{pw}@h:9000/db?secure=1", "clickhouse://alice:NEUTRAL@h:9000/db?secure=1"),
            (f"http://127.0.0.1:8123/db?user=alice&password={pw}&token={pw}", "http://127.0.0.1:8123/db?user=alice&password=N&token=N"),
            (f"http://127.0.0.1/db#{pw}", "http://127.0.0.1/db#N"),
            (f"  http://alice:{pw}@127.0.0.1/x  ", "  http://alice:NEUTRAL@127.0.0.1/x  "),
        ]
    return out


def assert_masked(password: str) -> None:
    for url, neutral_url in forms(password):
        for origin_only in (False, True):
            neutral = mask_url(neutral_url, origin_only=origin_only) + " " + mask_url(url.split("://")[0] + "://x")
            shown = mask_url(url, origin_only=origin_only)
            assert leaks(password, shown, neutral) == [], (url, shown)
            assert not re.search(r"alice(?!:\*\*\*@)", shown), (url, shown)  # the user, only as user:***@
        problem = url_problem(url)
        assert problem is None or leaks(password, problem, url_problem("http://u:p/q@h/") or "") == [], problem


@pytest.mark.parametrize("password", PASSWORDS)
def test_no_part_of_a_password_is_printed_whatever_it_holds(password: str) -> None:
    assert_masked(password)


@hypothesis_settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(st.characters(codec="utf-8"), min_size=1, max_size=24), st.sampled_from(SPECIAL))
def test_no_part_of_any_generated_password_is_printed(body: str, special: str) -> None:
    assert_masked("Zq" + body[: len(body) // 2] + special + body[len(body) // 2:] + "Xv")


def test_the_report_case_and_the_urllib_error_it_caused() -> None:
    url = "http://alice:s3cr/et@host/hook"
    assert mask_url(url) == "http://***" and mask_url(url, origin_only=True) == "http://***"
    problem = url_problem(url)
    assert problem is not None and "%2F" in problem and "s3cr" not in problem and "alice" not in problem
    # urllib's own reading of it: the exception quotes a piece of the password; request_failure does not
    with pytest.raises(ValueError) as raised:
        urlsplit(url).port  # noqa: B018 - the read raises
    assert "s3cr" in str(raised.value)
    assert "s3cr" not in request_failure(raised.value) and request_failure(raised.value) == "ValueError"


def test_what_can_be_read_keeps_its_shape() -> None:
    assert mask_url("http://rlpulse:rlpulse@127.0.0.1:1/rlpulse") == "http://rlpulse:***@127.0.0.1:1/rlpulse"
    assert mask_url("https://u:p@ch.example:8443/db?secure=1") == "https://u:***@ch.example:8443/db?secure=***"
    assert mask_url("http://127.0.0.1:8123/rlpulse") == "http://127.0.0.1:8123/rlpulse"
    assert mask_url("http://user@127.0.0.1:8123/rlpulse") == "http://***@127.0.0.1:8123/rlpulse"  # a lone token
    assert mask_url("http://u:p@ss@host/x") == "http://u:***@host/x"  # '@' in a password: the last one ends it
    assert mask_url("http://u:p@[fe80::1%25eth0]:80/") == "http://u:***@[fe80::1%25eth0]:80/"
    assert mask_url("chdb:///tmp/store") == "chdb:///tmp/store"
    assert mask_url("chdb:///tmp/run@1/store") == "chdb:///tmp/run@1/store"  # a path, no authority
    assert mask_url("http://h/x?a=1&b&=c;d=") == "http://h/x?a=***&***&***&d="
    assert mask_url("https://hooks.slack.com/services/T0/B0/x", origin_only=True) == "https://hooks.slack.com"
    assert mask_url("http://h/\x1b]0;t\x07") == "http://h/\\x1b]0;t\\x07"  # terminal-safe
    assert mask_url("http://u:p@h/" + "a" * 500) == "http://u:***@h/" + "a" * 199 + "…"


@pytest.mark.parametrize(("url", "shown"), [
    ("", ""), ("garbage", "garbage"), ("http://", "http://"), ("http://h:99999/", "http://***"),
    ("http://h:port/", "http://***"), ("http://a b/", "http://***"), ("http://u:p@h:x@y:z/", "http://***"),
    ("http://[::1/", "http://***"), ("http://u:p@[::1", "http://***"), ("ht tp://u:p@h/", "***"),
    ("http:/u:p@h/", "***"), ("\x00://u:p@h", "***"), ("://u:p@h", "***"), ("http://@/", "http://***@/"),
])
def test_garbage_is_masked_conservatively(url: str, shown: str) -> None:
    assert mask_url(url) == shown
    assert mask_url(url, origin_only=True) in (shown, "***", "http://")


def test_an_at_after_the_host_cannot_be_told_from_a_password_and_masks_all() -> None:
    for url in ("http://host/x?e=a@b", "http://tok/en@host/", "http://u:a?b@host/", "http://u:a#b@host/"):
        assert mask_url(url) == "http://***" and url_problem(url) is not None


def test_request_failure_names_the_failure_in_its_own_words() -> None:
    secret = "s3cr3t-PIECE"
    cases = [
        (TimeoutError(f"timed out {secret}"), "no complete answer within 2s"),
        (urllib.error.URLError(ConnectionRefusedError(111, f"refused {secret}")), "connection refused"),
        (socket.gaierror(-2, f"Name {secret}"), "the host name does not resolve"),
        (http.client.RemoteDisconnected(secret), "the receiver closed the connection without answering"),
        (http.client.InvalidURL(f"nonnumeric port: '{secret}'"), "not an HTTP answer (InvalidURL)"),
        (urllib.error.URLError(f"unknown url type: {secret}"), "URLError"),
        (ValueError(secret), "ValueError"),
        (OSError(113, secret), "OSError (EHOSTUNREACH)"),
    ]
    for exc, words in cases:
        assert request_failure(exc, 2.0) == words
        assert secret not in request_failure(exc, 2.0)


@pytest.mark.parametrize("password", [p for p in PASSWORDS if any(c in p for c in "/?#@:%[]")][:16])
def test_a_clickhouse_url_error_prints_no_part_of_the_password(password: str) -> None:
    # Port 1 on loopback: nothing listens, so a URL that can be read fails to connect, and its message is what a user sees.
    for pw in (password, encoded(password)):
        url = f"http://rlpulse:{pw}@127.0.0.1:1/rlpulse"
        with pytest.raises((ConnectionError, ValueError)) as failed:
            open_store(url)
        message = str(failed.value)
        said = (f"cannot connect to ClickHouse at http://rlpulse:***@127.0.0.1:1/rlpulse {url_problem('http://u:p/q@h/')} "
                "it cannot be read as a URL (write a '[' or ']' inside its user or password as %5B, %5D)")
        assert leaks(password, message, said) == [], message
        if isinstance(failed.value, ConnectionError):  # it could be read: the connection failed
            assert message.startswith("cannot connect to ClickHouse at http://rlpulse:***@127.0.0.1:1/rlpulse: "), message
        else:  # it cannot be read: said why, in words of its own, before any connection
            assert message.startswith((
                "RLPULSE_CLICKHOUSE_URL http://***: an '@' follows its host",
                "RLPULSE_CLICKHOUSE_URL http://rlpulse:***@127.0.0.1:1/rlpulse: it cannot be read")), message


def test_the_settings_repr_holds_no_clickhouse_password() -> None:
    settings = Settings(clickhouse_url="http://rlpulse:S3cr3t-CH@127.0.0.1:8123/rlpulse")
    assert "S3cr3t-CH" not in repr(settings) and "S3cr3t-CH" not in str(settings)

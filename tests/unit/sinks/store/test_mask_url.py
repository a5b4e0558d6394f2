"""mask_url (``rlpulse.base.urls``, the one function every printed URL goes through) never prints a
ClickHouse URL's password, whatever characters it holds; the rules in full are tests/unit/base/test_urls.py's."""

from __future__ import annotations

import pytest

from rlpulse.base.urls import mask_url
from rlpulse.sinks.store.clickhouse import open_store

SECRET_PARTS = ("s3cr/et", "s3c#ret", "s3c?ret", "a/b#c?d", "p@ss/word", "pa:ss/w", "%2Fenc")


@pytest.mark.parametrize("password", SECRET_PARTS)
def test_password_with_url_delimiters_is_masked(password: str) -> None:
    url = f"http://rlpulse:{password}@127.0.0.1:8123/rlpulse"
    masked = mask_url(url)
    assert password not in masked and "et" not in masked.replace("rlpulse", "")
    for piece in password.replace("#", "/").replace("?", "/").replace("@", "/").replace(":", "/").split("/"):
        if len(piece) >= 2:  # every fragment of it, not just the whole
            assert piece not in masked.replace("rlpulse", "").replace("127.0.0.1", ""), (piece, masked)
    # a '/', '#' or '?' in it: where the password ends cannot be told, so nothing after the scheme is printed
    assert masked == ("http://***" if any(c in password for c in "/#?") else "http://rlpulse:***@127.0.0.1:8123/rlpulse")


def test_plain_urls_keep_their_shape() -> None:
    assert mask_url("http://rlpulse:rlpulse@127.0.0.1:1/rlpulse") == "http://rlpulse:***@127.0.0.1:1/rlpulse"
    assert mask_url("https://u:p@ch.example:8443/db?secure=1") == "https://u:***@ch.example:8443/db?secure=***"  # query values
    assert mask_url("http://127.0.0.1:8123/rlpulse") == "http://127.0.0.1:8123/rlpulse"
    assert mask_url("http://user@127.0.0.1:8123/rlpulse") == "http://***@127.0.0.1:8123/rlpulse"  # a lone user may be a token
    assert mask_url("chdb:///tmp/store") == "chdb:///tmp/store"
    assert mask_url("http://s3cr/et@host/db") == "http://***"  # a token holding '/': it was printed whole


@pytest.mark.parametrize("password", ("pa/ss", "pa#ss", "pa?ss"))
def test_a_url_that_cannot_be_read_is_refused_without_printing_the_password(password: str) -> None:
    # urllib would read "pa" as the port of host "rlpulse" and say so; open_store says why in its own words.
    url = f"http://rlpulse:{password}wxyz@127.0.0.1:1/rlpulse"
    with pytest.raises(ValueError) as failed:
        open_store(url)
    assert "wxyz" not in str(failed.value) and "'pa'" not in str(failed.value) and ":pa" not in str(failed.value)
    assert str(failed.value).startswith("RLPULSE_CLICKHOUSE_URL http://***: an '@' follows its host"), str(failed.value)


@pytest.mark.parametrize("password", ("pa%2Fss", "pa%23ss", "pa%3Fss", "p@ss:w"))
def test_connection_error_never_prints_the_password(password: str) -> None:
    # Port 1 on loopback: nothing listens, so the connection fails and its message is what a user sees.
    url = f"http://rlpulse:{password}word@127.0.0.1:1/rlpulse"
    with pytest.raises(ConnectionError) as failed:
        open_store(url)
    assert "ss" not in str(failed.value).replace("ClickHouse", "")
    assert str(failed.value).startswith("cannot connect to ClickHouse at http://rlpulse:***@127.0.0.1:1/rlpulse: ")

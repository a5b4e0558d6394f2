"""mask_url never prints a ClickHouse URL's password, whatever characters it holds."""

from __future__ import annotations

import pytest

from rlpulse.sinks.store.clickhouse import mask_url, open_store

SECRET_PARTS = ("s3cr/et", "s3c#ret", "s3c?ret", "a/b#c?d", "p@ss/word", "pa:ss/w", "%2Fenc")


@pytest.mark.parametrize("password", SECRET_PARTS)
def test_password_with_url_delimiters_is_masked(password: str) -> None:
    url = f"http://rlpulse:{password}@127.0.0.1:8123/rlpulse"
    masked = mask_url(url)
    assert password not in masked
    for piece in password.replace("#", "/").replace("?", "/").replace("@", "/").replace(":", "/").split("/"):
        if len(piece) >= 2:  # every fragment of it, not just the whole
            assert piece not in masked.replace("rlpulse", "").replace("127.0.0.1", ""), (piece, masked)
    assert masked.startswith("http://rlpulse:***@")


def test_plain_urls_keep_their_shape() -> None:
    assert mask_url("http://rlpulse:rlpulse@127.0.0.1:1/rlpulse") == "http://rlpulse:***@127.0.0.1:1/rlpulse"
    assert mask_url("https://u:p@ch.example:8443/db?secure=1") == "https://u:***@ch.example:8443/db?secure=1"
    assert mask_url("http://127.0.0.1:8123/rlpulse") == "http://127.0.0.1:8123/rlpulse"
    assert mask_url("http://user@127.0.0.1:8123/rlpulse") == "http://user@127.0.0.1:8123/rlpulse"
    assert mask_url("chdb:///tmp/store") == "chdb:///tmp/store"
    assert mask_url("http://s3cr/et@host/db") == "http://s3cr/et@host/db"  # no ':' before '@': a user, not a password


@pytest.mark.parametrize("password", ("pa/ss", "pa#ss", "pa?ss"))
def test_connection_error_never_prints_the_password(password: str) -> None:
    # Port 1 on loopback: nothing listens, so the connection fails and its message is what a user sees.
    url = f"http://rlpulse:{password}word@127.0.0.1:1/rlpulse"
    with pytest.raises(ConnectionError) as failed:
        open_store(url)
    assert "word" not in str(failed.value)
    assert str(failed.value).startswith("cannot connect to ClickHouse at http://rlpulse:***@127.0.0.1:1/rlpulse: ")

"""The webhook client of ``rlpulse alerts``: POSTs one alert as JSON, retrying transient failures.

See ``rlpulse.sinks.alerts.alert_feed`` for the delivery contract (ids, retries, giving up, secrets in URLs).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any
from collections.abc import Callable
from urllib.parse import unquote, urlsplit, urlunsplit
from rlpulse.base.errors import Error

# The feed's logger name, as before this client had a module of its own: log lines and their
# filters stay the same.
log = logging.getLogger("rlpulse.sinks.alerts.alert_feed")


def alert_id(alert: dict[str, Any]) -> str:
    """The id of one alert transition: equal for re-posts and re-publications of it, 32 hex digits."""
    identity = [alert.get("project", ""), alert["rule"], alert["key"], alert["state"], int(alert["first_seen_ns"])]
    return hashlib.sha256(json.dumps(identity, separators=(",", ":")).encode()).hexdigest()[:32]


def webhook_origin(url: str) -> str:
    """What may be logged of a webhook URL: scheme, host and port (never user, path or query)."""
    parts = urlsplit(url)
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # a malformed port: say nothing of it
        port = ""
    return f"{parts.scheme}://{parts.hostname or '?'}{port}"


class _Rejected(Error):
    """The receiver refused this request for good (4xx other than 408/425/429, or a redirect)."""


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    # urllib would turn a redirected POST into a GET without the body; a redirect is a refusal.
    def redirect_request(self, *args: Any) -> None:
        return None


_TRANSIENT_HTTP = {408, 425, 429}


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Run blocking ``fn`` on a daemon thread: a stopping feed abandons it instead of waiting (as
    ``asyncio.to_thread`` would, at interpreter exit, for a hanging webhook)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def work() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: the feed stopped and nobody waits
            pass

    threading.Thread(target=work, name="rlpulse-webhook", daemon=True).start()
    return await future


class Webhook:
    """POSTs alerts as JSON, one at a time; ``deliver`` returns True when accepted, False when given up."""

    def __init__(self, url: str, *, timeout_s: float = 5.0, give_up_after_s: float = 600.0,
                 backoff_s: float = 0.5, max_backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--webhook: expected an http:// or https:// URL with a host, got one for {webhook_origin(url)}")
        self.url, self.origin = url, webhook_origin(url)
        self._headers = {"Content-Type": "application/json", "User-Agent": "rlpulse-alerts"}
        if parts.username is not None:
            # urllib does not take user:password@ from the URL: send it as HTTP Basic, as curl does.
            credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(credentials).decode()
            self.url = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
        self.timeout_s, self.give_up_after_s = timeout_s, give_up_after_s
        self.backoff_s, self.max_backoff_s, self._clock = backoff_s, max_backoff_s, clock
        self._secrets = [s for s in (url, parts.path, parts.query, parts.username, parts.password) if s and len(s) > 1]
        self._opener = urllib.request.build_opener(_NoRedirect)
        self._failing_since: float | None = None  # first failure with no success since
        self.delivered = 0
        self.failed = 0

    async def deliver(self, alert: dict[str, Any]) -> bool:
        key = alert_id(alert)
        body = json.dumps({"alert_id": key, **alert}, separators=(",", ":")).encode()
        what = f"{alert['rule']} {alert['state']} {alert['key']} (id {key})"
        backoff, tries = self.backoff_s, 0
        while True:
            tries += 1
            try:
                await _in_daemon_thread(lambda: self._post(body, key))
            except _Rejected as exc:
                self.failed += 1
                log.error("webhook %s refused %s: %s; given up", self.origin, what, self._scrub(str(exc)))
                return False
            except Exception as exc:  # refused, timeout, 5xx: retried alike
                reason = self._scrub(f"{type(exc).__name__}: {exc}")
            else:
                self.delivered += 1
                if self._failing_since is not None:
                    log.info("webhook %s accepts again", self.origin)
                self._failing_since = None
                return True
            now = self._clock()
            self._failing_since = now if self._failing_since is None else self._failing_since
            if now - self._failing_since >= self.give_up_after_s:
                self.failed += 1
                log.error("webhook %s failed %d times for %s, failing for %.0fs; given up; last error %s",
                          self.origin, tries, what, now - self._failing_since, reason)
                return False
            if tries == 1:
                log.warning("webhook %s: %s for %s; retrying", self.origin, reason, what)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    def _post(self, body: bytes, key: str) -> None:
        request = urllib.request.Request(self.url, data=body, method="POST", headers={**self._headers, "Idempotency-Key": key})
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            if 300 <= exc.code < 500 and exc.code not in _TRANSIENT_HTTP:
                raise _Rejected(f"HTTP {exc.code}") from None
            raise RuntimeError(f"HTTP {exc.code}") from None

    def _scrub(self, text: str) -> str:
        # Error texts of urllib/http.client may quote the URL or parts of it.
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

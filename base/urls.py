"""URLs as rlpulse prints them: :func:`mask_url` is the one function every error, log line, report
and line of CLI output that names a URL goes through.

A URL given to rlpulse may carry secrets in three places: the user information (``user:password@``),
the query (``?token=...``, ``?password=...``) and, for webhooks, the path (Slack puts its token
there). The user information is the hard one: a password may hold ``/``, ``?``, ``#`` or ``@``
unencoded (``http://alice:s3cr/et@host/hook``), and a URL parser then ends the authority at the
``/`` and reads ``alice`` as the host and ``s3cr`` as its port, so that the password, or a piece
of it, lands in whatever it prints ("nonnumeric port: 's3cr'").

The rules of :func:`mask_url` (``origin_only=False``):

1. The URL is read as ``scheme://authority`` + path, query and fragment; the authority ends at the
   first ``/``, ``?`` or ``#`` after ``//``, as RFC 3986 and every parser say. A string without
   ``scheme://`` that holds an ``@`` is read as an authority too (``user:pw@host:8123``).
2. Ambiguous: when an ``@`` follows the authority (in the path, query or fragment), the
   user information may run up to it: a password with a ``/``, ``?`` or ``#`` in it. Nothing after
   the scheme is printed then: ``http://***``. (A ``chdb:`` or ``file:`` URL with an empty
   authority, ``chdb:///path``, is a path, which may hold an ``@``.)
3. The user information (everything before the authority's last ``@``) is never printed. Where
   it is ``user:password`` with a plain user name (letters, digits, ``.``, ``_``, ``~``, ``-``; at
   most 64) the user is kept: ``http://user:***@host``; any other user information, a lone
   token (``https://TOKEN@host``) included, is ``***@``.
4. The host and port are printed only if they read as such: a name of letters, digits, ``.``,
   ``-``, ``_``, ``~`` and ``%``, or an IPv6 literal in brackets, then at most a numeric port.
   Anything else means the URL cannot be read: ``http://***``.
5. The path is printed (a ClickHouse URL's database), made terminal-safe and cut at 200 characters.
6. Every query value is ``***``, its name kept when it is a plain name (else ``***`` for the
   pair); a fragment is ``#***``.
7. ``origin_only=True`` prints the scheme, host and port alone (never the user, path or query):
   what ``rlpulse alerts`` logs of a webhook URL.
8. Anything else, an empty string or garbage without ``scheme://``, is printed only if it
   holds no ``@`` (no user information can be in it), its query masked; else ``***``.

Whatever cannot be read is masked whole rather than guessed: printing too little beats
printing a secret. Exception texts are the other leak: urllib's and http.client's messages quote
pieces of the URL they failed on, so no caller prints one for a URL with a secret in it;
:func:`request_failure` gives the words to print instead, :func:`url_problem` says, in words
of its own, why a URL cannot be used, and :func:`split_url` is ``urlsplit`` for a URL about to be
used, raising a ValueError of its own words instead of urllib's.
"""

from __future__ import annotations

import re
from urllib.parse import SplitResult, urlsplit

from rlpulse.base.terminal import terminal_safe

MASK = "***"
MAX_PATH = 200
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]{0,31})://")
_HOST = re.compile(r"(?:\[[0-9A-Fa-f:.]{2,45}(?:%25[A-Za-z0-9._~-]{1,32})?\]|[\w.~%-]{0,253})(?::[0-9]{0,5})?")
_USER = re.compile(r"[A-Za-z0-9._~-]{1,64}")
_NAME = re.compile(r"[A-Za-z0-9._~\[\]-]{1,64}")
# Schemes whose URLs name a local path: with an empty authority (``chdb:///x``) an ``@`` in the path is a path's.
_PATH_SCHEMES = frozenset({"chdb", "file"})


class _Reading:
    """One URL, read as :func:`mask_url` reads it (the module docstring's rules)."""

    __slots__ = ("prefix", "scheme", "userinfo", "hostport", "tail", "authority", "problem")

    def __init__(self, url: str):
        text = str(url).strip()
        self.scheme = ""
        self.userinfo: str | None = None
        self.hostport = ""
        self.tail = ""
        self.problem: str | None = None
        match = _SCHEME.match(text)
        if match:
            self.scheme, self.prefix, rest = match.group(1), match.group(0), text[match.end():]
        elif text.startswith("//"):
            self.prefix, rest = "//", text[2:]
        elif "@" in text:  # user:password@host:port without a scheme
            self.prefix, rest = "", text
        else:  # no authority, so no user information: a path or an opaque string
            self.prefix, self.authority, self.tail = "", False, text
            return
        self.authority = True
        end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
        authority, self.tail = rest[:end], rest[end:]
        if "@" in self.tail and not (authority == "" and self.scheme.lower() in _PATH_SCHEMES):
            self.problem = ("an '@' follows its host, so where its user and password end cannot be told: write "
                            "a '/', '?', '#' or '@' inside them as %2F, %3F, %23, %40 (and an '@' in its path or query as %40)")
            return
        userinfo, at, self.hostport = authority.rpartition("@")
        self.userinfo = userinfo if at else None
        port = self.hostport.rpartition("]")[2].partition(":")[2]
        if not _HOST.fullmatch(self.hostport):
            self.problem = "its host or port cannot be read (a port is a number; an IPv6 host goes in [brackets])"
        elif port and int(port) > 65535:
            self.problem = "its port is over 65535"

    def shown_userinfo(self) -> str:
        if self.userinfo is None:
            return ""
        user, colon, _ = self.userinfo.partition(":")
        return f"{user}:{MASK}@" if colon and _USER.fullmatch(user) else f"{MASK}@"


def _masked_tail(tail: str) -> str:
    """The path as it is (terminal-safe, cut), every query value and the fragment masked."""
    rest, hash_, fragment = tail.partition("#")
    path, question, query = rest.partition("?")
    if len(path) > MAX_PATH:
        path = path[:MAX_PATH] + "…"
    shown = terminal_safe(path)
    if question:
        pairs = []
        for pair in re.split(r"[&;]", query):
            name, equals, value = pair.partition("=")
            if not pair:
                pairs.append("")
            elif equals and _NAME.fullmatch(name):
                pairs.append(f"{name}={MASK}" if value else f"{name}=")
            else:
                pairs.append(MASK)
        shown += "?" + "&".join(pairs)
    if hash_:
        shown += "#" + (MASK if fragment else "")
    return shown


def mask_url(url: str, *, origin_only: bool = False) -> str:
    """``url`` as rlpulse may print it: no user information, no query value, nothing that cannot be
    read as a URL (the module docstring's rules). ``origin_only``: scheme, host and port alone."""
    reading = _Reading(url)
    if not reading.authority:  # no authority, hence no '@': nothing of a user information is in it
        return MASK if origin_only else _masked_tail(reading.tail)
    if reading.problem is not None:
        return reading.prefix + MASK
    if origin_only:
        return reading.prefix + reading.hostport
    return reading.prefix + reading.shown_userinfo() + reading.hostport + _masked_tail(reading.tail)


def url_problem(url: str) -> str | None:
    """Why ``url``'s authority cannot be read unambiguously, in words that quote none of it; None
    when it can. A client refuses such a URL (with :func:`mask_url` of it) instead of sending it on."""
    return _Reading(url).problem


def request_failure(exc: BaseException, timeout_s: float | None = None) -> str:
    """Why an HTTP request failed, in rlpulse's words: never the exception's text, which urllib and
    http.client build from the URL (``nonnumeric port: 's3cr'`` quotes a password's piece)."""
    import asyncio
    import errno
    import http.client
    import socket
    import ssl
    import urllib.error

    if isinstance(exc, urllib.error.URLError) and isinstance(exc.reason, BaseException):
        exc = exc.reason
    if isinstance(exc, (TimeoutError, socket.timeout, asyncio.TimeoutError)):  # the last one apart before 3.11
        return f"no complete answer within {timeout_s:g}s" if timeout_s is not None else "timed out"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the receiver closed the connection without answering"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return "the receiver closed the connection"
    if isinstance(exc, socket.gaierror):
        return "the host name does not resolve"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "TLS: the receiver's certificate is not trusted"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({type(exc).__name__})"
    if isinstance(exc, http.client.HTTPException):
        return f"not an HTTP answer ({type(exc).__name__})"
    code = errno.errorcode.get(exc.errno) if isinstance(exc, OSError) and exc.errno is not None else None
    if code is not None:
        return f"{type(exc).__name__} ({code})"
    return type(exc).__name__


def split_url(url: str, what: str, *, origin_only: bool = False) -> SplitResult:
    """``urllib.parse.urlsplit(url)``, its port read as well, for a URL that is about to be used;
    a ValueError that names ``what`` and the masked URL (``origin_only`` as :func:`mask_url`'s)
    when it cannot be read unambiguously.

    urlsplit's own errors quote the piece they fail on (``'s3cr' does not appear to be an IPv4 or
    IPv6 address`` for a password holding ``[s3cr]``), so they are never passed on."""
    problem = url_problem(url)
    if problem is None:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises for a port that is not a number
            return parts
        except ValueError:
            problem = "it cannot be read as a URL (write a '[' or ']' inside its user or password as %5B, %5D)"
    raise ValueError(f"{what} {mask_url(url, origin_only=origin_only)}: {problem}")

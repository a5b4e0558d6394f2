"""Passwords that break URL parsers, and the check that none of one leaks into printed text.

:data:`PASSWORDS`: every URL delimiter inside a password (``/ ? # @ : [ ] %``, percent-encodings,
spaces, controls), the case of the report (``s3cr/et``: urllib reads ``s3cr`` as a port), unicode,
and a seeded random sample over all printable ASCII and some unicode: the same list every path is
tested with (``mask_url``, the webhook's errors and logs, the CLI's output, the ClickHouse errors).

:func:`leaks` is what a reader could learn: the password whole, raw or percent-encoded, or any
piece of it of ``WINDOW`` characters that the same text printed for a neutral password does not
hold too (a password ``host`` is not leaked by printing the host).
"""

from __future__ import annotations

import random
import string
from urllib.parse import quote

WINDOW = 4
SPECIAL = "/?#@:[]%&=;+\\ \t\n'\"<>`^{}|~!$()*,"
_RANDOM_POOL = string.printable.strip() + " " + "éü日本€ßΩ𝄞\u202e\u200b"


def _random_passwords(count: int, seed: int = 33) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        body = "".join(rng.choice(_RANDOM_POOL) for _ in range(rng.randint(6, 20)))
        special = rng.choice(SPECIAL)
        at = rng.randint(0, len(body))
        out.append("Zx" + body[:at] + special + body[at:] + "Qk")
    return out


PASSWORDS: tuple[str, ...] = (
    "s3cr/et", "s3c#ret", "s3c?ret", "p@ss/word", "pa:ss/w", "a/b#c?d@e:f", "%2Fenc", "pct%40at", "p%zzbad",
    "tr@iling@", "colon:s:in", "[v6]:1", "sp ace", "tab\there", "nl\nhere", "uni日本ü", "bidi\u202ertl",
    *(f"Pw{c}Secret9" for c in SPECIAL),
    *_random_passwords(120),
)


def windows(text: str, size: int = WINDOW) -> set[str]:
    return {text[i:i + size] for i in range(max(len(text) - size + 1, 1))}


def leaks(password: str, printed: str, neutral: str = "") -> list[str]:
    """The pieces of ``password`` (raw or percent-encoded) in ``printed`` that ``neutral`` (the
    same output for a harmless password) does not explain; empty when nothing leaked."""
    found = []
    for form in {password, quote(password, safe=""), quote(password)}:
        if form in printed:
            found.append(form)
        found += sorted(w for w in windows(form) if len(w) == WINDOW and w in printed and w not in neutral)
    return found


def encoded(password: str) -> str:
    """``password`` percent-encoded for a URL's user information (what a user should write)."""
    return quote(password, safe="")

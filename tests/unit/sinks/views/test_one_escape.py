"""The HTML views escape through one function (issue 33, finding 3): no module of ``rlpulse.sinks.views`` but
``html_escape`` imports ``html``'s escape or markupsafe, so a field cannot be escaped for HTML and still carry
a bidi override or a zero-width character raw (``esc`` shows those as visible escapes)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rlpulse.sinks.views.html_escape import esc

pytestmark = pytest.mark.full

VIEWS = Path(__file__).resolve().parents[4] / "sinks" / "views"


def _escapes_of_their_own(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in ("html", "markupsafe") or a.name.startswith("markupsafe.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("html", "markupsafe"):
            found.append(f"from {node.module} import " + ", ".join(a.name for a in node.names))
        elif isinstance(node, ast.Attribute) and node.attr == "escape" and isinstance(node.value, ast.Name) \
                and node.value.id in ("html", "markupsafe", "cgi", "saxutils"):
            found.append(f"{node.value.id}.escape")
    return found


def test_no_view_escapes_html_but_through_the_one_function() -> None:
    modules = sorted(VIEWS.glob("*.py"))
    assert len(modules) > 20
    offenders = {m.name: own for m in modules if m.name != "html_escape.py"
                 if (own := _escapes_of_their_own(ast.parse(m.read_text(), str(m))))}
    assert not offenders, f"escape HTML with rlpulse.sinks.views.html_escape.esc instead: {offenders}"


def test_the_one_function_shows_invisible_characters() -> None:
    assert esc("a\u202eb\u200b<c>\x1b") == "a\\u202eb\\u200b&lt;c&gt;\\x1b"
    assert esc("line\n\tnext\u2066", keep_layout=True) == "line\n\tnext\\u2066"
    assert esc('"q" & \'s\'') == "&quot;q&quot; &amp; &#x27;s&#x27;"

"""The one escaping function of the report page.

``rlpulse.sinks.views.html_report`` draws the page and ``rlpulse.sinks.views.trajectory_html`` its trajectories section; both
escape every text from the store through :func:`esc`, which lives here, below both, so the
report imports the section and nothing imports back up.
"""

from __future__ import annotations

import html
from typing import Any


def esc(text: Any) -> str:
    """``text`` as HTML text or a quoted attribute value."""
    return html.escape(str(text), quote=True)

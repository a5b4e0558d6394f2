"""The house's rooms, checked from the imports (``tests/layers.py``, which ``make lint`` also runs).

Lower rooms never import higher ones, nothing imports in a circle, no module reaches another's
private names, and nothing imports a bare folder name.
"""

from __future__ import annotations

from tests import layers


def test_every_folder_module_is_seen() -> None:
    for name in ("rlpulse.producers.sdk.telemetry", "rlpulse.base.settings", "rlpulse.streams.app",
                 "rlpulse.sinks.write.sink", "rlpulse.sinks.views.ui_server", "rlpulse.cli"):
        assert name in layers.MODULES, name


def test_every_room_has_a_docstring_saying_what_it_owns() -> None:
    import ast
    for room in layers.ROOMS:
        doc = ast.get_docstring(ast.parse(layers.MODULES[room].read_text()))
        assert doc and len(doc.split()) >= 5, f"{room}: its __init__ says in one line what the room owns"


def test_rooms_are_found_by_the_longest_prefix() -> None:
    assert layers.room_of("rlpulse.sinks.write.sink") == "rlpulse.sinks.write"
    assert layers.room_of("rlpulse.sinks") == "rlpulse.sinks"
    assert layers.room_of("rlpulse.producers.tracing.spans") == "rlpulse.producers.tracing"
    assert layers.room_of("rlpulse.cli") == "rlpulse"


def test_the_rule_refuses_an_arrow_upward_and_allows_one_downward() -> None:
    assert not layers.allowed("rlpulse.sinks.write.sink", "rlpulse.sinks.views.ui_server")  # write path -> view
    assert not layers.allowed("rlpulse.base.settings", "rlpulse.schemas.codec")  # the ground -> above it
    assert not layers.allowed("rlpulse.producers.sdk.telemetry", "rlpulse.sinks.store.clickhouse")  # across parts
    assert not layers.allowed("rlpulse.streams.app", "rlpulse.cli")  # a room -> the wiring
    assert not layers.allowed("rlpulse.producers.sdk.sender", "rlpulse.producers.tracing.spans")
    assert layers.allowed("rlpulse.sinks.views.ui_data", "rlpulse.sinks.read.queries")
    assert layers.allowed("rlpulse.producers.simulators.simulator", "rlpulse.producers.sdk.telemetry")
    assert layers.allowed("rlpulse.cli", "rlpulse.sinks.write.sink")


def test_no_arrow_goes_up_or_across() -> None:
    assert layers.layer_violations() == []


def test_a_module_taking_a_name_from_the_init_that_imports_it_is_a_circle() -> None:
    # ``from rlpulse.producers.tracing import content`` reads the package's __init__ first, so it
    # is an arrow to the __init__ as well as to ``content``
    pkg, mod = "rlpulse.producers.tracing", "rlpulse.producers.tracing.decorators"
    assert layers.circles({pkg: {mod}, mod: {pkg}}) == [[pkg, mod]]
    assert layers.circles({pkg: {mod}, mod: set()}) == []


def test_no_import_circles() -> None:
    assert layers.circles() == []


def test_no_private_names_across_modules() -> None:
    assert layers.private_crossings() == []


def test_no_bare_folder_imports() -> None:
    assert layers.bare_imports() == [], "import these as rlpulse.<folder>: a user's own package would shadow them"

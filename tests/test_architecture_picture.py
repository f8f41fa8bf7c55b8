"""docs/img/architecture.svg is what docs/architecture_graph.py draws from today's code (unit tier)."""

from __future__ import annotations

import pytest

from conftest import load_module

pytestmark = pytest.mark.unit


def _generator():
    return load_module("architecture_graph", "docs", "architecture_graph.py")


def test_the_picture_is_drawn_from_the_code():
    generator = _generator()
    boxes, arrows = generator.graph()
    with open(generator.IMAGE, encoding="utf-8") as handle:
        committed = handle.read()
    assert committed == generator.render(boxes, arrows), (
        "docs/img/architecture.svg is out of date: run `python docs/architecture_graph.py` and commit the picture")


def test_the_picture_shows_the_layering_the_page_states():
    boxes, arrows = _generator().graph()
    assert {"_tf/", "cluster/", "callbacks/", "snapshots/", "launch/", "layers/", "data/", "cli/"} <= set(boxes)
    # The door depends on nothing drawn; the training core never on process supervision.
    assert not [arrow for arrow in arrows if arrow[0] == "_tf/"]
    assert ("strategies", "launch/") not in arrows
    # Drawn by depth, so a cycle would put a box below itself: none.
    rows = _generator()._rows(boxes, arrows)  # pylint: disable=protected-access  (tf_psx's own class)
    depth = {box: r for r, row in enumerate(rows) for box in row}
    assert all(depth[source] < depth[target] for source, target in arrows)

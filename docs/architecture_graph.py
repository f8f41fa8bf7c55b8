"""The picture of docs/architecture.md, generated from the code: `python docs/architecture_graph.py`.

Boxes are tf_psx's packages (`cluster/`, `callbacks/`, ...) and its
top-level modules; an arrow A -> B says some module of A imports some module
of B (module-level or inside a function). The base modules that everything
uses (`errors`, `_checks`, `_quiet`, `redaction`) are left out, as are the
`python -m` entry files. Boxes are drawn in rows by depth: a box sits below
every box that imports it. tests/test_architecture_picture.py checks that
docs/img/architecture.svg is what this file draws from the code today.
"""

from __future__ import annotations

import ast
import os
import sys
from xml.sax.saxutils import escape

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PACKAGE = os.path.join(REPO, "tf_psx")
IMAGE = os.path.join(HERE, "img", "architecture.svg")

BASE = {"errors", "_checks", "_quiet", "redaction", "__init__"}
ENTRY_FILES = {"server", "netproxy", "tlsmesh"}  # `python -m tf_psx.X` entry files at the top level
BOX_W, BOX_H, GAP_X, GAP_Y, MARGIN = 118, 34, 14, 46, 16


def _box_of(module: str) -> str | None:
    """'tf_psx.cluster.local' -> 'cluster/'; 'tf_psx.strategies' -> 'strategies'; base -> None."""
    parts = module.split(".")[1:]
    if not parts:
        return None
    if os.path.isdir(os.path.join(PACKAGE, parts[0])):
        return parts[0] + "/"
    return None if parts[0] in BASE | ENTRY_FILES else parts[0]


def _modules() -> dict[str, str]:
    """module name -> path, for every module of the package."""
    found = {}
    for root, _dirs, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                module = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[module.removesuffix(".__init__")] = path
    return found


def graph() -> tuple[list[str], set[tuple[str, str]]]:
    """(boxes, arrows) from the import statements of every module."""
    modules = _modules()
    boxes, arrows = set(), set()
    for module, path in modules.items():
        source = _box_of(module)
        if source is None:
            continue
        boxes.add(source)
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tf_psx"):
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names if alias.name.startswith("tf_psx")]
            for target in targets:
                box = _box_of(target)
                if box is not None and box != source:
                    arrows.add((source, box))
    return sorted(boxes), arrows


def _rows(boxes: list[str], arrows: set) -> list[list[str]]:
    """Boxes by depth: 0 for boxes nothing imports, then one more than the deepest importer."""
    depth = {box: 0 for box in boxes}
    for _ in boxes:  # longest path; a cycle would stop growing at len(boxes)
        for source, target in arrows:
            depth[target] = max(depth[target], depth[source] + 1)
    rows: list[list[str]] = [[] for _ in range(max(depth.values()) + 1)]
    for box in boxes:
        rows[depth[box]].append(box)
    return rows


def render(boxes: list[str], arrows: set) -> str:
    rows = _rows(boxes, arrows)
    width = 2 * MARGIN + max(len(row) for row in rows) * (BOX_W + GAP_X) - GAP_X
    height = 2 * MARGIN + len(rows) * (BOX_H + GAP_Y) - GAP_Y
    where = {}
    for r, row in enumerate(rows):
        row_width = len(row) * (BOX_W + GAP_X) - GAP_X
        left = (width - row_width) / 2
        for c, box in enumerate(row):
            where[box] = (left + c * (BOX_W + GAP_X), MARGIN + r * (BOX_H + GAP_Y))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="12">',
           '<defs><marker id="a" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#777"/></marker></defs>']
    for source, target in sorted(arrows):
        (x1, y1), (x2, y2) = where[source], where[target]
        out.append(f'<line x1="{x1 + BOX_W / 2:.1f}" y1="{y1 + BOX_H:.1f}" x2="{x2 + BOX_W / 2:.1f}" y2="{y2:.1f}" '
                   'stroke="#999" stroke-width="1" marker-end="url(#a)"/>')
    for box, (x, y) in sorted(where.items()):
        fill = "#fde8c8" if box == "_tf/" else "#dbe8f7" if box.endswith("/") else "#eeeeee"
        out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{BOX_W}" height="{BOX_H}" rx="4" fill="{fill}" '
                   'stroke="#555"/>')
        out.append(f'<text x="{x + BOX_W / 2:.1f}" y="{y + BOX_H / 2 + 4:.1f}" text-anchor="middle">'
                   f'{escape(box)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> int:
    boxes, arrows = graph()
    os.makedirs(os.path.dirname(IMAGE), exist_ok=True)
    with open(IMAGE, "w", encoding="utf-8") as handle:
        handle.write(render(boxes, arrows))
    print(f"wrote {IMAGE}: {len(boxes)} boxes, {len(arrows)} arrows")
    return 0


if __name__ == "__main__":
    sys.exit(main())

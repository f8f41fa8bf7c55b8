"""A griffe extension for the API reference (mkdocs.yml loads it; not a page).

tf_psx docstrings (STYLE.md) put their doctests, unindented, after an
"Example:" line. griffe's Google parser reads them as Markdown text, where
`>>>` lines become block quotes and doctest output such as `[4, 8, 10]`
looks like a broken link (which fails the strict build). This fences every
doctest (from a `>>>` line to the next blank line) as a `pycon` code block
before the docstring is parsed.
"""

from __future__ import annotations

import griffe

_PROMPT = ">>>"
_FENCE = "```"


def fence_doctests(text: str) -> str:
    """Returns `text` with each doctest block wrapped in a ```pycon fence."""
    out, in_doctest, in_fence = [], False, False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith(_FENCE):
            in_fence = not in_fence
        if not in_fence and not in_doctest and stripped.startswith(_PROMPT):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{_FENCE}pycon")
            in_doctest = True
        elif in_doctest and not stripped:
            out.append(f"{indent}{_FENCE}")
            in_doctest = False
        out.append(line)
    if in_doctest:
        out.append(f"{indent}{_FENCE}")
    return "\n".join(out)


class FenceDoctests(griffe.Extension):
    """Fences the doctests of every docstring."""

    def on_instance(self, *, obj, **kwargs) -> None:  # pylint: disable=unused-argument
        docstring = getattr(obj, "docstring", None)
        if docstring is not None and _PROMPT in docstring.value:
            docstring.value = fence_doctests(docstring.value)

"""Redaction: keeps values from the data (ids, feature values) out of tf_psx's warnings and errors.

Off by default: an error that names the bad id is the fastest fix. Turn it on
where logs leave the team that may see the data (the articles behind this
package: "日志脱敏处理"), with the environment variable `TF_PSX_REDACT=1` or
in code. Redacted messages keep everything else: the layer or file, the
feature, the rule broken, the line number and the fix.

Example:

>>> from tf_psx import redaction
>>> redaction.show("'u_12345'")
"'u_12345'"
>>> with redaction.redacted():
...     redaction.show("'u_12345'")
'<redacted>'

What it covers: the ids of `ShardedEmbedding` and `FeatureEmbeddings` range
errors, and the field values and header text of the Criteo reader's
warnings and errors.

Known limitations:
  * A layer decides when it is traced (its first call in a `tf.function`,
    e.g. the first step of `fit`): turn redaction on before that.
  * TensorFlow's own errors (a shape mismatch that prints a tensor) are not
    tf_psx's to change.
"""

from __future__ import annotations

import contextlib
import os

ENV = "TF_PSX_REDACT"
REDACTED = "<redacted>"
_ON_VALUES = ("1", "true", "yes", "on")
_forced: list[bool] = []  # set_enabled / redacted(); the environment when empty


def enabled() -> bool:
    """True when messages leave data values out."""
    if _forced:
        return _forced[-1]
    return os.environ.get(ENV, "").strip().lower() in _ON_VALUES


def set_enabled(on: bool | None) -> None:
    """Turns redaction on or off for this process; None goes back to `TF_PSX_REDACT`."""
    _forced.clear()
    if on is not None:
        _forced.append(bool(on))


@contextlib.contextmanager
def redacted(on: bool = True):
    """Redaction on (or off) inside the block."""
    _forced.append(bool(on))
    try:
        yield
    finally:
        _forced.pop()


def show(text: str) -> str:
    """`text` (a value from the data, already quoted), or `REDACTED`."""
    return REDACTED if enabled() else text

"""Argument checks shared by every module: one message form, built from the check itself.

The form is "<subject> must be <expected>. Received: <value>. Fix: <fix>",
where the subject is "Argument `name` of Owner" (or the option a command
line names, e.g. "Option `--workers`").

Example:

>>> int_at_least(3, 1, "num_shards", owner="FixedShardsPartitioner", fix="pass 2")
3
>>> try:
...     int_at_least(True, 1, "num_ps", fix="pass 1 or more")
... except ValueError as err:
...     print(err)
Argument `num_ps` must be an int >= 1. Received: True. Fix: pass 1 or more.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tf_psx.errors import ArgumentError


def is_int_at_least(value: Any, minimum: int) -> bool:
    """True for an int (not a bool; numpy ints count) that is >= `minimum`."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= minimum


def int_from_env(name: str, minimum: int, example: int) -> int | None:
    """The int in environment variable `name` (None when unset or empty); ArgumentError (a ValueError) naming it if malformed."""
    import os  # pylint: disable=import-outside-toplevel

    text = os.environ.get(name, "")
    if text == "":
        return None
    if not text.isdigit() or int(text) < minimum:
        raise ArgumentError(f"The environment variable {name} must be an int >= {minimum}. Received: {text!r}. "
                            f"Fix: unset it or set e.g. {name}={example}.")
    return int(text)


def subject(name: str, owner: str | None = None) -> str:
    """"Argument `name` of Owner", or `name` itself when it already names an option."""
    if name.startswith("Option "):
        return name
    return f"Argument `{name}`" + (f" of {owner}" if owner else "")


def int_at_least(value: Any, minimum: int, name: str, *, owner: str | None = None, fix: str = "",
                 error: type[Exception] = ArgumentError, or_none: bool = False) -> int | None:
    """Returns `value` as an int when it is an int >= `minimum`; else raises `error`.

    Args:
      value: what was received.
      minimum: the smallest value allowed.
      name: the argument's name, or an option label ("Option `--ps`").
      owner: the class or function the argument belongs to.
      fix: what to do instead (a sentence without its final period).
      error: the exception class, a tf_psx.errors class (e.g. CommandError for the CLI, LaunchError for the launcher).
      or_none: None is allowed too (and returned).

    Raises:
      `error`: naming the argument, the expected form, the value and the fix.
    """
    if or_none and value is None:
        return None
    if is_int_at_least(value, minimum):
        return int(value)
    expected = f"an int >= {minimum}" + (" or None" if or_none else "")
    message = f"{subject(name, owner)} must be {expected}. Received: {value!r}."
    if fix:
        message += f" Fix: {fix.rstrip('.')}."
    raise error(message)

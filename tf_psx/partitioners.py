"""Variable partitioners for `ParameterServerStrategy`, and their spec strings.

A partitioner is called by the strategy for every variable created under its
scope, as `partitioner(shape, dtype)`, and returns the number of shards along
each axis (only axis 0 may be split). Rows are placed in contiguous ranges
("div" placement), as `tf.distribute` does.

Spec strings (for `ParameterServerStrategy(partitioner=...)` and the CLI):

| spec | partitioner |
|---|---|
| `fixed:N` | `FixedShardsPartitioner(N)` |
| `max_ids:N` | `MaxIDPartitioner(N)` |
| `per_ps` or `per_ps:K` | `PerPSPartitioner(K)` (K shards per ps, default 1) |
| `min_size:256k` | TF's `MinSizePartitioner(min_shard_bytes=256 KiB, max_shards=num_ps)` |
| `max_size:64m` | TF's `MaxSizePartitioner(max_shard_bytes=64 MiB)` (no shard cap, TF's default) |

None of them splits a variable into more shards than it has rows.

`min_size` differs from TF's defaults on purpose. TF's `MinSizePartitioner`
caps the shard count at `max_shards`, whose default is 1: with the default, it
never splits anything, so a spec naming only a size would be a no-op. The
spec therefore sets `max_shards` to the strategy's ps count, the "commonly
used partitioner" of the `variable_partitioner` docs of TF's
`ParameterServerStrategy` (`MinSizePartitioner(min_shard_bytes = 256 << 10,
max_shards = num_ps)`): shards of at least SIZE bytes, at most one per ps task.
Where the ps count is unknown (`from_spec(spec)` without `num_ps`), TF's
default cap of 1 applies, and the partitioner is exactly
`MinSizePartitioner(min_shard_bytes=SIZE)`. For another cap, pass TF's object
itself: `partitioner=tf_psx.partitioners.MinSizePartitioner(min_shard_bytes,
max_shards)`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from tf_psx.errors import ArgumentError

__all__ = [
    "FixedShardsPartitioner",
    "MaxIDPartitioner",
    "PerPSPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "from_spec",
    "SPEC_FORMS",
    "ShardLoad",
    "shard_load",
    "div_shard_of",
]

# The forms `from_spec` accepts, quoted in its errors.
SPEC_FORMS = ("fixed:N", "max_ids:N", "per_ps[:K]", "min_size:SIZE", "max_size:SIZE")
# Size suffixes for min_size/max_size, powers of 1024 as TF's docs use them.
_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([a-zA-Z]*)\s*$")


def _positive_int(name: str, value: Any, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ArgumentError(
            f"Argument `{name}` of {owner} must be an int >= 1. Received: {value!r}. "
            f"Fix: pass {owner}({name}=2), for example."
        )
    return value


def _rows(shape) -> int:
    """Rows of a variable (axis 0); a scalar counts as one row."""
    dims = list(shape)
    return int(dims[0]) if dims and dims[0] is not None else 1


def _partitions(shape, shards: int) -> list[int]:
    dims = list(shape)
    if not dims:
        return []
    return [max(1, min(shards, _rows(shape)))] + [1] * (len(dims) - 1)


class _Partitioner:
    """Private base: subclasses give `_num_shards(shape, dtype)`."""

    def __call__(self, shape, dtype, axis: int = 0) -> list[int]:
        del axis
        return _partitions(shape, self._num_shards(shape, dtype))

    def _num_shards(self, shape, dtype) -> int:
        raise NotImplementedError


class FixedShardsPartitioner(_Partitioner):
    """Splits every variable into `num_shards` contiguous shards.

    Example:

    >>> FixedShardsPartitioner(4)(shape=(1000, 8), dtype="float32")
    [4, 1]
    >>> FixedShardsPartitioner(4)(shape=(2,), dtype="float32")  # a tiny bias
    [2]

    Args:
      num_shards: the shard count (>= 1); capped at the variable's row count.
    """

    def __init__(self, num_shards: int):
        self.num_shards = _positive_int("num_shards", num_shards, "FixedShardsPartitioner")

    def _num_shards(self, shape, dtype) -> int:
        return self.num_shards

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner({self.num_shards})"


class MaxIDPartitioner(_Partitioner):
    """ID-range sharding: no shard holds more than `max_ids_per_shard` rows.

    Example:

    >>> MaxIDPartitioner(1000)(shape=(2500, 16), dtype="float32")
    [3, 1]

    Args:
      max_ids_per_shard: the most rows (ids) one shard may hold (>= 1).
      max_shards: an optional cap on the shard count. When the cap would put
        more than `max_ids_per_shard` rows in a shard, construction succeeds
        but the call raises, because the bound cannot be kept.
    """

    def __init__(self, max_ids_per_shard: int, max_shards: int | None = None):
        self.max_ids_per_shard = _positive_int("max_ids_per_shard", max_ids_per_shard, "MaxIDPartitioner")
        self.max_shards = None if max_shards is None else _positive_int("max_shards", max_shards, "MaxIDPartitioner")

    def _num_shards(self, shape, dtype) -> int:
        rows = _rows(shape)
        shards = -(-rows // self.max_ids_per_shard)
        if self.max_shards is not None and shards > self.max_shards:
            raise ArgumentError(
                f"MaxIDPartitioner(max_ids_per_shard={self.max_ids_per_shard}, max_shards={self.max_shards}) "
                f"cannot place a variable of {rows} rows: it needs {shards} shards. "
                f"Fix: raise max_shards to {shards} or max_ids_per_shard to {-(-rows // self.max_shards)}."
            )
        return shards

    def __repr__(self) -> str:
        return f"MaxIDPartitioner({self.max_ids_per_shard}, max_shards={self.max_shards})"


class PerPSPartitioner(_Partitioner):
    """`shards_per_ps` shards for every ps task of the strategy that uses it.

    `tf_psx.ParameterServerStrategy` tells the partitioner its ps count; used
    with another strategy, call `.bind(num_ps)` first.

    Example:

    >>> p = PerPSPartitioner(shards_per_ps=2).bind(num_ps=3)
    >>> p(shape=(600, 4), dtype="float32")
    [6, 1]

    Args:
      shards_per_ps: shards per ps task (>= 1).
    """

    def __init__(self, shards_per_ps: int = 1):
        self.shards_per_ps = _positive_int("shards_per_ps", shards_per_ps, "PerPSPartitioner")
        self.num_ps: int | None = None

    def bind(self, num_ps: int) -> "PerPSPartitioner":
        """Sets the ps count; returns self."""
        self.num_ps = _positive_int("num_ps", num_ps, "PerPSPartitioner.bind")
        return self

    def _num_shards(self, shape, dtype) -> int:
        if self.num_ps is None:
            raise ArgumentError(
                "PerPSPartitioner does not know the ps count. Fix: pass it to "
                "tf_psx.ParameterServerStrategy(partitioner=...), or call .bind(num_ps) first."
            )
        return self.shards_per_ps * self.num_ps

    def __repr__(self) -> str:
        return f"PerPSPartitioner(shards_per_ps={self.shards_per_ps}, num_ps={self.num_ps})"


def _tf_partitioners():
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    return tf.distribute.experimental.partitioners


def MinSizePartitioner(*args, **kwargs):  # pylint: disable=invalid-name
    """TF's `tf.distribute.experimental.partitioners.MinSizePartitioner`."""
    return _tf_partitioners().MinSizePartitioner(*args, **kwargs)


def MaxSizePartitioner(*args, **kwargs):  # pylint: disable=invalid-name
    """TF's `tf.distribute.experimental.partitioners.MaxSizePartitioner`."""
    return _tf_partitioners().MaxSizePartitioner(*args, **kwargs)


def _spec_error(spec: Any, why: str) -> ArgumentError:
    return ArgumentError(
        f"Partitioner spec must be one of {', '.join(SPEC_FORMS)} (SIZE like 256k or 64m); "
        f"received {spec!r}: {why}."
    )


def _parse_size(spec: str, text: str) -> int:
    match = _SIZE_RE.match(text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise _spec_error(spec, f"{text!r} is not a size such as 256k, 64m or 1g")
    size = int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    if size < 1:
        raise _spec_error(spec, "the size must be >= 1 byte")
    return size


def _parse_int(spec: str, text: str) -> int:
    if not re.fullmatch(r"\d+", text.strip()) or int(text) < 1:
        raise _spec_error(spec, f"{text!r} is not an int >= 1")
    return int(text)


def from_spec(spec: str, num_ps: int | None = None):
    """Builds a partitioner from a spec string.

    Example:

    >>> from_spec("fixed:4")
    FixedShardsPartitioner(4)
    >>> from_spec("max_ids:1000000")
    MaxIDPartitioner(1000000, max_shards=None)
    >>> from_spec("per_ps:2")
    PerPSPartitioner(shards_per_ps=2, num_ps=None)

    Args:
      spec: one of `SPEC_FORMS`.
      num_ps: the ps count of the strategy, when known. It binds `per_ps`
        and caps `min_size` at one shard per ps, as TF's
        `ParameterServerStrategy` docs advise; without it `min_size` keeps
        TF's default cap of one shard (see the module docstring).

    Returns:
      A partitioner object.

    Raises:
      ValueError: for an unknown or malformed spec; the message lists the forms.
    """
    if not isinstance(spec, str):
        raise _spec_error(spec, "a spec is a string")
    kind, _, arg = spec.strip().partition(":")
    kind = kind.lower()
    if kind == "fixed":
        return FixedShardsPartitioner(_parse_int(spec, arg))
    if kind == "max_ids":
        return MaxIDPartitioner(_parse_int(spec, arg))
    if kind == "per_ps":
        partitioner = PerPSPartitioner(_parse_int(spec, arg) if arg else 1)
        return partitioner.bind(num_ps) if num_ps is not None else partitioner
    if kind == "min_size":
        max_shards = num_ps if num_ps is not None else _MIN_SIZE_DEFAULT_MAX_SHARDS
        return MinSizePartitioner(min_shard_bytes=_parse_size(spec, arg), max_shards=max_shards)
    if kind == "max_size":
        return MaxSizePartitioner(max_shard_bytes=_parse_size(spec, arg))
    raise _spec_error(spec, f"unknown kind {kind!r}")


# TF's `MinSizePartitioner` default `max_shards`, used by `min_size:SIZE` when
# the ps count is unknown (the module docstring says why it is the ps count
# otherwise); tests check that it still equals TF's.
_MIN_SIZE_DEFAULT_MAX_SHARDS = 1


# -- hot-spot analysis ---------------------------------------------------------

PLACEMENTS = ("div", "mod")


def div_shard_of(rows: np.ndarray, num_rows: int, num_shards: int) -> np.ndarray:
    """The shard of each row under TF's contiguous ("div") placement.

    The first `num_rows % num_shards` shards hold one row more than the rest,
    as `ShardedVariable` does.

    Example:

    >>> div_shard_of(np.arange(13), 13, 5).tolist()  # TF's docs: [[0,1,2],[3,4,5],[6,7,8],[9,10],[11,12]]
    [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    """
    base, extra = divmod(num_rows, num_shards)
    sizes = np.full(num_shards, base, dtype=np.int64)
    sizes[:extra] += 1
    return np.searchsorted(np.cumsum(sizes), np.asarray(rows, dtype=np.int64), side="right")


@dataclasses.dataclass
class ShardLoad:
    """Lookup load per shard.

    Attributes:
      lookups: int [num_shards], every id looked up (no dedup).
      unique_per_batch: float [num_shards], the mean number of distinct rows
        each shard serves per batch (what crosses the network with dedup).
      imbalance: max / mean of `unique_per_batch`: 1.0 is perfect balance.
      lookup_imbalance: max / mean of `lookups`.
      placement: the placement analysed.
      num_batches: batches the ids were cut into.
    """

    lookups: np.ndarray
    unique_per_batch: np.ndarray
    imbalance: float
    lookup_imbalance: float
    placement: str
    num_batches: int

    def table(self) -> str:
        """A plain-text table, one line per shard."""
        lines = [f"placement {self.placement}: {self.num_batches} batch(es)",
                 "shard  lookups  share   unique rows/batch"]
        total = max(int(self.lookups.sum()), 1)
        for shard, (count, unique) in enumerate(zip(self.lookups, self.unique_per_batch)):
            lines.append(f"{shard:5d}  {int(count):7d}  {count / total:5.1%}   {unique:10.1f}")
        lines.append(f"imbalance (max/mean): unique rows {self.imbalance:.3f}, lookups {self.lookup_imbalance:.3f}")
        return "\n".join(lines)


def _max_over_mean(values: np.ndarray) -> float:
    mean = float(np.mean(values))
    return float(np.max(values)) / mean if mean > 0 else 1.0


def shard_load(ids, num_rows: int, num_shards: int, placement: Any = "div", batch_size: int | None = None) -> ShardLoad:
    """Measures how evenly a stream of ids loads the shards of a table.

    Example:

    >>> ids = np.array([0, 0, 0, 1, 5, 6])   # ids 0-4 on shard 0, 5-9 on shard 1
    >>> load = shard_load(ids, num_rows=10, num_shards=2, placement="div")
    >>> load.lookups.tolist(), load.unique_per_batch.tolist(), round(load.imbalance, 3)
    ([4, 2], [2.0, 2.0], 1.0)
    >>> shard_load(ids, 10, 2, placement="mod").lookups.tolist()   # even ids (0, 0, 0, 6) on shard 0
    [4, 2]

    Args:
      ids: int array of ids in [0, num_rows), any shape (flattened in order).
      num_rows: the table size.
      num_shards: the shard count.
      placement: "div" (TF's contiguous ranges), "mod" (id % num_shards), or
        a `tf_psx.layers.ShardedEmbedding` (its balance setting; contiguous
        shards of its storage rows).
      batch_size: ids per batch (after flattening) for the per-batch unique
        counts; all ids are one batch when None.

    Returns:
      A `ShardLoad`.

    Raises:
      ValueError: bad sizes, ids out of range, or an unknown placement.
    """
    num_rows = _positive_int("num_rows", num_rows, "shard_load")
    num_shards = _positive_int("num_shards", num_shards, "shard_load")
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= num_rows):
        bad = flat[(flat < 0) | (flat >= num_rows)][0]
        raise ArgumentError(
            f"Argument `ids` of shard_load must lie in [0, num_rows={num_rows}); received id {int(bad)}. "
            "Fix: pass the table size as num_rows, or hash the ids into range first."
        )
    if isinstance(placement, str):
        if placement not in PLACEMENTS:
            raise ArgumentError(
                f"Argument `placement` of shard_load must be one of {list(PLACEMENTS)} or a ShardedEmbedding. "
                f"Received: {placement!r}."
            )
        name = placement
        shard = flat % num_shards if placement == "mod" else div_shard_of(flat, num_rows, num_shards)
    elif hasattr(placement, "balance") and hasattr(placement, "input_dim"):
        from tf_psx.layers.sharded import balanced_permutation  # pylint: disable=import-outside-toplevel

        rows = balanced_permutation(flat, num_rows) if placement.balance else flat
        shard = div_shard_of(rows, num_rows, num_shards)
        name = f"ShardedEmbedding(balance={placement.balance}, dedup={placement.dedup})"
    else:
        raise ArgumentError(
            f"Argument `placement` of shard_load must be one of {list(PLACEMENTS)} or a ShardedEmbedding. "
            f"Received: {placement!r}."
        )
    lookups = np.bincount(shard, minlength=num_shards)
    step = flat.size if batch_size is None else _positive_int("batch_size", batch_size, "shard_load")
    num_batches = max(1, -(-flat.size // step)) if flat.size else 1
    unique = np.zeros(num_shards, dtype=np.float64)
    for start in range(0, flat.size, step):
        distinct, first = np.unique(flat[start:start + step], return_index=True)
        del distinct
        unique += np.bincount(shard[start:start + step][first], minlength=num_shards)
    unique /= num_batches
    return ShardLoad(lookups, unique, _max_over_mean(unique), _max_over_mean(lookups), name, num_batches)

"""`tf-psx shard-report`: how evenly the ids of a file load the shards of a table, and a placement to use.

The only subcommand that imports TensorFlow (for the balanced placement and
the Criteo hashing), and only when it runs.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from tf_psx import _checks
from tf_psx.cli.common import EXIT_OK
from tf_psx.errors import CommandError


# The bar a placement must meet to be called balanced: bench/shard_balance.py's
# target (max/mean of the unique rows per shard per batch).
BALANCED_IMBALANCE = 1.10
# Ids per batch when --batch-size is not given: a typical CTR global batch.
DEFAULT_REPORT_BATCH = 4096
_CATEGORICAL_RE = re.compile(r"C(?P<index>[0-9]+)\Z")


def _add_shard_report(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "shard-report",
        help="measure how evenly a stream of ids loads the shards of a table",
        description=(
            "Run tf_psx.partitioners.shard_load on the ids of SOURCE for the contiguous placement "
            "of TF's partitioners (div), id % shards (mod) and tf_psx.layers.ShardedEmbedding "
            "(balanced), print a table per placement and recommend one. SOURCE is a .npy file of "
            "ints, a text file with one id a line, or with --column a Criteo file (TSV or CSV "
            "with header) whose categorical column is hashed as tf_psx.data.criteo_keys does. "
            "Example: tf-psx shard-report ids.npy --shards 8 --batch-size 4096"
        ),
    )
    parser.add_argument("source", metavar="SOURCE", help="a .npy file, a text file of ids, or a Criteo file")
    parser.add_argument("--shards", type=int, required=True, help="shard count of the table")
    parser.add_argument(
        "--rows", type=int, default=None,
        help="table size; default max id + 1 (ids files), required with --column (the vocabulary size)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=DEFAULT_REPORT_BATCH,
        help=f"ids per batch for the unique-row counts (default {DEFAULT_REPORT_BATCH})",
    )
    parser.add_argument("--column", default=None, help="Criteo categorical column C1..C26 to analyse")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of tables")
    parser.set_defaults(run=_run_shard_report)


def _read_id_file(path: str):
    import numpy as np  # pylint: disable=import-outside-toplevel

    if path.endswith(".npy"):
        try:
            ids = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise CommandError(f'SOURCE "{path}" is not a readable .npy file ({err}). Fix: save it with numpy.save.') from None
        if not np.issubdtype(ids.dtype, np.integer):
            raise CommandError(
                f'SOURCE "{path}" must hold integer ids; received dtype {ids.dtype}. '
                "Fix: save the ids as int64 (numpy.save(path, ids.astype('int64')))."
            )
        return ids.reshape(-1).astype(np.int64)
    ids = []
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            text = line.strip()
            if not text:
                continue
            try:
                ids.append(int(text))
            except ValueError:
                raise CommandError(
                    f'SOURCE "{path}" line {lineno} must be one integer id; received {text[:40]!r}. '
                    "Fix: write one id a line, or pass a Criteo file with --column C1..C26."
                ) from None
    return np.asarray(ids, dtype=np.int64)


def _read_criteo_column(path: str, column: str, rows: int):
    import numpy as np  # pylint: disable=import-outside-toplevel

    from tf_psx.data.criteo import CriteoReader  # pylint: disable=import-outside-toplevel

    reader = CriteoReader(path, batch_size=DEFAULT_REPORT_BATCH, vocab_size=rows)
    index = int(_CATEGORICAL_RE.match(column).group("index")) - 1
    parts = [features["cat"][:, index].numpy() for features, _ in reader.dataset()]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _run_shard_report(args: argparse.Namespace) -> int:
    import json  # pylint: disable=import-outside-toplevel
    import os  # pylint: disable=import-outside-toplevel
    import types  # pylint: disable=import-outside-toplevel

    for option, value in (("--shards", args.shards), ("--rows", args.rows), ("--batch-size", args.batch_size)):
        if value is not None:
            _checks.int_at_least(value, 1, f"Option `{option}`", error=CommandError)
    if not os.path.isfile(args.source):
        raise CommandError(f'SOURCE "{args.source}" is not a file. Fix: pass an existing .npy, text or Criteo file.')
    if args.column is not None:
        match = _CATEGORICAL_RE.match(args.column)
        if match is None or not 1 <= int(match.group("index")) <= 26:
            raise CommandError(f'Option `--column` must be one of C1..C26. Received: "{args.column}".')
        if args.rows is None:
            raise CommandError(
                "Option `--rows` is required with --column: it is the vocabulary size the keys are "
                "taken modulo (the input_dim of the embedding). Fix: add e.g. --rows 1000000."
            )
        ids = _read_criteo_column(args.source, args.column, args.rows)
    else:
        ids = _read_id_file(args.source)
    if ids.size == 0:
        raise CommandError(f'SOURCE "{args.source}" holds no ids. Fix: pass a file with at least one id.')
    if int(ids.min()) < 0:
        raise CommandError(
            f'SOURCE "{args.source}" holds the negative id {int(ids.min())}. Fix: ids must be row numbers >= 0; '
            "hash raw keys into [0, rows) first (tf_psx.data.criteo_keys does for Criteo)."
        )
    rows = args.rows if args.rows is not None else int(ids.max()) + 1
    if int(ids.max()) >= rows:
        raise CommandError(
            f"Option `--rows` must exceed every id; received --rows {rows} but SOURCE holds id {int(ids.max())}. "
            f"Fix: pass --rows {int(ids.max()) + 1} or more (the table size)."
        )
    from tf_psx.partitioners import shard_load  # pylint: disable=import-outside-toplevel

    balanced = types.SimpleNamespace(balance=True, dedup=True, input_dim=rows)
    placements = {"div": "div", "mod": "mod", "balanced": balanced}
    loads = {
        name: shard_load(ids, rows, args.shards, placement=placement, batch_size=args.batch_size)
        for name, placement in placements.items()
    }
    advice = _shard_advice(loads, rows, args.shards)
    if args.json:
        print(json.dumps({
            "source": args.source, "ids": int(ids.size), "rows": rows, "shards": args.shards,
            "batch_size": args.batch_size,
            "placements": {
                name: {
                    "imbalance": load.imbalance, "lookup_imbalance": load.lookup_imbalance,
                    "lookups": load.lookups.tolist(), "unique_per_batch": load.unique_per_batch.tolist(),
                }
                for name, load in loads.items()
            },
            "recommendation": advice,
        }, indent=2))
        return EXIT_OK
    print(f"{args.source}: {ids.size} ids, {rows} rows, {args.shards} shards, batches of {args.batch_size}")
    for load in loads.values():
        print()
        print(load.table())
    print()
    print(f"recommendation: {advice}")
    return EXIT_OK


def _shard_advice(loads: dict, rows: int, shards: int) -> str:
    div, mod, balanced = loads["div"].imbalance, loads["mod"].imbalance, loads["balanced"].imbalance
    if div <= BALANCED_IMBALANCE:
        return (
            f"the default contiguous placement is balanced (unique-row imbalance {div:.3f} <= "
            f"{BALANCED_IMBALANCE}); keep tf.keras.layers.Embedding with partitioner fixed:{shards}."
        )
    advice = (
        f"use tf_psx.layers.ShardedEmbedding({rows}, dim) (balance=True, dedup=True): unique-row "
        f"imbalance {balanced:.3f} against {div:.3f} for the default contiguous placement"
    )
    if balanced <= BALANCED_IMBALANCE:
        if mod <= BALANCED_IMBALANCE:
            return advice + (
                f". id % {shards} is as even here ({mod:.3f}): mod is enough while the ids have no stride "
                f"sharing a factor with {shards} (ids such as value * num_fields + field); ShardedEmbedding "
                "stays even when they do.")
        return advice + (
            f". id % {shards} is not ({mod:.3f}): the ids have a structure that mod follows (a stride "
            f"sharing a factor with {shards}, e.g. value * num_fields + field).")
    # Even a bijection cannot split one row: a few ids are each hotter than a
    # shard's fair share of the distinct rows (id % shards gives `mod`).
    return (
        advice + f" (id % {shards} gives {mod:.3f}). Neither reaches {BALANCED_IMBALANCE}: the "
        "batches are too small for their distinct rows to spread; larger batches or fewer shards "
        "even the load."
    )

"""`tf-psx`: the tf_psx command line.

Subcommands:
  config   print the TF_CONFIG of one task of a cluster given by flags, or
           check an existing TF_CONFIG (`--check`).
  k8s      write the Kubeflow TFJob manifest of a parameter-server job.
  shard-report
           measure how evenly the ids of a file load the shards of a table,
           and recommend a placement.
  launch   run a whole parameter-server job on this machine: start the ps
           and worker tasks, run the command as the chief, restart failed
           tasks (tf_psx.launch).
  scale    change the worker count of a running launch job (tf_psx.launch).
  export   `--verify DIR`: check an exported model against its manifest
           (tf_psx/trail.py).
  doctor   check a cluster before a run: addresses reachable, the chief's
           port free, clocks and package versions of every task
           (tf_psx/cluster/preflight.py).

Every invalid input prints the error (which names the option, the value
received and the fix) on stderr and exits with status 2, as argparse does for
bad usage. Only shard-report imports TensorFlow (for the balanced placement and
the Criteo hashing); the others answer at once.

Each group of subcommands is a module of this package: `config`, `k8s`,
`shard_report`, `launch` (launch and scale), `export` and `doctor`;
`common` holds the program's name and exit statuses.

Adding a subcommand: write `_add_<name>(subparsers)` in its module, which
calls `subparsers.add_parser("<name>", ...)`, adds its arguments and sets
`run=<function(args) -> int>` with `set_defaults`; then append it to
`_SUBCOMMANDS` here. A run function reports a bad input by raising
`CommandError`, `TFConfigError` or `ManifestError`; `main` prints it and
returns 2.

Example:

>>> main(["config", "--workers", "w0:2222", "--ps", "ps0:2222", "--task", "ps:0"])
{"cluster": {"worker": ["w0:2222"], "ps": ["ps0:2222"]}, "task": {"type": "ps", "index": 0}}
0
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from tf_psx.cli.common import EXIT_OK, EXIT_USAGE, PROG  # noqa: F401  (`tf_psx.cli.X` as before)
from tf_psx.cli.config import _add_config
from tf_psx.cli.doctor import _add_doctor
from tf_psx.cli.export import _add_export
from tf_psx.cli.k8s import _add_k8s
from tf_psx.cli.launch import _add_launch, _add_scale
from tf_psx.cli.shard_report import BALANCED_IMBALANCE, DEFAULT_REPORT_BATCH, _add_shard_report  # noqa: F401
from tf_psx.cluster import TFConfigError
from tf_psx.cluster.k8s import ManifestError
from tf_psx.errors import CommandError

__all__ = ["CommandError", "main"]

# The subcommands, in the order `tf-psx --help` lists them (see the module docstring).
_SUBCOMMANDS: list[Callable[[Any], None]] = [_add_config, _add_k8s, _add_shard_report, _add_launch, _add_scale,
                                             _add_export, _add_doctor]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Tools for tf_psx parameter-server clusters."
    )
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs `tf-psx`.

    Args:
      argv: the arguments after the program name; None reads `sys.argv[1:]`.

    Returns:
      The exit status: 0 on success, 2 on a bad option or input (the error is
      printed on stderr).

    Example:

    >>> main(["config", "--workers", "w0:2222", "--ps", "ps0", "--task", "worker:0"])
    2
    """
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad usage (2).
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        return args.run(args)
    except (CommandError, TFConfigError, ManifestError) as err:
        print(f"{PROG} {args.subcommand}: error: {err}", file=sys.stderr)
        return EXIT_USAGE

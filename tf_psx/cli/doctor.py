"""`tf-psx doctor TF_CONFIG`: check a cluster before a run (tf_psx.cluster.preflight)."""

from __future__ import annotations

import argparse
from typing import Any

from tf_psx.errors import CommandError


def _add_doctor(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check a cluster before a run",
        description=(
            "Check the cluster of a TF_CONFIG before a run: every ps and worker address accepts a connection, "
            "the chief's port is free on this host, and (through TensorFlow, connected as the chief) every "
            "task's clock is within 500 ms of this host's and its TF, tf-keras, TFRA and tf_psx versions "
            "equal this host's (tasks started with python -m tf_psx.server). Warns when tasks listen beyond "
            "loopback. Exit status 0 when every check passes, 1 otherwise. Example: tf-psx doctor "
            "\"$TF_CONFIG\""
        ),
    )
    parser.add_argument("tf_config", nargs="?", metavar="TF_CONFIG",
                        help="the TF_CONFIG JSON, or @FILE (default: the TF_CONFIG environment variable)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="bound on the TensorFlow checks in seconds (default: 120)")
    parser.set_defaults(run=_run_doctor)


def _run_doctor(args: argparse.Namespace) -> int:
    import os  # pylint: disable=import-outside-toplevel

    from tf_psx.cluster import preflight  # pylint: disable=import-outside-toplevel  (TF-free; TF runs in its child)

    text = args.tf_config if args.tf_config is not None else os.environ.get("TF_CONFIG")
    if not text:
        raise CommandError("tf-psx doctor needs a TF_CONFIG: pass it as the argument (JSON or @FILE) or set the "
                           "TF_CONFIG environment variable. Received neither.")
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="utf-8") as handle:
                text = handle.read()
        except OSError as err:
            raise CommandError(f"tf-psx doctor cannot read the TF_CONFIG file {text[1:]!r}: {err.strerror}.") from None
    timeout = preflight.DEFAULT_PROBE_TIMEOUT_S if args.timeout is None else args.timeout
    if not timeout > 0:
        raise CommandError(f"Option `--timeout` must be a number > 0. Received: {args.timeout!r}. Fix: pass e.g. --timeout 60.")
    lines, ok = preflight.check_cluster(text, probe_timeout_s=timeout)
    print("\n".join(lines))
    print("tf-psx doctor: " + ("every check passed" if ok else "some checks FAILED (see above)"))
    return 0 if ok else 1


"""`tf-psx config`: print the TF_CONFIG of one task of a cluster given by flags, or check one (`--check`)."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from tf_psx.cli.common import EXIT_OK
from tf_psx.cluster import TF_CONFIG_ENV, ClusterConfig, TFConfigError
from tf_psx.errors import CommandError


# What `--check` reads when it is given without FILE, and the FILE meaning stdin.
_CHECK_ENV = object()
_STDIN = "-"

_TASK_RE = re.compile(r"(?P<type>[A-Za-z_]+):(?P<index>[0-9]+)\Z")
_EXAMPLE_ADDRESSES = "w0:2222,w1:2222"
_CONFIG_CLUSTER_FLAGS = ("workers", "ps", "chief", "evaluator", "task")


def _add_config(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "config",
        help="print the TF_CONFIG of one task, or check a TF_CONFIG",
        description=(
            "Print the TF_CONFIG JSON of one task of the cluster given by --workers, --ps, "
            "--chief and --evaluator, e.g. export TF_CONFIG=$(tf-psx config --workers "
            f"{_EXAMPLE_ADDRESSES} --ps ps0:2222 --task worker:0). With --check, check the "
            f"${TF_CONFIG_ENV} environment variable, or FILE ('-' for stdin), instead."
        ),
    )
    parser.add_argument("--workers", metavar="HOST:PORT,...", help="the worker addresses, comma-separated")
    parser.add_argument(
        "--ps", metavar="HOST:PORT,...", help="the parameter-server addresses, comma-separated"
    )
    parser.add_argument("--chief", metavar="HOST:PORT", help="the chief's (coordinator's) address")
    parser.add_argument("--evaluator", metavar="HOST:PORT", help="the sidecar evaluator's address")
    parser.add_argument("--task", metavar="TYPE:INDEX", help="the task to print, e.g. worker:0 or chief:0")
    parser.add_argument(
        "--check",
        nargs="?",
        const=_CHECK_ENV,
        metavar="FILE",
        help=f"check ${TF_CONFIG_ENV}, or the TF_CONFIG JSON in FILE ('-' for stdin), and exit",
    )
    parser.set_defaults(run=_run_config)


def _split_addresses(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [part.strip() for part in text.split(",")]


def _parse_task(text: str) -> tuple[str, int]:
    match = _TASK_RE.match(text.strip())
    if match is None:
        raise CommandError(
            f'Option `--task` must be "TYPE:INDEX" (a task type, a colon and the index in its '
            f'job, e.g. "worker:0"); received "{text}". Fix: pass e.g. --task chief:0 or --task ps:1.'
        )
    return match["type"], int(match["index"])


def _run_config(args: argparse.Namespace) -> int:
    if args.check is not None:
        given = [f"--{flag}" for flag in _CONFIG_CLUSTER_FLAGS if getattr(args, flag) is not None]
        if given:
            raise CommandError(
                f"Option `--check` checks an existing TF_CONFIG and takes no cluster options; "
                f"received {', '.join(given)} as well. Fix: drop --check to print a TF_CONFIG, or "
                "drop the other options to check one."
            )
        return _check(args.check)
    for flag, example in (("workers", _EXAMPLE_ADDRESSES), ("ps", "ps0:2222"), ("task", "worker:0")):
        if getattr(args, flag) is None:
            raise CommandError(
                f"Option `--{flag}` is required to print a TF_CONFIG; received nothing. Fix: pass "
                f"e.g. --{flag} {example}, or use --check to check an existing TF_CONFIG."
            )
    task_type, index = _parse_task(args.task)
    config = ClusterConfig(
        workers=_split_addresses(args.workers),
        ps=_split_addresses(args.ps),
        chief=args.chief,
        evaluator=args.evaluator,
    )
    try:
        text = config.to_json(task_type, index)
    except TFConfigError as err:
        raise CommandError(f'Option `--task` "{args.task}" names no task of the cluster: {err}') from None
    print(text)
    return EXIT_OK


def _read_tf_config(source: Any) -> tuple[str | None, str]:
    """Returns (the TF_CONFIG text or None for the environment, its name for messages)."""
    if source is _CHECK_ENV:
        return None, f"${TF_CONFIG_ENV}"
    if source == _STDIN:
        return sys.stdin.read(), "<stdin>"
    try:
        with open(source, encoding="utf-8") as handle:
            return handle.read(), source
    except FileNotFoundError:
        raise CommandError(
            f'FILE "{source}" of `--check FILE` does not exist; expected a file holding TF_CONFIG '
            f"JSON. Fix: check the path, or run --check without FILE to check ${TF_CONFIG_ENV}."
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise CommandError(
            f'FILE "{source}" of `--check FILE` cannot be read as UTF-8 text ({err}). Fix: pass a '
            "readable text file holding TF_CONFIG JSON, or '-' to read it from stdin."
        ) from None


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' if count != 1 and noun != 'ps' else ''}"


def _check(source: Any) -> int:
    text, where = _read_tf_config(source)
    try:
        config = ClusterConfig.from_tf_config(text)
        # tf-psx runs parameter-server training, which needs workers and ps. An
        # evaluator's own TF_CONFIG holds only the evaluator job (see
        # ClusterConfig.tf_config), so it is valid without them.
        if config.task_type != "evaluator":
            config.validate_for_parameter_server()
    except TFConfigError as err:
        raise CommandError(f"{where}: {err}") from None
    parts = [_plural(config.num_workers, "worker"), _plural(config.num_ps, "ps")]
    parts += [job for job in ("chief", "evaluator") if getattr(config, job) is not None]
    parts.append(f"task {config.task_type}:{config.task_index}" if config.task_type else "no task")
    print(f"valid: {', '.join(parts)}")
    return EXIT_OK

"""`tf-psx launch` and `tf-psx scale`: run a parameter-server job on this machine, and resize it (tf_psx.launch)."""

from __future__ import annotations

import argparse
from typing import Any

from tf_psx.errors import CommandError


def _add_launch(subparsers: Any) -> None:
    from tf_psx import launch  # pylint: disable=import-outside-toplevel  (TF-free)

    parser = subparsers.add_parser(
        "launch",
        help="run a parameter-server job on this machine, restarting failed tasks",
        description=(
            "Start --ps parameter servers and --workers workers (python -m tf_psx.server) on free "
            "loopback ports, then run CMD as the chief with its TF_CONFIG. Task output is streamed "
            "with a [type:index] prefix and kept in LOG_DIR/<type>-<index>.log. A dead worker is "
            "restarted; a dead ps restarts the ps tasks and the chief, which resumes from the newest "
            f"snapshot in ${launch.SNAPSHOT_DIR_ENV}. The exit status is the chief's. Example: tf-psx "
            "launch --workers 2 --ps 1 -- python train.py"
        ),
    )
    parser.add_argument("--workers", required=True, type=int, metavar="N", help="the number of workers")
    parser.add_argument("--ps", required=True, type=int, metavar="M", help="the number of parameter servers")
    parser.add_argument(
        "--evaluator", action="store_true", help="also run CMD as the side-car evaluator (TF_CONFIG task evaluator:0)"
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=launch.DEFAULT_MAX_RESTARTS,
        metavar="K",
        help=f"give up after K task restarts in all (default: {launch.DEFAULT_MAX_RESTARTS})",
    )
    parser.add_argument("--log-dir", metavar="D", help="where the per-task logs go (default: a new temporary directory)")
    parser.add_argument(
        "--snapshot-dir",
        metavar="S",
        help=f"${launch.SNAPSHOT_DIR_ENV} of the chief and the evaluator (default: LOG_DIR/snapshots)",
    )
    parser.add_argument(
        "--isolate", action="store_true", help="run the whole job in a private network namespace (Linux)"
    )
    parser.add_argument(
        "--intra-op-threads", default="auto", metavar="N",
        help="intra-op threads of each ps and worker task (default: auto, the CPUs divided among the tasks)",
    )
    parser.add_argument("--inter-op-threads", type=int, metavar="N",
                        help="inter-op threads of each ps and worker task (default: TF's; workers at least N+1)")
    parser.add_argument(
        "--metrics-port", type=int, metavar="P",
        help="serve Prometheus metrics of the tasks on P; the chief's ClusterMonitor serves training metrics on P+1",
    )
    parser.add_argument(
        "--data-workers", type=int, default=0, metavar="N",
        help="also run a tf.data service dispatcher and N data workers; the chief gets its address in "
             "$TF_PSX_DATA_SERVICE (docs/guides/input.md)",
    )
    parser.add_argument("command", nargs="*", metavar="CMD", help="after --: the chief's command")
    parser.set_defaults(run=_run_launch)


def _int_or_word(text: str) -> int | str:
    """An option that is an int or a word ("auto"): the int, or the text (the launcher refuses a bad one)."""
    return int(text) if text.isdigit() else text


def _run_launch(args: argparse.Namespace) -> int:
    from tf_psx import launch  # pylint: disable=import-outside-toplevel  (TF-free)

    try:
        launcher = launch.Launcher(
            args.command,
            workers=args.workers,
            ps=args.ps,
            evaluator=args.evaluator,
            max_restarts=args.max_restarts,
            log_dir=args.log_dir,
            snapshot_dir=args.snapshot_dir,
            isolate=args.isolate,
            metrics_port=args.metrics_port,
            intra_op_threads=_int_or_word(args.intra_op_threads),
            inter_op_threads=args.inter_op_threads,
            data_workers=args.data_workers,
        )
        return launcher.run()
    except launch.LaunchError as err:
        raise CommandError(str(err)) from None


def _add_scale(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "scale",
        help="change the worker count of a running tf-psx launch job",
        description=(
            "Ask the tf-psx launch job whose log directory is LOG_DIR to run with N workers. The launcher "
            "stops the chief and any removed workers, starts any added workers, and starts the chief again "
            "with the new TF_CONFIG; it resumes from the newest PeriodicSync snapshot, so the steps since that "
            "snapshot are trained again. The ps tasks keep running. "
            "Example: tf-psx scale /tmp/tf_psx_launch_abc --workers 4"
        ),
    )
    parser.add_argument("log_dir", metavar="LOG_DIR", help="the launcher's log directory (its \"cluster:\" line)")
    parser.add_argument("--workers", required=True, type=int, metavar="N", help="the new number of workers")
    parser.set_defaults(run=_run_scale)


def _run_scale(args: argparse.Namespace) -> int:
    from tf_psx import launch  # pylint: disable=import-outside-toplevel  (TF-free)

    try:
        pid = launch.request_scale(args.log_dir, args.workers)
    except launch.LaunchError as err:
        raise CommandError(str(err)) from None
    print(f"tf-psx scale: asked the launcher (pid {pid}) for {args.workers} workers; it says \"scaled to "
          f"{args.workers} workers\" once the chief runs again")
    return 0

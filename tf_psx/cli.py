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
           tasks (tf_psx/launch.py).
  scale    change the worker count of a running launch job (tf_psx/launch.py).
  export   `--verify DIR`: check an exported model against its manifest
           (tf_psx/trail.py).
  doctor   check a cluster before a run: addresses reachable, the chief's
           port free, clocks and package versions of every task
           (tf_psx/cluster/preflight.py).

Every invalid input prints the error (which names the option, the value
received and the fix) on stderr and exits with status 2, as argparse does for
bad usage. Only shard-report imports TensorFlow (for the balanced placement and
the Criteo hashing); the others answer at once.

Adding a subcommand: write `_add_<name>(subparsers)`, which calls
`subparsers.add_parser("<name>", ...)`, adds its arguments and sets
`run=<function(args) -> int>` with `set_defaults`; then append it to
`_SUBCOMMANDS`. A run function reports a bad input by raising `CommandError`,
`TFConfigError` or `ManifestError`; `main` prints it and returns 2.

Example:

>>> main(["config", "--workers", "w0:2222", "--ps", "ps0:2222", "--task", "ps:0"])
{"cluster": {"worker": ["w0:2222"], "ps": ["ps0:2222"]}, "task": {"type": "ps", "index": 0}}
0
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml

from tf_psx import _checks
from tf_psx.cluster import TF_CONFIG_ENV, ClusterConfig, TFConfigError
from tf_psx.errors import CommandError
from tf_psx.cluster.k8s import DEFAULT_PORT, ManifestError, network_policy, tfjob_manifest

__all__ = ["CommandError", "main"]

PROG = "tf-psx"
EXIT_OK = 0
# argparse exits with 2 on bad usage; every other bad input exits the same way.
EXIT_USAGE = 2

# What `--check` reads when it is given without FILE, and the FILE meaning stdin.
_CHECK_ENV = object()
_STDIN = "-"

_TASK_RE = re.compile(r"(?P<type>[A-Za-z_]+):(?P<index>[0-9]+)\Z")
_EXAMPLE_ADDRESSES = "w0:2222,w1:2222"
_CONFIG_CLUSTER_FLAGS = ("workers", "ps", "chief", "evaluator", "task")

# tfjob_manifest argument -> how `tf-psx k8s` names it in an error.
_K8S_OPTION_LABELS = {
    "name": "Option `--name`",
    "image": "Option `--image`",
    "command": "The command after `--`",
    "workers": "Option `--workers`",
    "ps": "Option `--ps`",
    "cpu": "Option `--cpu`",
    "memory": "Option `--memory`",
    "gpus": "Option `--gpus`",
    "namespace": "Option `--namespace`",
    "port": "Option `--port`",
    "tls_secret": "Option `--tls-secret`",
}


# --- config ----------------------------------------------------------------


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


# --- k8s -------------------------------------------------------------------


def _add_k8s(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "k8s",
        help="write a Kubeflow TFJob manifest",
        description=(
            "Write the Kubeflow TFJob (kubeflow.org/v1) of a parameter-server job as YAML: one "
            "Chief running CMD, --workers Workers and --ps PS running python -m tf_psx.server, "
            "and with --evaluator one Evaluator running CMD. Example: tf-psx k8s --name ctr "
            "--image registry.example.com/ctr:1 --workers 4 --ps 2 -- python train.py"
        ),
    )
    parser.add_argument("--name", required=True, help="the TFJob name (lowercase letters, digits, '-')")
    parser.add_argument("--image", required=True, help="the container image of every replica")
    parser.add_argument("--workers", required=True, type=int, metavar="N", help="the number of workers")
    parser.add_argument("--ps", required=True, type=int, metavar="M", help="the number of parameter servers")
    parser.add_argument("--evaluator", action="store_true", help="add an Evaluator replica running CMD")
    parser.add_argument("--cpu", help='CPU request and limit of every container, e.g. "4" or "500m"')
    parser.add_argument("--memory", help='memory request and limit of every container, e.g. "16Gi"')
    parser.add_argument("--gpus", type=int, default=0, metavar="G", help="GPUs of the chief and each worker")
    parser.add_argument("--namespace", help="metadata.namespace (default: left to kubectl)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"the port of every task (default: {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--tls-secret", metavar="SECRET",
        help="the tasks talk over mutual TLS only (tf_psx.tlsmesh), with the certificates of this secret "
             "(ca.crt, tls.crt, tls.key); a NetworkPolicy admitting only --port is written too",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write the YAML to FILE instead of stdout")
    parser.add_argument("command", nargs="*", metavar="CMD", help="after --: the chief's command")
    parser.set_defaults(run=_run_k8s)


def _run_k8s(args: argparse.Namespace) -> int:
    if not args.command:
        raise CommandError(
            "The command after `--` is missing; received no CMD (the Chief's and the Evaluator's "
            "command). Fix: end the options with --, then the command, e.g. -- python train.py."
        )
    try:
        manifest = tfjob_manifest(
            name=args.name,
            image=args.image,
            command=args.command,
            workers=args.workers,
            ps=args.ps,
            evaluator=args.evaluator,
            cpu=args.cpu,
            memory=args.memory,
            gpus=args.gpus,
            namespace=args.namespace,
            port=args.port,
            tls_secret=args.tls_secret,
        )
        documents = [manifest]
        if args.tls_secret is not None:
            documents.append(network_policy(args.name, namespace=args.namespace, port=args.port))
    except ManifestError as err:
        label = _K8S_OPTION_LABELS.get(err.argument)
        raise CommandError(err.renamed(label) if label else str(err)) from None
    text = yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)
    replicas = {rtype: spec["replicas"] for rtype, spec in manifest["spec"]["tfReplicaSpecs"].items()}
    summary = ", ".join(f"{count} {rtype}" for rtype, count in replicas.items())
    if len(documents) > 1:
        summary += "; TLS only, with its NetworkPolicy"
    if args.output is None:
        sys.stdout.write(text)
        print(f"{PROG} k8s: wrote TFJob {args.name} ({summary}) to stdout", file=sys.stderr)
        return EXIT_OK
    try:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as err:
        raise CommandError(
            f'Option `-o` FILE "{args.output}" cannot be written ({err}). Fix: pass a path in an '
            "existing, writable directory, or leave out -o to write to stdout."
        ) from None
    print(
        f"{PROG} k8s: wrote TFJob {args.name} ({summary}) to {args.output}; "
        f"start it with: kubectl apply -f {args.output}",
        file=sys.stderr,
    )
    return EXIT_OK


# --- shard-report ----------------------------------------------------------

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
            "of TF's partitioners (div), id %% shards (mod) and tf_psx.layers.ShardedEmbedding "
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
        return advice + "."
    # Even a bijection cannot split one row: a few ids are each hotter than a
    # shard's fair share of the distinct rows (id % shards gives `mod`).
    return (
        advice + f" (id % {shards} gives {mod:.3f}). Neither reaches {BALANCED_IMBALANCE}: the "
        "batches are too small for their distinct rows to spread; larger batches or fewer shards "
        "even the load."
    )


# --- launch ----------------------------------------------------------------


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
        )
        return launcher.run()
    except launch.LaunchError as err:
        raise CommandError(str(err)) from None


# --- main ------------------------------------------------------------------

# The subcommands, in the order `tf-psx --help` lists them (see the module docstring).
# --- export --------------------------------------------------------------------


def _add_export(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "export",
        help="check an exported model against its manifest",
        description=(
            "With --verify DIR: recompute the SHA-256 of every file of the SavedModel that "
            "tf_psx.export_serving wrote to DIR and compare them with its tf_psx_manifest.json. Prints the "
            "content hash and the facts of the manifest, or each file that changed, is missing or was added "
            "(exit status 1)."
        ),
    )
    parser.add_argument("--verify", metavar="DIR", required=True, help="the exported model's directory")
    parser.set_defaults(run=_run_export)


def _run_export(args: Any) -> int:
    import json  # pylint: disable=import-outside-toplevel

    from tf_psx import trail  # pylint: disable=import-outside-toplevel

    try:
        manifest = trail.read_manifest(args.verify)
    except FileNotFoundError as error:
        raise CommandError(f"Option `--verify`: {error}") from None
    problems = trail.verify(args.verify)
    if problems:
        print(f"{args.verify}: does not match its manifest:")
        for problem in problems:
            print(f"  {problem}")
        return 1
    facts = {key: value for key, value in manifest.items() if key not in ("files", "content_hash")}
    print(f"{args.verify}: ok, content hash {manifest['content_hash']} ({len(manifest['files'])} files)")
    print(json.dumps(facts, sort_keys=True))
    return EXIT_OK


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

    from tf_psx.cluster import preflight as doctor  # pylint: disable=import-outside-toplevel  (TF-free; TF runs in its child)

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
    timeout = doctor.DEFAULT_PROBE_TIMEOUT_S if args.timeout is None else args.timeout
    if not timeout > 0:
        raise CommandError(f"Option `--timeout` must be a number > 0. Received: {args.timeout!r}. Fix: pass e.g. --timeout 60.")
    lines, ok = doctor.check_cluster(text, probe_timeout_s=timeout)
    print("\n".join(lines))
    print("tf-psx doctor: " + ("every check passed" if ok else "some checks FAILED (see above)"))
    return 0 if ok else 1


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


if __name__ == "__main__":
    sys.exit(main())

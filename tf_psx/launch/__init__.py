"""`tf-psx launch`: a whole parameter-server job on this machine.

`Launcher` (tf_psx.launch.launcher) starts every ps and worker task
(`python -m tf_psx.server`, each with its own TF_CONFIG, on free loopback
ports), waits until they listen, and then runs your training command as the
chief, with the chief's TF_CONFIG and GRPC_FAIL_FAST=use_caller. While the
job runs it:

* streams every task's output with a prefix (`[ps:0]`, `[worker:1]`,
  `[chief:0]`) and keeps it in one log file per task (`<log_dir>/ps-0.log`);
* restarts a worker that dies, on its old port: `ClusterCoordinator` re-runs
  the lost worker's steps on the other workers and uses the worker again once
  it is back;
* restarts the ps tasks and then the chief when a ps dies: in TF 2.16 a ps
  failure is fatal to the coordinator, so the chief starts over and resumes
  from the newest `tf_psx.callbacks.PeriodicSync` snapshot;
* gives up after `max_restarts` restarts in all, naming the task that failed,
  its exit status and its log file;
* stops every task (SIGTERM to each task's process group, SIGKILL after a
  grace period) on Ctrl-C or SIGTERM, or when the chief exits. The exit
  status is the chief's.

The contract with the training command:
  * It runs as the chief: it reads the cluster from TF_CONFIG
    (`tf_psx.ParameterServerStrategy()` with no argument does) and must not
    start servers itself.
  * `TF_PSX_SNAPSHOT_DIR` holds the snapshot directory (`--snapshot-dir`,
    `<log_dir>/snapshots` by default). Give it to `PeriodicSync` so that a
    restarted chief resumes where the last snapshot left off; a command that
    keeps no snapshots starts from step 0 after a ps failure.
  * `TF_PSX_CHIEF_ATTEMPT` is 0 for the first chief and counts the restarts.
    (The whole contract, files included: tf_psx.launch.contract.)
  * With `evaluator=True` the same command also runs as the side-car
    evaluator, with TF_CONFIG task `evaluator:0` and a cluster that holds only
    the evaluator job (`ClusterConfig` keeps it out of the training cluster,
    tensorflow#46169). The command checks `task_type()` and, for the
    evaluator, builds the model and its holdout data and calls
    `run_sidecar_evaluator(model, data)`, which runs tf-keras'
    `SidecarEvaluator` on the snapshot directory. Once the chief has finished
    the launcher writes `<snapshot_dir>/TRAINING_DONE`; the evaluator stops
    after it has evaluated the newest snapshot, or is stopped
    `EVALUATOR_FINISH_TIMEOUT_S` later (tf_psx.launch.evaluator).

Security: TensorFlow's gRPC servers have no authentication and listen on
every interface, even when TF_CONFIG says 127.0.0.1 (docs/security.md). The
launcher says so in a one-line warning, unless `isolate=True`: then the whole
job runs in a private network namespace whose only interface is its own
loopback, and nothing outside the job can reach its ports
(tf_psx.launch.isolation).

`tf-psx scale LOG_DIR --workers N` (`request_scale`) changes the worker
count of a running job; the chief restarts and resumes from the newest
snapshot (tf_psx.launch.elastic).

Importing this package does not import TensorFlow.

Known limitations:
  * A chief that fails by itself (not because a ps died) is not restarted:
    the launcher stops the job and exits with the chief's status. Launch again
    with the same `--snapshot-dir` to resume from the newest snapshot.
  * A step that a killed worker had already applied to the ps when it died is
    run again on another worker (TF retries closures at least once, not
    exactly once), so `optimizer.iterations` can exceed the steps of `fit` by
    at most the number of worker failures.
  * `isolate=True` needs Linux and either root or unprivileged user
    namespaces; the job cannot then reach the network (data must be local).
  * The evaluator is not restarted when it fails; its log says why, and
    training goes on.
  * All tasks run on this machine. For several machines use TF_CONFIG
    (`tf-psx config`) or Kubernetes (`tf-psx k8s`).

Example (the CLI; see docs/guides/fault_tolerance.md):

    tf-psx launch --workers 2 --ps 1 --max-restarts 3 -- python train.py

Example (the API, here with a command that only prints its task):

>>> import sys
>>> code = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
...         "print(c['task'], sorted(c['cluster']))")
>>> Launcher([sys.executable, "-c", code], workers=1, ps=1, out=sys.stdout,
...          err=sys.stdout).run()  # doctest: +ELLIPSIS
tf-psx launch: warning: ...
...
[chief:0] {'type': 'chief', 'index': 0} ['chief', 'ps', 'worker']
tf-psx launch: chief:0 finished with exit status 0; logs in ...
0
"""

# The names `tf_psx.launch.X` has always had; the constants outside __all__
# are read by the CLI, the tests and the benchmarks.
from tf_psx.errors import LaunchError
from tf_psx.launch.contract import (  # noqa: F401
    CHIEF_ATTEMPT_ENV,
    EXIT_GAVE_UP,
    MAX_WORKERS,
    PIDS_FILE,
    SNAPSHOT_DIR_ENV,
    TRAINING_DONE_FILE,
    request_scale,
    snapshot_dir,
    task_type,
)
from tf_psx.launch.evaluator import run_sidecar_evaluator
from tf_psx.launch.launcher import DEFAULT_MAX_RESTARTS, STOP_GRACE_S, Launcher  # noqa: F401

__all__ = [
    "CHIEF_ATTEMPT_ENV",
    "LaunchError",
    "Launcher",
    "SNAPSHOT_DIR_ENV",
    "TRAINING_DONE_FILE",
    "request_scale",
    "run_sidecar_evaluator",
    "snapshot_dir",
    "task_type",
]

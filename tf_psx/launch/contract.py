"""The contract between `tf-psx launch` and the command it runs: environment, files, exit status.

What the launcher hands the chief and the evaluator:

* `TF_CONFIG`: the task's cluster; `task_type()` reads its task type.
* `$TF_PSX_SNAPSHOT_DIR` (`SNAPSHOT_DIR_ENV`): the snapshot directory;
  `snapshot_dir()` reads it. Give it to `PeriodicSync` so that a restarted
  chief resumes where the last snapshot left off.
* `$TF_PSX_CHIEF_ATTEMPT` (`CHIEF_ATTEMPT_ENV`): 0 for the first chief,
  counting the restarts.

The files it keeps:

* `<snapshot_dir>/TRAINING_DONE` (`TRAINING_DONE_FILE`): written once the
  chief has exited with status 0; the side-car evaluator stops after it.
* `<log_dir>/task_pids.json` (`PIDS_FILE`): {task: pid}, for the stall
  doctor in the chief.
* `<log_dir>/launcher.json` (`LAUNCHER_FILE`): the running launcher's pid;
  `request_scale` leaves its request in `<log_dir>/scale.json`
  (`SCALE_FILE`) for that launcher (`tf-psx scale`).

The launcher's exit status is the chief's, `128 + N` when the chief died of
signal N (`exit_code`), `EXIT_GAVE_UP` when it gave up on a task.

Importing this module does not import TensorFlow.

Example:

>>> exit_code(-9), exit_code(3)
(137, 3)
"""

from __future__ import annotations

import json
import os
from typing import Any

from tf_psx import _checks
from tf_psx.cluster import TF_CONFIG_ENV, ClusterConfig
from tf_psx.errors import LaunchError

__all__ = [
    "CHIEF_ATTEMPT_ENV",
    "LAUNCHER_FILE",
    "PIDS_FILE",
    "SCALE_FILE",
    "SNAPSHOT_DIR_ENV",
    "TRAINING_DONE_FILE",
    "request_scale",
    "snapshot_dir",
    "task_type",
]

# Environment variables the launcher hands the chief and the evaluator.
SNAPSHOT_DIR_ENV = "TF_PSX_SNAPSHOT_DIR"
CHIEF_ATTEMPT_ENV = "TF_PSX_CHIEF_ATTEMPT"
# Written into the snapshot directory once the chief has exited with status 0.
TRAINING_DONE_FILE = "TRAINING_DONE"
# {task: pid} of every task, in LOG_DIR, for the stall doctor in the chief (tf_psx.training.stalls).
PIDS_FILE = "task_pids.json"
# The running launcher's pid, in LOG_DIR, and the request `tf-psx scale` leaves there.
LAUNCHER_FILE = "launcher.json"
SCALE_FILE = "scale.json"
# The most workers a rescale may ask for (each takes a loopback port and a process).
MAX_WORKERS = 256

# Shells report death by signal N as exit status 128 + N; so does the launcher.
SIGNAL_EXIT_BASE = 128
# The exit status when the launcher gives up on a task or cannot start one.
EXIT_GAVE_UP = 1
EXIT_USAGE = 2


def task_type() -> str | None:
    """The task type of this process from TF_CONFIG ("chief", "evaluator", ...), or None.

    Example:

    >>> import os
    >>> os.environ.pop("TF_CONFIG", None) and None
    >>> print(task_type())
    None
    """
    raw = os.environ.get(TF_CONFIG_ENV, "")
    if not raw:
        return None
    return ClusterConfig.from_tf_config(raw).task_type


def snapshot_dir(default: str | None = None) -> str | None:
    """The snapshot directory the launcher chose (`$TF_PSX_SNAPSHOT_DIR`), else `default`.

    Example:

    >>> snapshot_dir("/tmp/snaps") if SNAPSHOT_DIR_ENV not in os.environ else "/tmp/snaps"
    '/tmp/snaps'
    """
    return os.environ.get(SNAPSHOT_DIR_ENV) or default


def exit_code(code: int) -> int:
    """A Popen return code as a shell exit status (death by signal N -> 128 + N)."""
    return SIGNAL_EXIT_BASE - code if code < 0 else code


def write_json(path: str, value) -> None:
    """Writes `path` whole or not at all (a reader never sees half a file)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(value, handle)
    os.replace(temporary, path)


def request_scale(log_dir: str, workers: Any) -> int:
    """Asks the `tf-psx launch` running with `log_dir` to rescale to `workers`; returns the launcher's pid.

    Raises:
      LaunchError: a bad count, or no launcher running with that log directory.
    """
    _checks.int_at_least(workers, 1, "Option `--workers`", error=LaunchError,
                         fix="pass e.g. --workers 2 (a job needs at least one worker)")
    if workers > MAX_WORKERS:
        raise LaunchError(f"Option `--workers` must be at most {MAX_WORKERS} (one loopback port and process each). "
                          f"Received: {workers}. Fix: pass a smaller count.")
    path = os.path.join(str(log_dir), LAUNCHER_FILE)
    try:
        with open(path, encoding="utf-8") as handle:
            pid = int(json.load(handle)["pid"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError) as err:
        raise LaunchError(
            f"No running tf-psx launch has the log directory {log_dir!r} ({path}: {err}). Fix: pass the LOG_DIR "
            "the launcher printed in its \"cluster:\" line."
        ) from None
    write_json(os.path.join(str(log_dir), SCALE_FILE), {"workers": int(workers)})
    return pid

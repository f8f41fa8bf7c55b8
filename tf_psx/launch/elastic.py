"""Elastic rescale of a running `tf-psx launch` job: `tf-psx scale LOG_DIR --workers N`.

`request_scale` (tf_psx.launch.contract) leaves the request in
`LOG_DIR/scale.json`; the launcher's supervision loop takes it with
`_scale_request` and carries it out with `_rescale`. TF2's
`ClusterCoordinator` has a fixed worker list, so a rescale restarts the chief
with the new TF_CONFIG; it resumes from the newest snapshot.

`RescaleMixin` is a part of `Launcher` (tf_psx.launch.launcher), kept apart
because it is one concept: it uses the launcher's tasks (`_tasks`,
`_servers`, `_add_task`, `_spawn`, `_start_and_wait`, `_stop`), its cluster
(`config`, `num_workers`, thread counts) and its messages (`_say`).
Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import json
import os
import sys

from tf_psx import _checks
from tf_psx.cluster import TF_CONFIG_ENV, ClusterConfig
from tf_psx.cluster import server as _server, supervisor as _supervisor
from tf_psx.cluster.ports import LOOPBACK, free_ports
from tf_psx.launch.contract import CHIEF_ATTEMPT_ENV, LAUNCHER_FILE, MAX_WORKERS, SCALE_FILE, write_json


class RescaleMixin:
    """The rescale of `Launcher`: takes a `tf-psx scale` request and restarts the chief with N workers."""

    # pylint: disable=no-member  (the attributes and methods are Launcher's)

    def _scale_request(self) -> int | None:
        """The worker count `tf-psx scale` asked for (the request is consumed), or None."""
        path = os.path.join(self.log_dir, SCALE_FILE)
        if not os.path.exists(path):
            return None
        try:
            with open(path, encoding="utf-8") as handle:
                wanted = json.load(handle)["workers"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            self._say(f"error: ignoring the scale request {path}: {err}")
            wanted = None
        try:
            os.remove(path)
        except OSError:
            pass
        if wanted is None or not _checks.is_int_at_least(wanted, 1) or wanted > MAX_WORKERS:
            self._say(f"error: ignoring the scale request for {wanted!r} workers: it must be an int in 1..{MAX_WORKERS}")
            return None
        return None if wanted == self.num_workers else int(wanted)

    def _rescale(self, wanted: int, chief: _supervisor.TaskProcess) -> int | None:
        """Restarts the chief with `wanted` workers; it resumes from the newest snapshot.

        TF2's ClusterCoordinator has a fixed worker list, so the chief stops
        (steps since the newest snapshot are trained again) and starts again
        with the new TF_CONFIG. The ps tasks and the workers that stay keep
        running: a new coordinator opens its own context on them and makes
        its variables anew, restored from the snapshot. Only removed workers
        stop and only added ones start. Returns an exit status to give up
        with, or None.
        """
        before = self.num_workers
        self._say(f"scaling from {before} to {wanted} workers: restarting the chief, which resumes from the newest "
                  f"snapshot in {self.snapshot_dir}; the ps tasks and {min(before, wanted)} workers keep running")
        self._stop([chief])
        removed = [self._tasks.pop(("worker", index)) for index in range(wanted, before)]
        self._stop(removed)
        workers = list(self.config.workers[:wanted])
        if wanted > before:
            workers += [f"{LOOPBACK}:{port}" for port in free_ports(wanted - before)]
        self.num_workers = wanted
        self.config = ClusterConfig(workers=workers, ps=self.config.ps, chief=self.config.chief,
                                    evaluator=self.config.evaluator)
        server_argv = [sys.executable, "-m", "tf_psx.server"]
        base = dict(self._tasks[("ps", 0)].env)
        for index in range(before, wanted):
            self._add_task("worker", index, server_argv, dict(base))
        if self._intra_auto:
            self.intra_op_threads = self._auto_threads()
        # A task restarted later (a crash) comes back in the new cluster with the new thread counts;
        # the running ones keep theirs.
        for task in self._tasks.values():
            task.env[TF_CONFIG_ENV] = self.config.to_json(task.task_type, task.index)
        for task in self._servers():
            task.env.update(_server.thread_env(self.intra_op_threads, self.inter_op_threads))
        self._say(f"cluster: {self._address_list()}; logs in {self.log_dir}")
        added = [self._tasks[("worker", index)] for index in range(before, wanted)]
        code = self._start_and_wait(added, "exited while rescaling")
        if code is not None:
            return code
        if self._signal is not None:
            return self._on_signal(chief)
        chief.env[CHIEF_ATTEMPT_ENV] = str(int(chief.env.get(CHIEF_ATTEMPT_ENV, "0")) + 1)
        self._spawn(chief)
        write_json(os.path.join(self.log_dir, LAUNCHER_FILE), {"pid": os.getpid(), "workers": wanted})
        self._say(f"scaled to {wanted} workers")
        return None

"""Runs `tf-psx launch` in a subprocess and follows its output (for the process-tier tests).

Not a test module: tests/launch/test_launch.py, tests/launch/test_chaos.py and
tests/cluster/test_multihost.py import it.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "scripts")
# A launch imports TF in every task and traces the first fit step (~20 s on
# 2 cores); a restarted chief does both again.
WAIT_TIMEOUT_S = 240.0
RUN_TIMEOUT_S = 420.0
# How long a stopped launcher may take to stop its tasks (STOP_GRACE_S + slack).
STOP_TIMEOUT_S = 30.0

READY_RE = re.compile(r"^\[(?P<task>\w+:\d+)\] tf_psx.server ready \S+ pid=(?P<pid>\d+)")
STEP_RE = re.compile(r"^\[chief:0\] tf_psx train step=(?P<step>\d+)")
CLUSTER_RE = re.compile(r"^tf-psx launch: cluster: (?P<tasks>.*); logs in (?P<log_dir>\S+)")


class LaunchRun:
    """One `tf-psx launch` subprocess whose output lines are collected as they come."""

    def __init__(self, launch_args, command, env=None, prefix=()):
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env["PYTHONUNBUFFERED"] = "1"
        argv = [*prefix, sys.executable, "-m", "tf_psx.cli", "launch", *launch_args, "--", *command]
        self.proc = subprocess.Popen(  # pylint: disable=consider-using-with
            argv,
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern, timeout=WAIT_TIMEOUT_S, start=0, predicate=None):
        """Waits for an output line (from line `start` on) matching `pattern`; returns (index, match)."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        index = start
        with self._changed:
            while True:
                while index < len(self.lines):
                    match = regex.search(self.lines[index])
                    if match and (predicate is None or predicate(match)):
                        return index, match
                    index += 1
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(
                        f"launcher exited ({self.proc.returncode}) before a line matched {regex.pattern!r}:\n"
                        + self._tail()
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no line matched {regex.pattern!r} within {timeout} s:\n" + self._tail())
                self._changed.wait(min(left, 1.0))

    def _tail(self, count=60):
        return "\n".join(self.lines[-count:])

    def pids(self) -> dict[str, int]:
        """The newest pid of every server task (from its ready line)."""
        found = {}
        for line in list(self.lines):
            match = READY_RE.match(line)
            if match:
                found[match["task"]] = int(match["pid"])
        return found

    def ports(self) -> dict[str, int]:
        """task -> port, from the launcher's "cluster:" line."""
        _, match = self.wait_for(CLUSTER_RE)
        result = {}
        for part in match["tasks"].split(", "):
            task, address = part.split(" ")
            result[task] = int(address.rsplit(":", 1)[1])
        return result

    def wait(self, timeout=RUN_TIMEOUT_S) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"launcher still running after {timeout} s:\n" + self._tail()) from None
        self._reader.join(timeout=STOP_TIMEOUT_S)
        return code

    def signal(self, signum):
        self.proc.send_signal(signum)

    def stop(self):
        """Stops the launcher (and so its tasks) by its pid; SIGKILL if it does not stop."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(timeout=STOP_TIMEOUT_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def crash_under_launch(log_dir: str, seed: int, workers: int, kills: int, more: tuple = (),
                       batches: int = 8000) -> tuple[list, dict]:
    """One crash trial of tests/scripts/exact_crash.py as the chief of `tf-psx launch`; returns (kills, RESULT).

    Workers are killed with SIGKILL through the launcher's pids at seeded
    random moments of the fit, one down at a time: each kill waits for the
    launcher's restart and the restarted worker's "ready". `more`: more
    arguments of exact_crash.py (such as "--sync"); `batches` is rounded
    down to a multiple of the workers.
    """
    rng = random.Random(seed)
    batches -= batches % workers
    crash = [sys.executable, os.path.join(SCRIPTS, "exact_crash.py"), "--launched", "--workers", str(workers),
             "--batches", str(batches), *more]
    killed = []
    with LaunchRun(["--workers", str(workers), "--ps", "2", "--max-restarts", str(kills), "--log-dir", log_dir],
                   crash) as run:
        index, _ = run.wait_for(r"^\[chief:0\] tf_psx crash fit started")
        for _ in range(kills):
            if any(line.startswith("[chief:0] RESULT ") for line in run.lines):
                break  # the fit ended first
            victim = f"worker:{rng.randrange(workers)}"
            pid = run.pids()[victim]
            os.kill(pid, signal.SIGKILL)
            killed.append((victim, pid))
            index, _ = run.wait_for(rf"^tf-psx launch: {victim} exited with status -9 \(killed by SIGKILL\); restarting it",
                                    start=index)
            index, _ = run.wait_for(rf"^\[{victim}\] tf_psx.server ready", start=index)
            time.sleep(rng.uniform(0.3, 2.0))
        code = run.wait()
    if code != 0:
        raise AssertionError(f"the crash trial's launch exited with {code}:\n" + run.output[-5000:])
    _, match = run.wait_for(r"^\[chief:0\] RESULT (?P<json>\{.*\})$", timeout=1)
    return killed, json.loads(match["json"])

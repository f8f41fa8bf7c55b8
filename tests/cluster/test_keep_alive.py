"""A coordinator that is gone leaves nothing on the ps beyond tf_psx's keep-alive.

`tf-psx scale` restarts the chief and keeps the ps running; each chief makes
its variables anew on it. A chief that stops or crashes never closes its
context, so the ps frees its variables only when the context expires: after
TF's 600 s by default, after `KEEP_ALIVE_S` (or $TF_PSX_KEEP_ALIVE_S) under
tf_psx. Two departed chiefs with TF's 600 s add a table each (the control,
which shows that the measurement sees a table that stays); then three with a
3 s keep-alive: the last two grow the ps by less than the two tables they
would have left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tf_psx.cluster import server
from tf_psx._tf import runtime
from tf_psx.cluster import ClusterConfig
from tf_psx.cluster.ports import free_ports
from tf_psx.strategies import keep_alive_seconds

from conftest import REPO

pytestmark = pytest.mark.processes

TABLE_MB = 128  # tests/scripts/leave_a_table.py
SHORT_S = 3
READY_TIMEOUT_S = 120
CHIEF_TIMEOUT_S = 180


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="utf-8") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:")) / 1024


def _chief(config: ClusterConfig, keep_alive_s: int) -> None:
    done = subprocess.run([sys.executable, os.path.join(REPO, "tests", "scripts", "leave_a_table.py")],
                          env=dict(os.environ, TF_CONFIG=config.to_json("chief", 0),
                                   TF_PSX_KEEP_ALIVE_S=str(keep_alive_s)),
                          capture_output=True, text=True, timeout=CHIEF_TIMEOUT_S, check=False)
    assert done.returncode == 0 and "made 0.0" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the ps's memory from /proc")
def test_a_departed_coordinators_table_is_freed_after_the_keep_alive(tmp_path):
    addresses = [f"127.0.0.1:{port}" for port in free_ports(3)]
    config = ClusterConfig(workers=[addresses[0]], ps=[addresses[1]], chief=addresses[2])
    servers = []
    try:
        for task in ("ps", "worker"):
            log = open(tmp_path / f"{task}.log", "wb")  # pylint: disable=consider-using-with
            servers.append(subprocess.Popen([sys.executable, "-m", "tf_psx.server"], stdout=log,  # pylint: disable=consider-using-with
                                            stderr=subprocess.STDOUT, env=dict(os.environ, TF_CONFIG=config.to_json(task, 0))))
        deadline = time.monotonic() + READY_TIMEOUT_S
        for task in ("ps", "worker"):
            while server.READY_MARK not in (tmp_path / f"{task}.log").read_text(errors="replace"):
                assert time.monotonic() < deadline and all(p.poll() is None for p in servers), task
                time.sleep(0.2)
        ps_pid = servers[0].pid
        rss = [_rss_mb(ps_pid)]
        # The control first, on a ps that has freed nothing yet (its allocator keeps freed
        # pages and hands them out again): with TF's default each departed chief's table stays.
        for _ in range(2):
            _chief(config, 600)
            rss.append(_rss_mb(ps_pid))
        assert rss[2] - rss[0] > 1.5 * TABLE_MB, rss
        for _ in range(3):
            _chief(config, SHORT_S)
            time.sleep(2 * SHORT_S)  # past the expiry, and a GC pass of the ps (every second)
            rss.append(_rss_mb(ps_pid))
        # Each short-lived table is gone before the next chief comes. Kept, the last two would
        # add two tables (256 MB); freed, the allocator hands most of the pages out again
        # (measured growth for the two: 0 to 115 MB). The bound sits between.
        assert rss[5] - rss[3] < 1.5 * TABLE_MB, rss
        (tmp_path / "rss.json").write_text(json.dumps(rss))
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()


def test_the_keep_alive_default_and_its_override(monkeypatch):
    monkeypatch.delenv(runtime.KEEP_ALIVE_ENV, raising=False)
    assert keep_alive_seconds() == runtime.KEEP_ALIVE_S == 60
    monkeypatch.setenv(runtime.KEEP_ALIVE_ENV, "5")
    assert keep_alive_seconds() == 5
    for bad in ("0", "soon", "-3"):
        monkeypatch.setenv(runtime.KEEP_ALIVE_ENV, bad)
        with pytest.raises(ValueError, match=rf"The environment variable TF_PSX_KEEP_ALIVE_S must be an int >= 1. "
                                             rf"Received: '{bad}'. Fix: unset it or set e.g. TF_PSX_KEEP_ALIVE_S=60"):
            keep_alive_seconds()

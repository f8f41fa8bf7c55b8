"""Shared fixtures: one in-process cluster for the whole test session.

Test tiers (STYLE.md): unit tests need no fixture; tests that take
`ps_strategy` share one in-process cluster; tests marked `processes` start
real task processes.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tf_psx  # noqa: E402  (sets TF_USE_LEGACY_KERAS before tf.keras loads)

# The session cluster: 1 worker so that steps run in order and results can be
# compared with a single process; 2 ps so that tables really are split.
SESSION_WORKERS = 1
SESSION_PS = 2
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A chief subprocess imports TF, starts tasks and traces fit: minutes on 2 cores.
SCRIPT_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def local_cluster():
    with tf_psx.LocalCluster(num_workers=SESSION_WORKERS, num_ps=SESSION_PS) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def ps_strategy(local_cluster):
    return tf_psx.ParameterServerStrategy(local_cluster, partitioner="fixed:2")


def run_script(name: str, *args: str, env: dict | None = None, timeout: float = SCRIPT_TIMEOUT_S):
    """Runs tests/scripts/<name> in a fresh Python; returns the CompletedProcess.

    Scripts that connect to their own cluster must run in their own process:
    a TF process connects to one cluster.
    """
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "scripts", name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
        check=False,
    )


# Fixtures that put a test in the cluster tier.
CLUSTER_FIXTURES = ("ps_strategy", "local_cluster")


@pytest.fixture(scope="session", autouse=True)
def _cluster_first(request):
    """Connects to the session cluster before any test builds a model.

    A process that made TFRA tables before connecting cannot use a cluster
    afterwards (tf_psx.LocalResourcesError), so the connection comes first.
    A run of the unit tier alone (`-m unit`, `make test-fast`) starts no
    cluster at all.
    """
    if "unit" in (request.config.getoption("-m") or ""):
        return None
    return request.getfixturevalue("ps_strategy")


def _needs_cluster(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    seen, todo = set(), [name for name in info.argnames]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for fixturedef in info.name2fixturedefs.get(name, ()):
            todo.extend(fixturedef.argnames)
    return any(name in seen for name in CLUSTER_FIXTURES)


# A test whose body contains one of these starts a cluster or a TF process of
# its own (a script, an example, a LocalCluster): not the unit tier.
OWN_CLUSTER_TOKENS = ("run_script(", "LocalCluster(", "_run_example(", "sys.executable")


def _starts_its_own_cluster(item) -> bool:
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        return True
    return any(token in source for token in OWN_CLUSTER_TOKENS)


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
    """Marks the unit tier: no session cluster, no cluster or TF process of its own.

    Doctests stay out of it: some build TFRA tables, which must come after
    the cluster connection in a process that also runs cluster tests.
    """
    for item in items:
        if (isinstance(item, pytest.DoctestItem) or item.get_closest_marker("processes")
                or _needs_cluster(item) or _starts_its_own_cluster(item)):
            continue
        item.add_marker(pytest.mark.unit)


# The Criteo files of the tests are generated (tf_psx.data.write_criteo_sample),
# never read from outside the repository; as many rows as DeepCTR's real
# sample, so that the batch arithmetic in the tests reads the same.
CRITEO_ROWS = 200
CRITEO_SEED = 0


@pytest.fixture(scope="session")
def criteo_sample(tmp_path_factory):
    """The same generated Criteo rows in both layouts: {"tsv": CriteoSample, "csv": CriteoSample}."""
    from tf_psx.data import write_criteo_sample  # pylint: disable=import-outside-toplevel

    directory = tmp_path_factory.mktemp("criteo")
    return {
        layout: write_criteo_sample(directory / f"sample.{layout}", CRITEO_ROWS, layout=layout, seed=CRITEO_SEED)
        for layout in ("tsv", "csv")
    }


@pytest.fixture
def run(capsys):
    """Runs `tf-psx ARGV` in-process; returns (exit status, stdout, stderr)."""
    from tf_psx import cli  # pylint: disable=import-outside-toplevel

    def _run(*argv: str) -> tuple[int, str, str]:
        status = cli.main(list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return _run

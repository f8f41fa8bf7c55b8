"""Shared fixtures and the test tiers: one in-process cluster for the whole session.

Test tiers (STYLE.md, "A test"): each test file declares one with
`pytestmark`. `unit` tests take no cluster fixture and start no process;
`cluster` tests take `ps_strategy` (or `local_cluster`) and share one
in-process cluster; `processes` tests start processes of their own (task
processes, a script, a fresh Python). tests/README.md says which folder
holds what.
"""

from __future__ import annotations

import json
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
# tests/ (this folder: its helpers import as `from conftest import ...`) and the repository.
TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)


def load_module(name: str, *path: str):
    """The Python file at REPO/`path` loaded as module `name` (scripts and pages that are not packages)."""
    import importlib.util  # pylint: disable=import-outside-toplevel

    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
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
    full_env.setdefault("PYTHONFAULTHANDLER", "1")  # a native crash prints the Python stack it happened in
    full_env.update(env or {})
    for attempt in (1, 2):
        result = subprocess.run(
            [sys.executable, os.path.join(TESTS, "scripts", name), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=REPO,
            check=False,
        )
        if attempt == 1 and died_importing(result):
            # A native crash inside `import tensorflow` (one SIGSEGV in a CI
            # run, before any tf_psx code ran) says nothing of the script:
            # it is run again once, and the test's output says so.
            print(f"run_script: {name} crashed while importing (signal {-result.returncode}); "
                  f"running it once more. Its stderr ended:\n{result.stderr[-2000:]}")
            continue
        return result
    return result


def died_importing(result) -> bool:
    """Whether a child run by `run_script` was killed by a signal inside an import (its faulthandler stack says so).

    Only a crash whose innermost Python frames are the import machinery
    counts: a crash in a script's own code, or one with no stack printed,
    fails the test as before.
    """
    if result.returncode >= 0 or "RESULT " in result.stdout:
        return False
    _, found, rest = result.stderr.partition("Current thread ")
    if not found:
        return False
    stack = rest.split("\n\n", 1)[0].splitlines()[1:]
    return any("<frozen importlib._bootstrap>" in line for line in stack)


def script_results(result) -> list[dict]:
    """The `RESULT {json}` lines of a script run by `run_script`, parsed; fails the test when it exited non-zero."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line[len("RESULT "):]) for line in result.stdout.splitlines() if line.startswith("RESULT ")]


# The tiers (STYLE.md, "A test"). Each test file declares the tier of most of
# its tests with `pytestmark = pytest.mark.<tier>`; a test of another tier
# says so with its own `@pytest.mark.<tier>`.
TIERS = ("unit", "cluster", "processes")
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


def _declared_tier(item) -> str | None:
    """The closest tier mark: a pytest.param's, the test's, its class's, its file's."""
    for node in item.iter_parents():
        marks = node.own_markers
        if node is item and getattr(item, "callspec", None) is not None:
            marks = [m for m in item.callspec.marks if m.name in TIERS] or marks
        tiers = sorted({m.name for m in marks if m.name in TIERS})
        if len(tiers) > 1:
            raise ValueError(f"marked with two tiers at one level: {', '.join(tiers)}")
        if tiers:
            return tiers[0]
    return None


def _tier_problem(item) -> str | None:
    """What is wrong with the tier of a test, or None."""
    try:
        tier = _declared_tier(item)
    except ValueError as error:
        return f"{item.name}: {error}"
    if tier is None:
        return f"{item.name}: no tier; give the file `pytestmark = pytest.mark.unit` (or cluster, or processes)"
    if tier == "unit" and _needs_cluster(item):
        return f"{item.name}: marked unit but takes a cluster fixture ({' or '.join(CLUSTER_FIXTURES)}); mark it cluster"
    if tier == "cluster" and not _needs_cluster(item):
        return f"{item.name}: marked cluster but takes no cluster fixture; mark it unit or processes"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    """Fails the collection of a test file whose tests do not declare a tier that can be right.

    A test has no tier, or is `unit` but takes a cluster fixture, or is
    `cluster` but takes none: the file is a collection error (also under
    xdist), so a wrong or missing mark cannot slip in.
    """
    report = yield
    if report.passed and isinstance(collector, (pytest.Module, pytest.Class)):
        items = [item for item in report.result if isinstance(item, pytest.Function)]
        problems = [problem for item in items for problem in (_tier_problem(item), _stack_problem(item)) if problem]
        if problems:
            report.outcome = "failed"
            report.longrepr = 'test tiers (STYLE.md, "A test"):\n  ' + "\n  ".join(problems)
    return report


# The stack marks: a test that needs TFRA runs on the TFRA stack only, one that needs it absent on the newest.
STACK_MARKS = ("tfra", "no_tfra")


def _tfra_installed() -> bool:
    from tf_psx._tf.tfra import tfra_installed  # pylint: disable=import-outside-toplevel

    return tfra_installed()


def tfra_param(*values, **kwargs):
    """A parametrize case that needs TFRA (a DynamicEmbedding case): marked `tfra`, so it runs on the TFRA stack."""
    return pytest.param(*values, marks=pytest.mark.tfra, **kwargs)


def layers_here(*layers: str) -> tuple:
    """`layers` (names a test script takes) without "dynamic" where TFRA is absent: DynamicEmbedding on TFRA's
    tables needs it ("native", DynamicEmbedding on tf_psx's own tables, runs on both stacks)."""
    return tuple(layer for layer in layers if layer != "dynamic" or _tfra_installed())


def _stack_problem(item) -> str | None:
    """A test marked so that it would skip on both stacks, or None."""
    marks = {mark.name for mark in item.iter_markers() if mark.name in STACK_MARKS}
    if len(marks) > 1:
        return (f"{item.name}: marked both `tfra` and `no_tfra`, so it would skip on both stacks "
                f"(README, \"Install\"); keep the one it needs")
    return None


# Modules whose doctests build TFRA tables (the lifecycle of TFRA's store): marked `tfra`.
TFRA_DOCTEST_MODULES = ("tf_psx.tables.lifecycle",)


def _skip_for_stack(item) -> None:
    """Skips a test of the other stack, with the reason."""
    installed = _tfra_installed()
    if isinstance(item, pytest.DoctestItem) and item.name.startswith(TFRA_DOCTEST_MODULES):
        item.add_marker(pytest.mark.tfra)
    if item.get_closest_marker("tfra") is not None and not installed:
        item.add_marker(pytest.mark.skip(reason="needs tensorflow-recommenders-addons: the TFRA stack "
                                                "(make test-tfra) runs it"))
    if item.get_closest_marker("no_tfra") is not None and installed:
        item.add_marker(pytest.mark.skip(reason="needs TFRA absent: the newest stack (make test) runs it"))


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
    """Gives each test exactly the one tier it declares, and skips the tests of the other stack.

    A test's tier is its closest tier mark; the farther ones (its file's) are
    dropped, so that `-m unit` sees only the test's own. Doctests have no
    tier and stay out of the unit tier: some build TFRA tables, which must
    come after the cluster connection in a process that also runs cluster
    tests.
    """
    tiers = {}
    for item in items:
        if not isinstance(item, pytest.DoctestItem):
            try:
                tiers[item] = _declared_tier(item)
            except ValueError:  # reported by pytest_make_collect_report
                tiers[item] = None
    for item, tier in tiers.items():
        for node in item.iter_parents():
            node.own_markers[:] = [m for m in node.own_markers if m.name not in TIERS]
        if tier is not None:
            item.add_marker(tier)
    for item in items:  # doctests too: some build TFRA tables
        _skip_for_stack(item)


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

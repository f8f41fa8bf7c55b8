"""The docs site builds in strict mode, and the code in the docs runs.

Python: each code block runs alone, in a fresh process in an empty
directory, as a reader who copies one block runs it: a block never depends
on an earlier one. A block whose code starts a cluster is marked
`processes`, like the examples.

Shell: every command of a ```bash, ```sh, ```shell or ```console block of
README.md and docs/ runs in an empty directory with the venv first on PATH,
and its output is checked (`SHELL_CHECKS`), unless it needs what a test
machine lacks: those are `SHELL_EXCEPTIONS`, each with the reason. In a
```console block, `$ ` starts a command and the lines under it are output it
must print, in that order (other lines may come between): `...` in a line
matches any text, a number of 4 or more digits (a port, a pid) any number,
and a line that is only `...` stands for the lines left out. Output that a
page shows without its command (what a python block printed) goes in
```text blocks.

Numbers: measured numbers in prose come from bench/results/*.json through
docs/benchmarks.md (bench/report.py); other pages link there.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from typing import Callable, Optional

import pytest
import yaml

from conftest import REPO, SCRIPT_TIMEOUT_S, load_module

pytestmark = pytest.mark.unit

DOCS = os.path.join(REPO, "docs")
PAGES = sorted(glob.glob(os.path.join(DOCS, "*.md")) + glob.glob(os.path.join(DOCS, "guides", "*.md")))
_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# Code that connects to a cluster (in-process servers in the page's process).
_NEEDS_CLUSTER = re.compile(r"LocalCluster\(|ParameterServerStrategy\(")
# The pages the issue asks for; mkdocs.yml must list each one.
REQUIRED_PAGES = [
    "index.md", "concepts.md", "guides/partitioning.md", "guides/staleness.md", "guides/fault_tolerance.md",
    "guides/kubernetes.md", "guides/monitoring.md", "security.md", "benchmarks.md", "api.md",
]


def _blocks(page: str) -> list[str]:
    with open(page, encoding="utf-8") as handle:
        return _PYTHON_BLOCK.findall(handle.read())


# A block that needs TFRA: a TFRA table read directly (`.table`), asked for (`table="tfra"`), or TFRA itself. A
# DynamicEmbedding runs on tf_psx's own tables anywhere, its policies included.
_NEEDS_TFRA = re.compile(r"tensorflow_recommenders_addons|\.table\b|table=\"tfra\"")


def _block_params():
    """One test per python block: a reader copies one block, so each must run alone."""
    params = []
    for page in PAGES:
        for index, block in enumerate(_blocks(page)):
            marks = [pytest.mark.processes] if _NEEDS_CLUSTER.search(block) else []
            if _NEEDS_TFRA.search(block):
                marks.append(pytest.mark.tfra)  # a block of TFRA's tables: the TFRA stack
            params.append(pytest.param(page, index, id=f"{os.path.relpath(page, DOCS)}#{index}", marks=marks))
    return params


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(_nav_pages(value) if isinstance(value, list) else [value])
    return pages


def _config() -> dict:
    with open(os.path.join(REPO, "mkdocs.yml"), encoding="utf-8") as handle:
        return yaml.safe_load(handle)


def test_nav_lists_every_required_page_and_every_page_exists():
    config = _config()
    nav = _nav_pages(config["nav"])
    assert config["strict"] is True
    assert sorted(set(REQUIRED_PAGES) - set(nav)) == []
    missing = [page for page in nav if not os.path.exists(os.path.join(DOCS, page))]
    assert missing == []
    on_disk = sorted(os.path.relpath(p, DOCS) for p in PAGES)
    assert sorted(set(on_disk) - set(nav)) == []  # no page the reader cannot reach


@pytest.mark.processes
def test_docs_build_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True, text=True, cwd=REPO, timeout=SCRIPT_TIMEOUT_S, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for page in _nav_pages(_config()["nav"]):
        html = site / (page[: -len(".md")] + "/index.html" if page != "index.md" else "index.html")
        assert html.exists(), html
    api = (site / "api" / "index.html").read_text(encoding="utf-8")
    # Rendered from the docstrings, doctests as code (not as Markdown quotes).
    for name in ("tf_psx.strategies.ParameterServerStrategy", "tf_psx.export.export_serving",
                 "tf_psx.layers.DynamicEmbedding", "tf_psx.data.criteo.criteo"):
        assert f'id="{name}"' in api, name
    assert "language-pycon" in api
    assert "&gt;&gt;&gt;" not in re.sub(r"<code.*?</code>", "", api, flags=re.S)


def test_griffe_extension_fences_doctests_only_outside_fences():
    module = load_module("griffe_extensions", "docs", "griffe_extensions.py")
    text = "Example:\n\n>>> f([1])\n[4, 8]\n\nAfter.\n\n```python\n>>> kept\n```"
    assert module.fence_doctests(text) == (
        "Example:\n\n```pycon\n>>> f([1])\n[4, 8]\n```\n\nAfter.\n\n```python\n>>> kept\n```"
    )


def test_every_page_with_code_has_its_code_tested():
    # The guides must show code; a page that loses its blocks stops being tested.
    with_code = {os.path.relpath(p, DOCS) for p in PAGES if _blocks(p)}
    assert {"index.md", "concepts.md", "guides/partitioning.md"} <= with_code


@pytest.mark.processes
@pytest.mark.parametrize("page,index", _block_params())
def test_each_python_block_runs_alone(page, index, tmp_path):
    code = _blocks(page)[index]
    script = tmp_path / "block.py"
    # In-process servers cannot be stopped (TF 2.16): leave without waiting on them.
    script.write_text(code + "\n\nimport os as _os, sys as _sys\n_sys.stdout.flush(); _sys.stderr.flush(); _os._exit(0)\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=SCRIPT_TIMEOUT_S, cwd=tmp_path, env=env, check=False)
    assert result.returncode == 0, f"{page} block {index}:\n" + result.stdout[-3000:] + result.stderr[-3000:]


# --- shell commands -------------------------------------------------------------

README = os.path.join(REPO, "README.md")
SHELL_PAGES = [README] + PAGES
_SHELL_BLOCK = re.compile(r"^```(bash|sh|shell|console)\n(.*?)^```", re.S | re.M)
# The slowest command (the fault-tolerance launch) takes ~20 s on 2 busy cores.
_COMMAND_TIMEOUT_S = 300
_PROMPT = "$ "


@dataclasses.dataclass
class _Command:
    page: str           # relative to the repository
    command: str        # continuation lines joined, a trailing "# comment" dropped
    expected: list      # the output lines a ```console block shows under it


def _join_continuations(lines: list[str]) -> list[str]:
    joined, current = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1].strip() + " "
        else:
            joined.append((current + line.strip()).strip())
            current = ""
    return joined


def _shell_commands(page: str) -> list[_Command]:
    with open(page, encoding="utf-8") as handle:
        text = handle.read()
    rel = os.path.relpath(page, REPO)
    commands = []
    for language, body in _SHELL_BLOCK.findall(text):
        lines = body.splitlines()
        if language != "console":
            for line in _join_continuations([line for line in lines if line.strip()]):
                commands.append(_Command(rel, re.sub(r"\s+#.*$", "", line), []))
            continue
        index = 0
        while index < len(lines):
            assert lines[index].startswith(_PROMPT), f"{rel}: a console block must start with '$ ': {lines[index]!r}"
            block = [lines[index][len(_PROMPT):]]
            while block[-1].rstrip().endswith("\\"):
                index += 1
                block.append(lines[index])
            index += 1
            output = []
            while index < len(lines) and not lines[index].startswith(_PROMPT):
                output.append(lines[index])
                index += 1
            commands.append(_Command(rel, _join_continuations(block)[0], [line for line in output if line.strip()]))
    return commands


def _all_shell_commands() -> list[_Command]:
    return [command for page in SHELL_PAGES for command in _shell_commands(page)]


def _line_pattern(line: str) -> re.Pattern:
    parts = re.split(r"(\.\.\.|\d{4,})", line.rstrip())
    return re.compile("".join(".*" if p == "..." else r"\d+" if p.isdigit() else re.escape(p) for p in parts))


def _assert_shows(expected: list[str], output: str, where: str) -> None:
    """Each expected line matches a whole output line, in order (see the module docstring)."""
    lines = [line.rstrip() for line in output.splitlines()]
    at = 0
    for want in expected:
        if want.strip() == "...":
            continue
        pattern = _line_pattern(want)
        while at < len(lines) and not pattern.fullmatch(lines[at]):
            at += 1
        assert at < len(lines), f"{where}: no output line (in order) matches {want!r}:\n{output[-4000:]}"
        at += 1


# Commands the docs show that this test does not run, and why.
SHELL_EXCEPTIONS = {
    "make demo": "first pip-installs into .venv (network); tests/test_examples.py runs examples/quickstart.py, "
                 "what it then trains with, and test_make_targets_run_what_the_docs_say checks that it does",
    "make test": "the whole suite (tens of minutes), which includes this test",
    "tf-psx launch --workers 2 --ps 1 -- python examples/quickstart.py":
        "tests/test_first_hours.py::test_quickstart_is_quiet_and_runs_under_the_launcher runs it (one epoch) and "
        "checks that the script trained on the launched cluster",
    "make install": "pip-installs the pinned stack into .venv from the package index (network)",
    "kubectl apply -f ctr.yaml": "needs a Kubernetes cluster with the Kubeflow training operator; "
                                 "tests/cluster/test_k8s.py validates the manifest against the TFJob v1 schema",
    "tensorboard --logdir /path/to/log_dir": "a server that runs until stopped, on a placeholder path; "
                                             "the page's python block checks what ClusterMonitor writes",
}


@dataclasses.dataclass
class _Check:
    """How a command of the docs is run and what its output must show.

    Attributes:
      check: called with (output, directory) once the command exited with `status`.
      setup: prepares the empty directory (the files the command reads).
      instead: a command run in place of the one shown; `why` says why.
      env: returns extra environment variables.
      status: the exit status the command must have.
      processes: it starts task processes (the `processes` mark).
    """

    check: Callable[[str, str], None]
    setup: Optional[Callable[[str], None]] = None
    instead: Optional[str] = None
    why: str = ""
    env: Callable[[], dict] = dict
    status: int = 0
    processes: bool = False


def _page_python_block(page: str, containing: str) -> str:
    blocks = [block for block in _blocks(os.path.join(DOCS, page)) if containing in block]
    assert len(blocks) == 1, f"{page}: one python block should contain {containing!r}"
    return blocks[0]


def _write_fault_tolerance_train_py(directory: str) -> None:
    # The script that the page's python block writes and launches.
    block = _page_python_block("guides/fault_tolerance.md", "TRAIN = textwrap.dedent(")
    train = re.search(r"TRAIN = textwrap\.dedent\('''(.*?)'''\)", block, re.S).group(1)
    with open(os.path.join(directory, "train.py"), "w", encoding="utf-8") as handle:
        handle.write(textwrap.dedent(train))


def _check_fault_tolerance_launch(output: str, directory: str) -> None:
    # Every step of fit ran (2 epochs x 50) on 2 workers and 1 ps, and no task was restarted.
    assert "[chief:0] done, iterations = 100" in output, output[-3000:]
    assert "restarting" not in output
    logs = os.path.join(directory, "logs")
    assert sorted(os.listdir(logs)) == ["chief-0.log", "launcher.json", "ps-0.log", "snapshots", "task_pids.json", "worker-0.log", "worker-1.log"]
    # PeriodicSync(20) wrote into the launcher's snapshot directory, the last one at step 100.
    steps = [int(name.rsplit("-", 1)[1]) for name in os.listdir(os.path.join(logs, "snapshots"))
             if re.fullmatch(r"snapshot-\d+", name)]
    assert steps and max(steps) == 100, steps


def _write_interfaces_train_py(directory: str) -> None:
    # Any chief script works; this one prints the network interfaces of its
    # namespace (/proc/net/dev: a header of 2 lines, then "name: counters").
    with open(os.path.join(directory, "train.py"), "w", encoding="utf-8") as handle:
        handle.write("with open('/proc/net/dev') as f:\n"
                     "    print('interfaces:', sorted(line.split(':')[0].strip() for line in f.readlines()[2:]))\n")


def _check_isolated_launch(output: str, directory: str) -> None:
    # Inside the namespace the chief sees only its own loopback, and no warning is printed.
    assert "[chief:0] interfaces: ['lo']" in output, output[-3000:]
    assert "warning" not in output


def _check_k8s_manifest(output: str, directory: str) -> None:
    with open(os.path.join(directory, "ctr.yaml"), encoding="utf-8") as handle:
        job = yaml.safe_load(handle)
    assert (job["apiVersion"], job["kind"], job["metadata"]["name"]) == ("kubeflow.org/v1", "TFJob", "ctr")
    specs = job["spec"]["tfReplicaSpecs"]
    assert {rtype: spec["replicas"] for rtype, spec in specs.items()} == {"Chief": 1, "Worker": 4, "PS": 2, "Evaluator": 1}
    for rtype, spec in specs.items():
        container = spec["template"]["spec"]["containers"][0]
        assert container["image"] == "registry.example.com/ctr:1"
        assert container["resources"]["limits"] == {"cpu": "4", "memory": "16Gi"}
        chief_command = ["python", "train.py", "--epochs", "10"]
        assert container["command"] == (["python", "-m", "tf_psx.server"] if rtype in ("Worker", "PS") else chief_command)


def _worker_0_tf_config() -> dict:
    from tf_psx.cluster.k8s import operator_tf_config  # pylint: disable=import-outside-toplevel

    return {"TF_CONFIG": json.dumps(operator_tf_config("ctr", "Worker", 0, workers=4, ps=2, evaluator=True))}


def _check_config_check(output: str, directory: str) -> None:
    assert output.strip() == "valid: 4 workers, 2 ps, chief, evaluator, task worker:0"


_IMBALANCE = re.compile(
    r"^placement ([^\n]+): \d+ batch\(es\)$.*?^imbalance \(max/mean\): unique rows (\S+), lookups (\S+)$", re.S | re.M
)
_BALANCED = "ShardedEmbedding(balance=True, dedup=True)"


def _imbalances(output: str) -> dict:
    return {name: (float(unique), float(lookups)) for name, unique, lookups in _IMBALANCE.findall(output)}


def _save_partitioning_ids(directory: str) -> None:
    # The page's python block that measures the ids also saves them as ids.npy.
    block = _page_python_block("guides/partitioning.md", 'np.save("ids.npy"')
    here = os.getcwd()
    os.chdir(directory)
    try:
        exec(compile(block, "partitioning.md", "exec"), {})  # pylint: disable=exec-used
    finally:
        os.chdir(here)


def _check_ids_report(output: str, directory: str) -> None:
    loads = _imbalances(output)
    assert sorted(loads) == [_BALANCED, "div", "mod"], output
    assert loads["div"][0] > 4  # as the page's python block finds for the same ids
    assert loads[_BALANCED][0] < 1.1
    assert "recommendation: use tf_psx.layers.ShardedEmbedding(" in output


# Rows of day_0.tsv: the real file has ~195M; rows of the same layout from
# tf_psx.data.write_criteo_sample's planted model stand in for it.
_DAY_0_ROWS = 5000


def _write_day_0(directory: str) -> None:
    from tf_psx.data import write_criteo_sample  # pylint: disable=import-outside-toplevel

    write_criteo_sample(os.path.join(directory, "day_0.tsv"), _DAY_0_ROWS, seed=0)


def _check_criteo_report(output: str, directory: str) -> None:
    assert f"\nday_0.tsv: {_DAY_0_ROWS} ids, 1000000 rows, 8 shards, batches of 4096\n" in "\n" + output, output
    assert sorted(_imbalances(output)) == [_BALANCED, "div", "mod"], output
    # ceil(5000 / 4096) = 2 batches per placement; each row's C3 is looked up once per placement.
    assert output.count(": 2 batch(es)") == 3
    lookups = [int(n) for n in re.findall(r"^\s+\d+\s+(\d+)\s+[\d.]+%", output, re.M)]
    assert len(lookups) == 3 * 8 and sum(lookups) == 3 * _DAY_0_ROWS, lookups
    assert re.search(r"^recommendation: ", output, re.M)


SHELL_CHECKS = {
    "tf-psx launch --workers 2 --ps 1 --max-restarts 2 --log-dir logs -- python train.py": _Check(
        _check_fault_tolerance_launch, setup=_write_fault_tolerance_train_py, processes=True),
    "tf-psx launch --isolate --workers 2 --ps 1 -- python train.py": _Check(
        _check_isolated_launch, setup=_write_interfaces_train_py, processes=True),
    "tf-psx k8s --name ctr --image registry.example.com/ctr:1 --workers 4 --ps 2 --evaluator --cpu 4 "
    "--memory 16Gi -o ctr.yaml -- python train.py --epochs 10": _Check(_check_k8s_manifest),
    "kubectl exec ctr-worker-0 -- tf-psx config --check": _Check(
        _check_config_check, instead="tf-psx config --check", env=_worker_0_tf_config,
        why="no Kubernetes here: runs the pod's command with the TF_CONFIG the operator gives ctr-worker-0"),
    "tf-psx shard-report ids.npy --shards 8 --batch-size 4096": _Check(_check_ids_report, setup=_save_partitioning_ids),
    "tf-psx shard-report day_0.tsv --column C3 --rows 1000000 --shards 8": _Check(
        _check_criteo_report, setup=_write_day_0),
}


def test_every_shell_command_in_the_docs_is_checked_or_excused():
    shown = {command.command for command in _all_shell_commands()}
    assert not set(SHELL_CHECKS) & set(SHELL_EXCEPTIONS)
    assert sorted(shown - set(SHELL_CHECKS) - set(SHELL_EXCEPTIONS)) == []  # a new command needs a check
    assert sorted((set(SHELL_CHECKS) | set(SHELL_EXCEPTIONS)) - shown) == []  # no entry for a command gone
    assert all(SHELL_EXCEPTIONS.values()) and all(check.why for check in SHELL_CHECKS.values() if check.instead)


def test_shell_blocks_are_parsed_into_commands_and_their_output():
    commands = {command.command: command for command in _all_shell_commands()}
    # A continued line is one command; the output under it belongs to it.
    k8s = next(command for command in commands.values() if command.command.startswith("tf-psx k8s"))
    assert k8s.page == os.path.join("docs", "guides", "kubernetes.md")
    assert k8s.command.endswith("--memory 16Gi -o ctr.yaml -- python train.py --epochs 10")
    assert k8s.expected == ["tf-psx k8s: wrote TFJob ctr (1 Chief, 4 Worker, 2 PS, 1 Evaluator) to ctr.yaml; "
                            "start it with: kubectl apply -f ctr.yaml"]
    assert commands["kubectl apply -f ctr.yaml"].expected == []
    readme = [command.command for command in _shell_commands(README)]
    # The README opens with the two set-up commands (their "# comment" dropped), then the launched quickstart.
    assert readme == ["make demo", "make test", "tf-psx launch --workers 2 --ps 1 -- python examples/quickstart.py"]
    # Ports and pids vary, "..." is any text, the order counts, the rest is exact.
    _assert_shows(["a 127.0.0.1:41537; logs in ...", "...", "done = 100"], "x\na 127.0.0.1:8080; logs in /t\ndone = 100\n", "t")
    for expected, output in ((["done = 100"], "done = 101"), (["b", "a"], "a\nb"), (["x 1"], "x 12")):
        with pytest.raises(AssertionError, match="no output line"):
            _assert_shows(expected, output, "t")


def _shell_params():
    params = []
    for command in _all_shell_commands():
        check = SHELL_CHECKS.get(command.command)
        if check is None:
            continue
        marks = [pytest.mark.processes] if check.processes else []
        label = f"{command.page}:{command.command.split(' -- ')[0][:60]}"
        params.append(pytest.param(command, check, id=label, marks=marks))
    return params


@pytest.mark.processes
@pytest.mark.parametrize("command, check", _shell_params())
def test_shell_command_runs_and_prints_what_the_docs_show(command, check, tmp_path):
    if "--isolate" in command.command and not sys.platform.startswith("linux"):
        pytest.skip("--isolate needs Linux network namespaces")
    directory = str(tmp_path)
    if check.setup:
        check.setup(directory)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=directory,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.update(check.env())
    # One stream, in the order the command wrote it (the launcher's own lines go to stderr).
    result = subprocess.run(["bash", "-c", check.instead or command.command], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=directory, env=env,
                            timeout=_COMMAND_TIMEOUT_S, check=False)
    output = result.stdout
    if "--isolate" in command.command and "could not create a private network namespace" in output:
        pytest.skip(output.strip().splitlines()[-1])
    where = f"{command.page}: {command.command}"
    assert result.returncode == check.status, f"{where}: exit status {result.returncode}\n{output[-4000:]}"
    _assert_shows(command.expected, output, where)
    check.check(output, directory)


# What each make target that the docs show must run (a dry run: nothing is executed).
MAKE_RECIPES = {
    "install": ["-m venv .venv", "pip install --quiet -c stacks/newest.txt -e '.[dev]'"],
    "demo": ["pip install --quiet -c stacks/newest.txt -e '.[dev]'", "examples/quickstart.py"],
    "test": ["pip install --quiet -c stacks/newest.txt -e '.[dev]'", "-m pytest"],
}


def test_make_targets_run_what_the_docs_say():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    targets = {command.command.split()[1] for command in _all_shell_commands() if command.command.startswith("make ")}
    assert targets == set(MAKE_RECIPES)
    for target, wants in MAKE_RECIPES.items():
        result = subprocess.run(["make", "-n", "-B", target], capture_output=True, text=True, cwd=REPO,
                                timeout=60, check=False)
        assert result.returncode == 0, result.stderr
        for want in wants:
            assert want in result.stdout, f"make {target}: {want!r} not in\n{result.stdout}"


# --- commands and numbers in the prose -----------------------------------------------

# `tf-psx ...` in backquotes, possibly across a line break.
_INLINE_TF_PSX = re.compile(r"`(tf-psx [^`]+)`")


def _prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_inline_tf_psx_commands_with_a_chief_command_parse():
    # `tf-psx launch -- python train.py` once stood in the docs (it exits 2:
    # --workers and --ps are required). A full command, one with `-- CMD`,
    # must be one the CLI accepts; names of subcommands and options
    # (`tf-psx launch --isolate`) are not commands.
    from tf_psx import cli  # pylint: disable=import-outside-toplevel

    found = []
    for page in SHELL_PAGES:
        with open(page, encoding="utf-8") as handle:
            spans = _INLINE_TF_PSX.findall(_prose(handle.read()))
        for span in spans:
            argv = shlex.split(" ".join(span.split()))[1:]
            if "--" not in argv:
                continue
            found.append(span)
            try:
                cli._build_parser().parse_args(argv)
            except SystemExit as exit_:
                pytest.fail(f"{os.path.relpath(page, REPO)}: `{span}` exits with status {exit_.code}")
    assert len(found) >= 2, found  # concepts.md and fault_tolerance.md show one each


# A measured ratio such as "26x" or "5 times" (not a shape such as "256 x 8").
_RATIO = re.compile(r"\b\d[\d,.]*(?:x\b|\s+times\b)")


def test_prose_quotes_no_measured_ratios_outside_the_benchmarks_page():
    # Copied numbers go stale: measured numbers live in docs/benchmarks.md,
    # generated from bench/results/*.json, and the pages link there.
    assert _RATIO.findall("26x and 31x slower, 5 times the mean, batch 256 x 8") == ["26x", "31x", "5 times"]
    texts = {}
    for page in SHELL_PAGES:
        if os.path.basename(page) != "benchmarks.md":
            with open(page, encoding="utf-8") as handle:
                texts[os.path.relpath(page, REPO)] = _prose(handle.read())
    import tf_psx.optimizers  # pylint: disable=import-outside-toplevel

    texts["tf_psx/optimizers.py docstring"] = tf_psx.optimizers.__doc__
    assert {name: _RATIO.findall(text) for name, text in texts.items() if _RATIO.findall(text)} == {}


def test_benchmarks_page_is_generated_from_the_results():
    report = load_module("bench_report", "bench", "report.py")
    results = os.path.join(REPO, "bench", "results")
    expected = report.render(report.records_in(results), report.records_in(os.path.join(results, report.OTHER_STACK)))
    with open(os.path.join(DOCS, "benchmarks.md"), encoding="utf-8") as handle:
        assert handle.read() == expected, "docs/benchmarks.md is stale: run python bench/report.py"
    # The pages link to the tables whose numbers they do not copy.
    for page, link in (("index.md", "benchmarks.md#vocab_scaling"),
                       ("guides/partitioning.md", "../benchmarks.md#vocab_scaling"),
                       ("guides/partitioning.md", "../benchmarks.md#shard_balance")):
        with open(os.path.join(DOCS, page), encoding="utf-8") as handle:
            assert f"]({link})" in handle.read(), (page, link)

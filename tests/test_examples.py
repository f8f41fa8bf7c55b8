"""The examples run end to end, and what they learn is measured against the data's optimum.

Each example runs in its own Python (it builds its own cluster) and prints,
as its last line, `RESULT {json}`: the dict its `main()` returns. The tests
read that dict, not the printed text.

The synthetic data (`tf_psx.data.synthetic_ctr`) comes from a planted
logistic model, so the best possible holdout AUC (the Bayes AUC, ~0.77 here)
and log loss are known, and so is the log loss of the best constant guess,
the click rate p: -p log p - (1-p) log(1-p) (~0.60 for p ~ 0.3). A model
that learned only the click rate has AUC 0.5 and that log loss; the bounds
below fail it by a wide margin and pass the real models with room for the
nondeterminism of asynchronous training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, SCRIPT_TIMEOUT_S, tfra_param

pytestmark = pytest.mark.processes

# Holdout AUC at most this far below the Bayes AUC. Measured on 2 cores (TF
# 2.16.2): quickstart (2400 steps) 0.045, central_storage and custom_loop
# (1200 steps) 0.058 and 0.056. A bias-only model is 0.27 below, and these
# examples after only 300 steps are 0.11-0.12 below.
MAX_AUC_GAP = 0.08
# Holdout log loss at least this far below the click rate's: measured 0.067,
# 0.071 and 0.059 below (Bayes is 0.10-0.12 below). A bias-only model is 0 below.
MIN_LOG_LOSS_GAIN = 0.04
# No model beats the planted one on 20,000 holdout examples but by noise.
NOISE = 0.01


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def _run_example(name: str, *args: str, timeout: float = SCRIPT_TIMEOUT_S) -> dict:
    result = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", name), *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return _result(result.stdout)


def _assert_learned_the_planted_model(result: dict) -> None:
    auc, bayes = result["auc"], result["bayes_auc"]
    assert bayes - MAX_AUC_GAP <= auc <= bayes + NOISE, result
    assert result["bayes_log_loss"] - NOISE <= result["log_loss"] <= result["base_rate_log_loss"] - MIN_LOG_LOSS_GAIN, result


@pytest.mark.unit
def test_bounds_fail_a_model_that_learned_only_the_click_rate():
    # The bounds above, applied to the best constant prediction on synthetic data.
    from tf_psx.data import roc_auc, synthetic_ctr  # pylint: disable=import-outside-toplevel

    holdout = synthetic_ctr(20_000, num_fields=8, vocab_size=2_000, seed=0)
    labels = holdout.labels.astype(np.float64)
    rate = labels.mean()

    def log_loss(probs):
        return float(-np.mean(labels * np.log(probs) + (1 - labels) * np.log(1 - probs)))

    constant = np.full(len(labels), rate)
    bias_only = {"auc": roc_auc(labels, constant), "bayes_auc": holdout.bayes_auc, "log_loss": log_loss(constant),
                 "base_rate_log_loss": -rate * np.log(rate) - (1 - rate) * np.log(1 - rate),
                 "bayes_log_loss": log_loss(holdout.probs)}
    assert bias_only["auc"] == 0.5 and abs(bias_only["log_loss"] - bias_only["base_rate_log_loss"]) < 1e-9
    with pytest.raises(AssertionError):
        _assert_learned_the_planted_model(bias_only)
    # The planted model itself passes.
    _assert_learned_the_planted_model(dict(bias_only, auc=holdout.bayes_auc, log_loss=bias_only["bayes_log_loss"]))


@pytest.mark.smoke  # also on the TFRA stack (make test-tfra)
def test_quickstart_gets_close_to_the_bayes_auc():
    result = _run_example("quickstart.py")  # its default 8 epochs of 313 steps: ~30 s here
    _assert_learned_the_planted_model(result)
    assert result["train_loss"] < result["base_rate_log_loss"] - MIN_LOG_LOSS_GAIN


def test_readme_quickstart_learns_more_than_the_click_rate(tmp_path):
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        code = handle.read().split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "readme_quickstart.py"
    # The README trains on all of `data`, so the numbers are in-sample. In-process
    # servers cannot be stopped: leave without waiting on them.
    script.write_text(code + (
        "\nimport json, numpy as np\n"
        "loss = model.history.history['loss'][-1]  # before predict, which replaces model.history\n"
        "scores = model.predict(data.ids, batch_size=4096, verbose=0).reshape(-1)\n"
        "p = float(data.labels.mean())\n"
        "print('RESULT ' + json.dumps({'loss': loss,\n"
        "    'auc': tf_psx.data.roc_auc(data.labels, scores), 'bayes_auc': data.bayes_auc,\n"
        "    'base_rate_log_loss': -p * np.log(p) - (1 - p) * np.log(1 - p)}), flush=True)\n"
        "import os; os._exit(0)\n"
    ))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=SCRIPT_TIMEOUT_S, cwd=REPO, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = _result(run.stdout)
    # Measured: AUC 0.050 below Bayes, the last epoch's loss 0.065 below the click rate's.
    assert result["bayes_auc"] - MAX_AUC_GAP <= result["auc"], result
    assert result["loss"] <= result["base_rate_log_loss"] - MIN_LOG_LOSS_GAIN, result


def test_central_storage_trains_two_replicas_to_near_the_bayes_auc():
    result = _run_example("central_storage.py", "--steps", "1200", "--replicas", "2")
    assert result["replicas"] == 2 and result["compute_devices"] == ["/cpu:0", "/cpu:1"]
    assert result["table_device"].endswith("/device:CPU:0")
    _assert_learned_the_planted_model(result)


def test_custom_loop_runs_every_scheduled_step_and_learns():
    result = _run_example("custom_loop.py", "--steps", "1200")
    # One report per join: STEPS_PER_REPORT (100) steps each, each step applied once.
    assert result["report_steps"] == list(range(100, 1300, 100))
    assert result["iterations"] == 1200
    # The mean loss of the last 100 steps is well below that of the first 100
    # (measured 0.606 -> 0.535).
    assert result["report_losses"][-1] < result["report_losses"][0] - 0.03, result["report_losses"]
    _assert_learned_the_planted_model(result)


NOTEBOOK = os.path.join(REPO, "examples", "notebooks", "quickstart.ipynb")
# Per cell: the fit cell traces the first step (~20-40 s on 2 busy cores).
NOTEBOOK_CELL_TIMEOUT_S = 600


def test_quickstart_notebook_runs_headless_and_learns(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # The kernel must be this interpreter (the venv), whatever kernels the
    # machine has: a "python3" kernelspec in a private JUPYTER_PATH comes
    # before the user's and the system's.
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tf_psx test kernel", "language": "python",
    }))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")

    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.insert(0, nbformat.v4.new_code_cell("import sys; print('KERNEL', sys.executable)"))
    # The numbers, from the notebook's own variables, in a cell of the test's.
    notebook.cells.append(nbformat.v4.new_code_cell(
        "import json, numpy as np\n"
        "p = float(holdout.labels.mean())\n"
        "clipped = np.clip(scores.astype(np.float64), 1e-7, 1 - 1e-7)\n"
        "print('RESULT ' + json.dumps({'auc': auc, 'bayes_auc': holdout.bayes_auc,\n"
        "    'log_loss': float(-np.mean(holdout.labels * np.log(clipped) + (1 - holdout.labels) * np.log(1 - clipped))),\n"
        "    'base_rate_log_loss': -p * np.log(p) - (1 - p) * np.log(1 - p),\n"
        "    'bayes_log_loss': float(-np.mean(holdout.labels * np.log(holdout.probs)\n"
        "                                     + (1 - holdout.labels) * np.log(1 - holdout.probs)))}))"
    ))
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=NOTEBOOK_CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first cell that fails

    def text(cell):
        return "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")

    assert text(notebook.cells[0]).strip() == f"KERNEL {sys.executable}"
    errors = [out for cell in notebook.cells for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors
    everything = "".join(text(cell) for cell in notebook.cells)
    assert "shards of the table: 2" in everything
    result = _result(text(notebook.cells[-1]))
    # 1000 steps on 1 worker: measured AUC 0.032 below Bayes, log loss 0.086 below the click rate's.
    _assert_learned_the_planted_model(result)


CRITEO_TIMEOUT_S = 300


@pytest.mark.tfra
def test_criteo_ps_two_workers_train_snapshot_monitor_and_serve_exactly(tmp_path):
    from tf_psx.data import CriteoStats, criteo  # pylint: disable=import-outside-toplevel

    # The defaults: 2 workers, 60 steps, a snapshot every 20. A run takes ~30 s
    # here; it has been seen to stall, idle, after fit, so a stall fails in
    # minutes rather than at the suite's limit.
    result = _run_example("criteo_ps.py", "--out", str(tmp_path), timeout=CRITEO_TIMEOUT_S)
    assert result["workers"] == 2
    assert result["snapshots"] == [20, 40, 60] and result["restored_step"] is None
    assert sorted(os.listdir(tmp_path / "snapshots")) == [f"snapshot-0000000000{s}" for s in (20, 40, 60)]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "logs" / "cluster"))
    # Staleness is measured: two async workers (and the first step, which
    # traces) make some gradients stale (measured maxima 2 to 12).
    assert result["staleness_max"] >= 1
    # The served model predicts what the trained one does (measured 3e-8 to 6e-8).
    assert result["export_max_diff"] <= 1e-5
    assert (tmp_path / "serving" / "saved_model.pb").exists()
    # One row per distinct key trained; never one that is not in the data. A
    # worker that got few steps may leave a few rows unseen (measured: all 1797
    # keys at 60 steps, 1790 of them at 40).
    keys = np.unique(np.concatenate(
        [features["cat"].numpy().ravel() for features, _ in criteo(result["data"], 64, stats=CriteoStats())]))
    assert 0.95 * keys.size <= result["keys_learned"] <= keys.size, (result["keys_learned"], keys.size)
    # No bound on the in-sample AUC: with two async workers it varies between
    # runs of the same code (measured 0.57 to 0.79), so a bound holds only on a
    # quiet machine. That the updates are right is tested where the maths gives
    # the answer: closed forms (test_exact_epochs.py, test_exact_updates.py) and
    # one-process runs of the same batches (test_tfra_clients.py).
    assert result["train_log_loss"] < 1.0, result  # finite and not diverged


# Every example that trains on a cluster, as `tf-psx launch` runs it (with
# short runs). Its workers then say how much CPU they spent serving steps; a
# launched worker that nothing used spends well under a tenth of a second
# (measured 0.0-0.1 s over 15 s), one that trained an epoch of the
# quickstart 1.3 s.
LAUNCHED_EXAMPLES = {
    "quickstart.py": ["--epochs", "1"],
    "custom_loop.py": ["--steps", "300"],
    "criteo_ps.py": ["--steps", "60"],
}
WORKER_CPU_S = 0.3


@pytest.mark.processes
@pytest.mark.parametrize("example", [tfra_param(name) if name == "criteo_ps.py" else name for name in sorted(LAUNCHED_EXAMPLES)])
def test_each_example_trains_on_the_launched_cluster(example, tmp_path):
    import re  # pylint: disable=import-outside-toplevel

    from launch_harness import LaunchRun  # pylint: disable=import-outside-toplevel

    args = LAUNCHED_EXAMPLES[example] + (["--out", str(tmp_path / "out")] if example == "criteo_ps.py" else [])
    with LaunchRun(["--workers", "2", "--ps", "1", "--log-dir", str(tmp_path / "logs")],
                   [sys.executable, os.path.join("examples", example), *args]) as run:
        code = run.wait()
    assert code == 0, run.output[-3000:]
    assert "training on the cluster of TF_CONFIG" in run.output, run.output[-3000:]
    assert "RESULT " in run.output and "LocalCluster starts its own" not in run.output
    cpu = {match.group(1): float(match.group(2)) for match in re.finditer(
        r"^\[(worker:\d)\] tf_psx.server worker:\d stopping \(CPU ([0-9.]+) s since ready\)", run.output, re.M)}
    assert sorted(cpu) == ["worker:0", "worker:1"], run.output[-3000:]
    assert min(cpu.values()) >= WORKER_CPU_S, cpu

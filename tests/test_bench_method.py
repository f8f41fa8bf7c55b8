"""The interleaved benchmark method of bench/_common.py: rotation, per-round ratios, judged only off the target."""

from __future__ import annotations

import pytest

from conftest import load_module

pytestmark = pytest.mark.unit


def _common():
    return load_module("bench_common", "bench", "_common.py")


def test_a_ratio_is_judged_only_when_its_whole_spread_is_on_one_side():
    common = _common()
    assert common.judge([1.6, 1.7, 1.55], 1.5, higher_is_better=True) is True
    assert common.judge([1.2, 1.4, 1.45], 1.5, higher_is_better=True) is False
    assert common.judge([1.4, 1.6, 1.7], 1.5, higher_is_better=True) is None  # straddles: not judged
    assert common.judge([0.15, 0.19], 0.2, higher_is_better=False) is True
    assert common.judge([0.15, 0.25], 0.2, higher_is_better=False) is None
    row = common.ratio_row("fused / stock", [1.4, 1.6, 1.7], 1.5)
    assert row["ok"] is None and row["median"] == 1.6 and row["spread"] == [1.4, 1.7]
    assert row["value"] == "1.6 (1.4-1.7, 3 rounds)" and row["target"] == ">= 1.5"
    assert "ok" not in common.ratio_row("no target", [1.0, 2.0])


def test_variants_run_interleaved_in_fresh_processes_with_the_order_rotated(tmp_path):
    common = _common()
    script = tmp_path / "child.py"
    script.write_text("import json, os, sys\nprint(json.dumps({'value': float(sys.argv[2]), 'pid': os.getpid()}))\n")
    lines = []
    runs = common.interleaved(str(script), [("1",), ("2",), ("3",)], rounds=3, log=lines.append)
    order = [line.split(": ")[0].rsplit(" ", 1)[1] for line in lines]
    assert order == ["1", "2", "3", "2", "3", "1", "3", "1", "2"]
    assert common.ratios(runs[("2",)], runs[("1",)], "value") == [2.0, 2.0, 2.0]
    pids = {run["pid"] for results in runs.values() for run in results}
    assert len(pids) == 9  # every run its own process


def test_rows_not_re_measured_are_kept_with_their_date(tmp_path, monkeypatch):
    common = _common()
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    (tmp_path / "demo.json").write_text(
        '{"date": "2026-12-01 10:00 UTC", "rows": [{"metric": "a", "value": 1}, {"metric": "b", "value": 2}]}')
    kept = common.kept_rows("demo", [{"metric": "a", "value": 5}])
    assert kept == [{"metric": "b", "value": "2 [kept from the run of 2026-12-01 10:00 UTC]"}]
    assert common.kept_rows("missing", []) == []
    (tmp_path / "again.json").write_text(
        '{"date": "2026-12-05 10:00 UTC", "rows": [{"metric": "b", "value": "2 [kept from the run of 2026-12-01 10:00 UTC]"}]}')
    assert common.kept_rows("again", []) == kept  # a row kept before keeps its own run's date


def test_rows_rewritten_from_saved_runs_keep_the_runs_date(tmp_path, monkeypatch):
    import json  # pylint: disable=import-outside-toplevel

    common = _common()
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path))
    (tmp_path / "demo.json").write_text('{"date": "2026-12-01 10:00 UTC", "rows": [], "raw": {}}')
    common.write_result("demo", "setup", [{"metric": "a", "value": 1}], date=common.saved_date("demo"))
    assert json.loads((tmp_path / "demo.json").read_text())["date"] == "2026-12-01 10:00 UTC"
    common.write_result("demo", "setup", [{"metric": "a", "value": 1}])  # a new run: now
    assert json.loads((tmp_path / "demo.json").read_text())["date"] != "2026-12-01 10:00 UTC"


def test_paired_variants_alternate_windows_in_one_process_and_keep_each_ones_fastest(monkeypatch):
    import time  # pylint: disable=import-outside-toplevel

    common = _common()
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])  # a window lasts what its model says
    calls = []

    class Model:  # stands for a compiled model: `fit` runs one epoch of `steps_per_epoch` steps
        def __init__(self, name, seconds):
            self.name, self.seconds = name, list(seconds)

        def fit(self, data, epochs, steps_per_epoch, verbose, callbacks=None):  # pylint: disable=unused-argument
            calls.append((self.name, steps_per_epoch))
            for callback in callbacks or []:
                callback.on_epoch_begin(0)
            if callbacks:  # a timed window
                clock[0] += self.seconds.pop(0)
            for callback in callbacks or []:
                callback.on_epoch_end(0)

    fits = {"a": (Model("a", [0.06, 0.02, 0.05]), lambda _: None), "b": (Model("b", [0.04, 0.08, 0.09]), lambda _: None)}
    result = common.time_fits_paired(fits, warmup_steps=3, timed_steps=10, pids={}, windows=3)
    assert calls == [("a", 3), ("b", 3), ("a", 10), ("b", 10), ("b", 10), ("a", 10), ("a", 10), ("b", 10)]
    assert result["a"]["windows_ms"] == [6.0, 2.0, 5.0]  # ms per step: 60 ms over 10 steps, ...
    assert result["a"]["ms_per_step"] == pytest.approx(2.0) and result["b"]["ms_per_step"] == pytest.approx(4.0)
    assert result["a"]["cpu_ms_per_step"] == {}


def test_kernel_time_is_summed_by_op_type_on_the_update_side_and_the_rest():
    from tf_psx._tf.versions import xplane_pb2  # pylint: disable=import-outside-toplevel  (moved in TF 2.18)

    common = _common()
    space = xplane_pb2().XSpace()
    plane = space.planes.add(name="/host:CPU")
    events = {1: "Adam/critical_section_execute/find:TFRA>CuckooHashTableFindWithExists",
              2: "Adam/Unique:Unique", 3: "model/embedding/find:TFRA>CuckooHashTableFindWithExists",
              4: "ExecutorState::Process", 5: "EagerLocalExecute: Identity", 6: "Adamax/Unique:Unique"}
    for key, name in events.items():
        plane.event_metadata[key].id = key
        plane.event_metadata[key].name = name
    line = plane.lines.add()
    # (metadata id, milliseconds) over 2 steps
    for key, ms in [(1, 3.0), (1, 1.0), (2, 0.5), (3, 2.0), (4, 50.0), (5, 9.0), (6, 0.25)]:
        line.events.add(metadata_id=key, duration_ps=int(ms * 1e9))
    totals = common.kernel_totals(space, steps=2, update_scope="Adam")
    assert totals["update"] == pytest.approx({"TFRA>CuckooHashTableFindWithExists": 2.0, "Unique": 0.25})
    # "Adamax/" is not the optimizer "Adam"'s scope; the runtime's own events are not kernels.
    assert totals["rest"] == pytest.approx({"TFRA>CuckooHashTableFindWithExists": 1.0, "Unique": 0.125})

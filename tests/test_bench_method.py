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

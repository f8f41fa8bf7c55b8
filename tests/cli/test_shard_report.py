"""`tf-psx shard-report`: the hot-spot analysis of partitioners.shard_load on files."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from conftest import CRITEO_ROWS
from tf_psx import cli
from tf_psx.data import criteo_keys
from tf_psx.partitioners import shard_load

pytestmark = pytest.mark.unit


def _zipf_ids(num_rows: int, count: int, seed: int = 0) -> np.ndarray:
    # Frequency-sorted ids, as after a vocabulary built by counting: id k has
    # probability proportional to 1 / (k + 1) ** 1.05 over the whole table.
    probs = 1.0 / np.arange(1, num_rows + 1) ** 1.05
    return np.random.default_rng(seed).choice(num_rows, size=count, p=probs / probs.sum())


def test_zipf_ids_get_sharded_embedding_recommended(run, tmp_path):
    ids = _zipf_ids(100_000, 40_000)
    path = tmp_path / "ids.npy"
    np.save(path, ids)
    status, out, _ = run("shard-report", str(path), "--shards", "8", "--rows", "100000", "--batch-size", "4096", "--json")
    assert status == 0
    report = json.loads(out)
    # The numbers are shard_load's, placement by placement.
    direct = shard_load(ids, 100_000, 8, placement="div", batch_size=4096)
    assert report["placements"]["div"]["imbalance"] == pytest.approx(direct.imbalance)
    assert report["placements"]["div"]["lookups"] == direct.lookups.tolist()
    # Contiguous ranges put the whole head on shard 0.
    assert report["placements"]["div"]["imbalance"] > 3
    assert report["placements"]["balanced"]["imbalance"] < 1.10
    assert "ShardedEmbedding(100000, dim)" in report["recommendation"]


def test_the_advice_says_whether_mod_would_do(run, tmp_path):
    # Frequency-sorted ids: mod spreads the head as well as the balanced placement.
    path = tmp_path / "zipf.npy"
    np.save(path, _zipf_ids(100_000, 40_000))
    status, out, _ = run("shard-report", str(path), "--shards", "8", "--rows", "100000", "--batch-size", "4096", "--json")
    assert status == 0
    report = json.loads(out)
    assert report["placements"]["mod"]["imbalance"] < 1.10
    assert "id % 8 is as even here" in report["recommendation"]
    # Eight fields folded into one id space as value * 8 + field: id % 8 is the
    # field, so the field with the most distinct values loads one shard.
    rng = np.random.default_rng(0)
    cardinality = np.array([200_000, 50_000, 10_000, 1_000, 100, 50, 10, 3])
    values = np.stack([(rng.zipf(1.1, 20_000) - 1) % c for c in cardinality], axis=1)
    path = tmp_path / "folded.npy"
    np.save(path, (values * 8 + np.arange(8)).ravel())
    status, out, _ = run("shard-report", str(path), "--shards", "8", "--rows", "1600000", "--batch-size", "4096",
                         "--json")
    assert status == 0
    report = json.loads(out)
    assert report["placements"]["mod"]["imbalance"] > 1.5
    assert report["placements"]["balanced"]["imbalance"] < 1.10
    assert "id % 8 is not" in report["recommendation"] and "value * num_fields + field" in report["recommendation"]


def test_help_shows_the_formula_as_written(run):
    status, out, _ = run("shard-report", "--help")
    assert status == 0
    assert "id % shards (mod)" in " ".join(out.split()) and "%%" not in out


def test_text_table_and_uniform_ids_keep_the_default(run, tmp_path):
    # Every row exactly 4 times in random order: each shard gets 1/8 of the
    # lookups, and a batch of 2048 draws ~256 +- 16 rows per shard.
    rng = np.random.default_rng(1)
    ids = rng.permutation(np.repeat(np.arange(8000), 4))
    path = tmp_path / "ids.txt"
    path.write_text("\n".join(map(str, ids)) + "\n")
    status, out, _ = run("shard-report", str(path), "--shards", "8", "--batch-size", "2048")
    assert status == 0
    assert "32000 ids, 8000 rows, 8 shards" in out  # rows default to max id + 1
    assert out.count("imbalance (max/mean)") == 3
    assert "    0     4000  12.5%" in out
    assert "recommendation: the default contiguous placement is balanced" in out


def test_criteo_column_is_the_same_in_both_layouts(run, criteo_sample):
    reports = []
    for layout in ("tsv", "csv"):
        path = criteo_sample[layout].path
        status, out, _ = run("shard-report", path, "--column", "C3", "--rows", "1000", "--shards", "4", "--json")
        assert status == 0
        reports.append(json.loads(out))
    # The two generated files hold the same 200 rows, so the hashed keys agree.
    assert reports[0]["placements"] == reports[1]["placements"]
    assert sum(reports[0]["placements"]["div"]["lookups"]) == reports[0]["ids"] == CRITEO_ROWS
    # And they are the keys of the generated C3 values (column index 2), placement by placement.
    keys = criteo_keys(criteo_sample["tsv"].cat.astype(str), vocab_size=1000).numpy()[:, 2]
    for placement in ("div", "mod"):
        direct = shard_load(keys, 1000, 4, placement=placement, batch_size=cli.DEFAULT_REPORT_BATCH)
        assert reports[0]["placements"][placement]["lookups"] == direct.lookups.tolist()
        assert reports[0]["placements"][placement]["imbalance"] == pytest.approx(direct.imbalance)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["missing.npy", "--shards", "2"], r'SOURCE "missing.npy" is not a file'),
        (["{text}", "--shards", "0"], r"Option `--shards` must be an int >= 1. Received: 0"),
        (["{text}", "--shards", "2", "--rows", "3"], r"received --rows 3 but SOURCE holds id 7.*--rows 8"),
        (["{bad}", "--shards", "2"], r'line 2 must be one integer id; received \'x7\''),
        (["{neg}", "--shards", "2"], r"negative id -3"),
        (["{floats}", "--shards", "2"], r"must hold integer ids; received dtype float64"),
        (["{tsv}", "--shards", "2", "--column", "C27", "--rows", "9"], r'`--column` must be one of C1..C26. Received: "C27"'),
        (["{tsv}", "--shards", "2", "--column", "C2"], r"`--rows` is required with --column"),
    ],
)
def test_bad_input_names_the_option_and_the_fix(run, tmp_path, criteo_sample, argv, message):
    files = {"text": "1\n7\n", "bad": "1\nx7\n", "neg": "1\n-3\n"}
    paths = {"tsv": criteo_sample["tsv"].path}
    for name, body in files.items():
        paths[name] = tmp_path / f"{name}.txt"
        paths[name].write_text(body)
    paths["floats"] = tmp_path / "floats.npy"
    np.save(paths["floats"], np.array([1.5, 2.0]))
    argv = [arg.format(**paths) for arg in argv]
    status, out, err = run("shard-report", *argv)
    assert status == 2
    assert out == ""
    assert re.search(message, err), err

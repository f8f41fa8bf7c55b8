"""Unit tests (no servers) for the Criteo reader, on the shared 200-row samples."""

from __future__ import annotations

import csv
import importlib
import inspect
import math
import os
import pathlib
import warnings

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx.data import CriteoMalformedLineWarning, CriteoReader, CriteoStats, criteo, criteo_dataset_fn, criteo_keys

# `tf_psx.data.criteo` is the function; the module is reached through sys.modules.
criteo_module = importlib.import_module("tf_psx.data.criteo")

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data")
TSV = os.path.join(DATA, "criteo_kaggle_sample.tsv")
CSV = os.path.join(DATA, "criteo_sample.txt")
SAMPLE_ROWS = 200
FULL_SPACE = 2**62


def _lines(path=TSV):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def _collect(ds):
    """All batches -> (dense [n, 13], cat [n, 26], label [n]) numpy arrays."""
    dense, cat, label = [], [], []
    for features, lab in ds:
        dense.append(features["dense"].numpy())
        cat.append(features["cat"].numpy())
        label.append(lab.numpy())
    return np.concatenate(dense), np.concatenate(cat), np.concatenate(label)


def _key(text: str, buckets: int = FULL_SPACE) -> int:
    return int(tf.strings.to_hash_bucket_fast(text, buckets))


def test_public_api_is_pinned():
    assert criteo_module.__all__ == [
        "CriteoMalformedLineWarning",
        "CriteoReader",
        "CriteoStats",
        "criteo",
        "criteo_dataset_fn",
        "criteo_keys",
    ]
    assert set(criteo_module.__all__) <= set(tf_psx.data.__all__)
    assert str(inspect.signature(CriteoReader)) == (
        "(paths: 'PathLike | Sequence[PathLike]', batch_size: 'int', *, format: 'Format' = 'auto', "
        "vocab_size: 'int | None' = None, shuffle_buffer: 'int' = 0, repeat: 'bool' = False, "
        "num_epochs: 'int | None' = None, drop_remainder: 'bool' = False, dense_missing_value: 'float' = 0.0, "
        "input_context: 'Any' = None, seed: 'int | None' = None, stats: 'CriteoStats | None' = None)"
    )
    # Reasons are in the module; the values are fixed by the Criteo layout.
    assert (criteo_module.NUM_DENSE, criteo_module.NUM_CATEGORICAL, criteo_module.NUM_FIELDS) == (13, 26, 40)


def test_tsv_and_csv_samples_give_identical_batches():
    # 200 rows at batch 64: batches of 64, 64, 64, 8 in both files, compared one by one.
    tsv_stats, csv_stats = CriteoStats(), CriteoStats()
    tsv = list(criteo(TSV, 64, stats=tsv_stats))
    csv_ = list(criteo(CSV, 64, stats=csv_stats))
    assert [int(lab.shape[0]) for _, lab in tsv] == [64, 64, 64, 8]
    assert len(tsv) == len(csv_)
    for (f_t, l_t), (f_c, l_c) in zip(tsv, csv_):
        np.testing.assert_array_equal(f_t["dense"].numpy(), f_c["dense"].numpy())
        np.testing.assert_array_equal(f_t["cat"].numpy(), f_c["cat"].numpy())
        np.testing.assert_array_equal(l_t.numpy(), l_c.numpy())
    assert (tsv_stats.rows, csv_stats.rows, tsv_stats.malformed, csv_stats.malformed) == (200, 200, 0, 0)
    reader = CriteoReader([TSV, CSV], 64)
    assert reader.formats == ("tsv", "csv")


def test_values_match_a_manual_parse():
    dense, cat, label = _collect(criteo(TSV, 32))
    assert dense.shape == (SAMPLE_ROWS, 13) and dense.dtype == np.float32
    assert cat.shape == (SAMPLE_ROWS, 26) and cat.dtype == np.int64
    assert label.shape == (SAMPLE_ROWS,) and label.dtype == np.float32
    with open(TSV, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    np.testing.assert_array_equal(label, [float(r[0]) for r in rows])
    # 49 of the 200 rows are clicks (cut -f1 | sort | uniq -c).
    assert label.sum() == 49
    for i in range(5):
        expected = [math.log1p(max(int(v), 0)) if v else 0.0 for v in rows[i][1:14]]
        np.testing.assert_allclose(dense[i], expected, rtol=1e-6)
        keys = [_key(f"C{j}:{v or '<missing>'}") for j, v in enumerate(rows[i][14:], start=1)]
        np.testing.assert_array_equal(cat[i], keys)
    # Row 0 is "0, '', 3, 260, '', 17668, ...": I1 missing -> 0, I2 = log1p(3) = 1.386294,
    # I3 = log1p(260) = ln 261 = 5.564520. Row 1 has I2 = -1, clipped at 0 -> log1p(0) = 0.
    np.testing.assert_allclose(dense[0, :3], [0.0, 1.3862944, 5.5645204], rtol=1e-6)
    assert rows[1][2] == "-1" and dense[1, 1] == 0.0
    # Row 0's C25 is empty: its key is the per-column missing key.
    assert rows[0][14 + 24] == "" and cat[0, 24] == _key("C25:<missing>")


def test_dense_missing_value_is_used_for_missing_fields_only():
    dense, _, _ = _collect(criteo(TSV, 200, dense_missing_value=-1.0))
    # Row 0: I1 is empty -> -1; I12 is "0" -> log1p(0) = 0, not the missing value.
    first = _lines()[0].split("\t")
    assert first[1] == "" and first[12] == "0"
    assert dense[0, 0] == -1.0 and dense[0, 11] == 0.0


def test_same_value_same_column_same_key_other_column_other_key(tmp_path):
    fields = _lines()[0].split("\t")
    fields[14] = fields[15] = "deadbeef"  # C1 and C2 hold the same string
    path = tmp_path / "salt.tsv"
    path.write_text("\t".join(fields) + "\n" + "\t".join(fields) + "\n")
    _, cat, _ = _collect(criteo(str(path), 2))
    assert cat[0, 0] != cat[0, 1]  # C1 vs C2: salted differently
    assert cat[0, 0] == cat[1, 0]  # the same value in C1 on two rows
    # key = Fingerprint64("C1:deadbeef") mod 2**62.
    assert cat[0, 0] == _key("C1:deadbeef") and cat[0, 1] == _key("C2:deadbeef")
    # criteo_keys gives the reader's keys for raw strings (what serving calls).
    np.testing.assert_array_equal(criteo_keys(tf.constant([fields[14:]])).numpy()[0], cat[0])


@pytest.mark.parametrize("vocab_size", [1, 1000])
def test_vocab_size_bounds_keys(vocab_size):
    _, cat, _ = _collect(criteo(TSV, 100, vocab_size=vocab_size))
    assert cat.min() >= 0 and cat.max() < vocab_size
    # key = Fingerprint64 mod N, checked on row 0's C1 ("05db9164").
    assert cat[0, 0] == _key("C1:05db9164", vocab_size)
    if vocab_size > 1:
        # 200 rows x 26 columns have hundreds of distinct values: not all in a few buckets.
        assert len(np.unique(cat)) > 100


def test_full_keys_are_non_negative_and_below_2_62():
    _, cat, _ = _collect(criteo(TSV, 200))
    assert cat.min() >= 0 and cat.max() < FULL_SPACE
    assert cat.max() > 2**61  # uniform over [0, 2**62): 5200 keys all below 2**61 has p = 2**-5200


def _write_with_bad_lines(tmp_path):
    """10 good sample lines with 3 bad ones put at file lines 3, 8 and 13."""
    good = _lines()[:10]
    short = "\t".join(good[0].split("\t")[:39])  # 39 fields
    not_int = good[1].split("\t")
    not_int[3] = "abc"  # I3
    bad_label = good[2].split("\t")
    bad_label[0] = "2"
    lines = good[:2] + [short] + good[2:6] + ["\t".join(not_int)] + good[6:10] + ["\t".join(bad_label)]
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    return str(path), good


def test_malformed_lines_are_skipped_counted_and_warned(tmp_path):
    path, good = _write_with_bad_lines(tmp_path)
    stats = CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning) as record:
        _, _, label = _collect(criteo(path, 4, stats=stats))
    assert label.tolist() == [float(line.split("\t")[0]) for line in good]
    assert (stats.rows, stats.malformed, stats.malformed_by_file) == (10, 3, {path: 3})
    messages = [str(w.message) for w in record]
    assert messages == [
        f"{path}:3: skipped malformed line: expected 40 TSV fields, found 39",
        f"{path}:8: skipped malformed line: I3 must be an integer or empty; received 'abc'",
        f"{path}:13: skipped malformed line: label must be 0 or 1; received '2'",
    ]


def test_csv_rejects_nan_dense_values(tmp_path):
    lines = _lines(CSV)
    fields = lines[1].split(",")
    fields[5] = "nan"  # I5
    path = tmp_path / "nan.csv"
    path.write_text("\n".join([lines[0], ",".join(fields), lines[2]]) + "\n")
    stats = CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning, match=r"nan\.csv:2: skipped malformed line: I5 must be a finite number"):
        _, _, label = _collect(criteo(str(path), 8, stats=stats))
    assert (len(label), stats.malformed) == (1, 1)


def test_warnings_are_capped_per_file(tmp_path):
    cap = criteo_module.MAX_WARNINGS_PER_FILE
    path = tmp_path / "junk.tsv"
    path.write_text("".join(f"junk {i}\n" for i in range(cap + 5)) + _lines()[0] + "\n")
    stats = CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning) as record:
        _, _, label = _collect(criteo(str(path), 8, stats=stats))
    # cap per-line warnings (lines 1..cap) + 1 summary; all cap + 5 lines counted.
    assert len(record) == cap + 1
    assert str(record[cap - 1].message).startswith(f"{path}:{cap}: ")
    assert str(record[cap].message) == f"{path}: skipped {cap + 5} malformed lines in all; only the first {cap} were shown."
    assert (len(label), stats.malformed) == (1, cap + 5)


def test_malformed_line_warning_can_be_made_fatal(tmp_path):
    path, _ = _write_with_bad_lines(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CriteoMalformedLineWarning)
        with pytest.raises(tf.errors.UnknownError, match=r"bad\.tsv:3: skipped malformed line"):
            _collect(criteo(path, 4))


def test_line_sharding_by_input_context_splits_rows():
    # One file, two pipelines: data line k goes to pipeline k % 2.
    dense, cat, label = _collect(criteo(TSV, 64))
    fn = criteo_dataset_fn(TSV, 64)
    parts = [_collect(fn(tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i))) for i in (0, 1)]
    for i, (d, c, lab) in enumerate(parts):
        assert len(lab) == SAMPLE_ROWS // 2
        np.testing.assert_array_equal(d, dense[i::2])
        np.testing.assert_array_equal(c, cat[i::2])
        np.testing.assert_array_equal(lab, label[i::2])
    # Disjoint (no row index in both) and complete (every index in one).
    union = np.concatenate([parts[0][1], parts[1][1]])
    assert len(np.unique(union, axis=0)) == len(np.unique(cat, axis=0))


def test_file_sharding_when_there_are_enough_files():
    contexts = [tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i) for i in (0, 1)]
    readers = [CriteoReader([TSV, CSV], 64, input_context=ctx) for ctx in contexts]
    assert [r.files for r in readers] == [(TSV,), (CSV,)]
    assert [r.line_shard for r in readers] == [(1, 0), (1, 0)]
    assert sum(len(_collect(r.dataset())[2]) for r in readers) == 2 * SAMPLE_ROWS


def test_reader_streams_the_file(tmp_path, monkeypatch):
    # 100k lines (500 copies of the 48.6 kB sample, 24 MB); the first batch of 32
    # rows must not make the reader go through the file: allow 2 % of it (~2000
    # rows, room for read-ahead and prefetch; measured: 16 kB, 64 rows).
    path = tmp_path / "big.tsv"
    path.write_bytes(pathlib.Path(TSV).read_bytes() * 500)
    size = path.stat().st_size
    opened = []
    real_open = criteo_module._open

    def tracking_open(p):
        f = real_open(p)
        opened.append(f)
        return f

    monkeypatch.setattr(criteo_module, "_open", tracking_open)
    stats = CriteoStats()
    reader = CriteoReader(str(path), 32, stats=stats)
    opened.clear()  # construction peeks at the first line only
    iterator = iter(reader.dataset())
    _, label = next(iterator)
    assert label.shape == (32,)
    assert len(opened) == 1 and not opened[0].closed
    position = opened[0].tell()
    assert position < 0.02 * size, (position, size)
    assert stats.rows < 0.02 * 500 * SAMPLE_ROWS
    del iterator


def test_num_epochs_repeat_and_shuffle():
    rows = lambda ds: int(sum(lab.shape[0] for _, lab in ds))  # noqa: E731
    # 2 epochs x 200 rows at batch 64: 400 = 6 x 64 + 16; batches span the epoch boundary.
    assert [int(lab.shape[0]) for _, lab in criteo(TSV, 64, num_epochs=2)] == [64] * 6 + [16]
    assert rows(criteo(TSV, 64, drop_remainder=True)) == 192  # 3 x 64, the 8-row tail dropped
    assert rows(criteo(TSV, 64, repeat=True).take(10)) == 640  # past one epoch
    _, plain, _ = _collect(criteo(TSV, 64))
    _, shuffled, _ = _collect(criteo(TSV, 64, shuffle_buffer=200, seed=1))
    assert not np.array_equal(plain, shuffled)  # 200! orders; the identity has p = 1/200!
    np.testing.assert_array_equal(np.unique(plain, axis=0), np.unique(shuffled, axis=0))
    static = criteo(TSV, 64, drop_remainder=True).element_spec
    assert static[0]["cat"].shape.as_list() == [64, 26] and static[1].shape.as_list() == [64]


def _bad_context():
    return tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"batch_size": 0}, ValueError, r"Argument `batch_size` must be an int >= 1\. Received: 0\."),
        ({"format": "parquet"}, ValueError, r"Argument `format` must be one of \('auto', 'tsv', 'csv'\)\. Received: 'parquet'"),
        ({"vocab_size": 0}, ValueError, r"Argument `vocab_size` must be an int >= 1 or None\. Received: 0\."),
        ({"shuffle_buffer": -1}, ValueError, r"Argument `shuffle_buffer` must be an int >= 0"),
        ({"repeat": True, "num_epochs": 2}, ValueError, r"contradict each other\. Fix: pass repeat=True"),
        ({"paths": "/nonexistent/day_0"}, FileNotFoundError, r"'/nonexistent/day_0' does not exist\. Fix:"),
        ({"paths": "/nonexistent/day_*"}, FileNotFoundError, r"No Criteo file matches the pattern"),
        ({"paths": []}, ValueError, r"at least one file"),
        ({"paths": CSV, "format": "tsv"}, ValueError, r"format='tsv' but the file starts with a CSV header.*Fix: pass format='csv'"),
        ({"input_context": "bad"}, ValueError, r"input_pipeline_id must be in \[0, 2\)"),
    ],
)
def test_invalid_arguments_are_refused_at_construction(kwargs, error, match):
    kwargs = dict(kwargs)
    paths = kwargs.pop("paths", TSV)
    batch_size = kwargs.pop("batch_size", 8)
    if kwargs.get("input_context") == "bad":
        kwargs["input_context"] = _bad_context()
    with pytest.raises(error, match=match):
        CriteoReader(paths, batch_size, **kwargs)


def test_csv_with_another_header_is_refused(tmp_path):
    lines = _lines(CSV)
    path = tmp_path / "swapped.csv"
    path.write_text("\n".join([lines[0].replace("I1,I2", "I2,I1")] + lines[1:3]) + "\n")
    with pytest.raises(ValueError, match=r"the CSV header must be 'label,I1,I2,.*received 'label,I2,I1,"):
        CriteoReader(str(path), 8)


# --- graph_dataset: the TensorFlow-ops-only path that criteo_dataset_fn uses ---

_PY_FUNC_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc"}


def _op_types(ds) -> set:
    """Every op type in the dataset's graph, its functions included."""
    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())  # pylint: disable=protected-access
    types = {node.op for node in graph.node}
    for function in graph.library.function:
        types |= {node.op for node in function.node_def}
    return types


@pytest.mark.parametrize(
    "paths, pipeline, kwargs",
    [
        (TSV, None, {}),
        (CSV, None, {"vocab_size": 1000}),
        ([TSV, CSV], (3, 1), {}),  # line sharding across two files of both layouts
        (TSV, (2, 0), {"num_epochs": 2, "drop_remainder": True, "dense_missing_value": -1.0}),
    ],
)
def test_graph_dataset_gives_the_batches_of_the_python_reader(paths, pipeline, kwargs):
    ctx = None if pipeline is None else tf.distribute.InputContext(*pipeline)
    reader = CriteoReader(paths, 37, input_context=ctx, **kwargs)
    expected, got = _collect(reader.dataset()), _collect(reader.graph_dataset())
    assert len(got[2]) > 0
    for want, have in zip(expected, got):
        np.testing.assert_array_equal(have, want)


def test_graph_dataset_skips_the_malformed_lines_the_python_reader_skips(tmp_path):
    path, good = _write_with_bad_lines(tmp_path)
    lines = _lines(CSV)
    nan_row = lines[1].split(",")
    nan_row[5] = "nan"  # I5: refused in the CSV layout
    quoted = ",".join(f'"{v}"' for v in lines[2].split(","))  # fully quoted: kept, unquoted
    csv_path = tmp_path / "mixed.csv"
    csv_path.write_text("\n".join([lines[0], ",".join(nan_row), quoted, lines[3], ""]) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CriteoMalformedLineWarning)
        for p in (path, str(csv_path)):
            reader = CriteoReader(p, 4)
            expected, got = _collect(reader.dataset()), _collect(reader.graph_dataset())
            for want, have in zip(expected, got):
                np.testing.assert_array_equal(have, want)
    assert _collect(CriteoReader(path, 4).graph_dataset())[2].tolist() == [float(x.split("\t")[0]) for x in good]
    assert len(_collect(CriteoReader(str(csv_path), 4).graph_dataset())[2]) == 2


def test_criteo_dataset_fn_runs_no_python_on_the_workers():
    # A from_generator (py_func) dataset on a ParameterServerStrategy worker calls
    # back into the coordinator; deleting its iterator after fit deadlocked the
    # coordinator's next eager op (examples/criteo_ps.py hung 3 runs in 5).
    assert _op_types(CriteoReader(TSV, 8).dataset()) & _PY_FUNC_OPS  # the check can see one
    fn = criteo_dataset_fn(TSV, 8, repeat=True, shuffle_buffer=100, seed=0)
    ds = fn(tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0))
    types = _op_types(ds)
    assert "TextLineDataset" in types
    assert not types & _PY_FUNC_OPS, types & _PY_FUNC_OPS


def test_criteo_dataset_fn_refuses_stats():
    with pytest.raises(ValueError, match=r"`stats`.*Fix: drop `stats`"):
        criteo_dataset_fn(TSV, 8, stats=CriteoStats())

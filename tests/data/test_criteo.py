"""Unit tests (no servers) for the Criteo reader and the Criteo-layout generator.

The files are generated (`write_criteo_sample`, the `criteo_sample` fixture of
conftest.py): expectations come from a plain-Python parse of the same files
and from what the generator says it wrote, never from numbers of real data.
"""

from __future__ import annotations

import csv
import gzip
import importlib
import inspect
import math
import pathlib
import re
import threading
import warnings
from collections import Counter

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from conftest import CRITEO_ROWS, CRITEO_SEED, run_script
from tf_psx.data import (
    CriteoMalformedLineWarning,
    CriteoReader,
    CriteoStats,
    criteo,
    criteo_dataset_fn,
    criteo_keys,
    roc_auc,
    write_criteo_sample,
)

pytestmark = pytest.mark.unit

# `tf_psx.data.criteo` is the function; the module is reached through sys.modules.
criteo_module = importlib.import_module("tf_psx.data.criteo")
generator_module = importlib.import_module("tf_psx.data.synthetic_criteo")
layout_module = importlib.import_module("tf_psx.data.layout")
check_module = importlib.import_module("tf_psx.data.file_check")

SAMPLE_ROWS = CRITEO_ROWS
FULL_SPACE = 2**62
# A check of a 200-line file takes milliseconds: a held check not done by then is stuck.
HELD_CHECK_TIMEOUT_S = 60


@pytest.fixture
def tsv_file(criteo_sample):
    return criteo_sample["tsv"].path


@pytest.fixture
def csv_file(criteo_sample):
    return criteo_sample["csv"].path


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def _parse(path, delimiter="\t"):
    """A plain-Python parse of a file: rows of strings, the CSV header dropped."""
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f, delimiter=delimiter))
    return rows[1:] if rows and rows[0][0] == "label" else rows


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


def _keys(rows, buckets: int = FULL_SPACE) -> np.ndarray:
    """Fingerprint64("C{j}:{value or '<missing>'}") mod buckets of every row's C1..C26."""
    texts = [[f"C{j}:{v or '<missing>'}" for j, v in enumerate(r[14:], start=1)] for r in rows]
    return tf.strings.to_hash_bucket_fast(texts, buckets).numpy()


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
    assert str(inspect.signature(CriteoStats)) == "() -> 'None'"
    assert str(inspect.signature(CriteoStats.wait)) == "(self, timeout_s: 'float | None' = None) -> 'bool'"
    assert [name for name in vars(CriteoStats) if not name.startswith("_")] == [
        "done", "wait", "rows", "malformed", "files_checked", "malformed_by_file"
    ]
    # Reasons are in the module; the values are fixed by the Criteo layout.
    assert (criteo_module.NUM_DENSE, criteo_module.NUM_CATEGORICAL, criteo_module.NUM_FIELDS) == (13, 26, 40)


def test_tsv_and_csv_samples_give_identical_batches(tsv_file, csv_file):
    # 200 rows at batch 64: batches of 64, 64, 64, 8 in both files, compared one by one.
    assert _lines(csv_file)[0] == layout_module.CSV_HEADER and _lines(csv_file)[1] != _lines(tsv_file)[0]
    tsv_stats, csv_stats = CriteoStats(), CriteoStats()
    tsv = list(criteo(tsv_file, 64, stats=tsv_stats))
    csv_ = list(criteo(csv_file, 64, stats=csv_stats))
    assert [int(lab.shape[0]) for _, lab in tsv] == [64, 64, 64, 8]
    assert len(tsv) == len(csv_)
    for (f_t, l_t), (f_c, l_c) in zip(tsv, csv_):
        np.testing.assert_array_equal(f_t["dense"].numpy(), f_c["dense"].numpy())
        np.testing.assert_array_equal(f_t["cat"].numpy(), f_c["cat"].numpy())
        np.testing.assert_array_equal(l_t.numpy(), l_c.numpy())
    assert (tsv_stats.rows, csv_stats.rows, tsv_stats.malformed, csv_stats.malformed) == (200, 200, 0, 0)
    reader = CriteoReader([tsv_file, csv_file], 64)
    assert reader.formats == ("tsv", "csv")


def test_values_match_a_manual_parse(tsv_file, csv_file, criteo_sample, tmp_path):
    dense, cat, label = _collect(criteo(tsv_file, 32))
    assert dense.shape == (SAMPLE_ROWS, 13) and dense.dtype == np.float32
    assert cat.shape == (SAMPLE_ROWS, 26) and cat.dtype == np.int64
    assert label.shape == (SAMPLE_ROWS,) and label.dtype == np.float32
    rows = _parse(tsv_file)
    assert len(rows) == SAMPLE_ROWS and {len(r) for r in rows} == {40}
    # The rows hold what the cases below need: missing and negative counts, zeros, missing categoricals.
    assert any(r[1] == "" for r in rows) and any(r[2].startswith("-") for r in rows)
    assert any(v == "0" for r in rows for v in r[1:14]) and any(v == "" for r in rows for v in r[14:])
    np.testing.assert_array_equal(label, [float(r[0]) for r in rows])
    # Clicks counted by the parse (cut -f1 | sort | uniq -c) and by the generator agree.
    clicks = sum(r[0] == "1" for r in rows)
    assert label.sum() == clicks == criteo_sample["tsv"].labels.sum() and 0 < clicks < SAMPLE_ROWS
    expected = [[math.log1p(max(int(v), 0)) if v else 0.0 for v in r[1:14]] for r in rows]
    np.testing.assert_allclose(dense, expected, rtol=1e-6)
    np.testing.assert_array_equal(cat, _keys(rows))
    # The CSV file's floats ("260.0") are the TSV file's integers ("260").
    csv_rows = _parse(csv_file, delimiter=",")
    assert [[float(v) if v else None for v in r[1:14]] for r in csv_rows] == [
        [float(int(v)) if v else None for v in r[1:14]] for r in rows
    ]
    assert [r[14:] for r in csv_rows] == [r[14:] for r in rows]

    # A row worked out by hand: "0, '', 3, 260, ...": I1 missing -> 0, I2 = log1p(3) = 1.386294,
    # I3 = log1p(260) = ln 261 = 5.564520. A second row has I2 = -1, clipped at 0 -> log1p(0) = 0,
    # and C25 empty: its key is the per-column missing key.
    first, second = list(rows[0]), list(rows[1])
    first[:4] = ["0", "", "3", "260"]
    second[2], second[14 + 24] = "-1", ""
    path = tmp_path / "by_hand.tsv"
    path.write_text("\t".join(first) + "\n" + "\t".join(second) + "\n")
    dense, cat, _ = _collect(criteo(str(path), 2))
    np.testing.assert_allclose(dense[0, :3], [0.0, 1.3862944, 5.5645204], rtol=1e-6)
    assert dense[1, 1] == 0.0
    assert cat[1, 24] == _key("C25:<missing>")


def test_reader_gives_the_generated_rows(criteo_sample):
    # What the generator says it wrote, through the reader's transform.
    for sample in criteo_sample.values():
        dense, cat, label = _collect(criteo(sample.path, 64))
        np.testing.assert_array_equal(label, sample.labels)
        want = np.where(np.isnan(sample.dense), 0.0, np.log1p(np.maximum(sample.dense, 0.0)))
        np.testing.assert_allclose(dense, want, rtol=1e-6)
        np.testing.assert_array_equal(cat, criteo_keys(tf.constant(sample.cat.astype(str))).numpy())


def test_dense_missing_value_is_used_for_missing_fields_only(tsv_file):
    dense, _, _ = _collect(criteo(tsv_file, 200, dense_missing_value=-1.0))
    # Every empty I field -> -1; every "0" -> log1p(0) = 0, not the missing value.
    raw = np.array([r[1:14] for r in _parse(tsv_file)])
    empty, zero = raw == "", raw == "0"
    assert empty.any() and zero.any()
    assert (dense[empty] == -1.0).all() and (dense[zero] == 0.0).all()
    assert (dense[~empty] >= 0.0).all()


def test_same_value_same_column_same_key_other_column_other_key(tmp_path, tsv_file):
    fields = _lines(tsv_file)[0].split("\t")
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
def test_vocab_size_bounds_keys(vocab_size, tsv_file):
    _, cat, _ = _collect(criteo(tsv_file, 100, vocab_size=vocab_size))
    assert cat.min() >= 0 and cat.max() < vocab_size
    # key = Fingerprint64 mod N, checked on row 0's C1 (8 hex digits).
    first_c1 = _parse(tsv_file)[0][14]
    assert len(first_c1) == 8 and cat[0, 0] == _key(f"C1:{first_c1}", vocab_size)
    if vocab_size > 1:
        # 200 rows x 26 columns have hundreds of distinct values: not all in a few buckets.
        assert len(np.unique(cat)) > 100


def test_full_keys_are_non_negative_and_below_2_62(tsv_file):
    _, cat, _ = _collect(criteo(tsv_file, 200))
    assert cat.min() >= 0 and cat.max() < FULL_SPACE
    assert cat.max() > 2**61  # uniform over [0, 2**62): 5200 keys all below 2**61 has p = 2**-5200


def _write_with_bad_lines(tmp_path, tsv_file):
    """10 good sample lines with 3 bad ones put at file lines 3, 8 and 13."""
    good = _lines(tsv_file)[:10]
    short = "\t".join(good[0].split("\t")[:39])  # 39 fields
    not_int = good[1].split("\t")
    not_int[3] = "abc"  # I3
    bad_label = good[2].split("\t")
    bad_label[0] = "2"
    lines = good[:2] + [short] + good[2:6] + ["\t".join(not_int)] + good[6:10] + ["\t".join(bad_label)]
    path = tmp_path / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    return str(path), good


def _messages(record):
    return [str(w.message) for w in record if w.category is CriteoMalformedLineWarning]


def test_malformed_lines_are_skipped_counted_and_warned(tmp_path, tsv_file):
    path, good = _write_with_bad_lines(tmp_path, tsv_file)
    stats = CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning) as record:
        _, _, label = _collect(criteo(path, 4, stats=stats))
        assert stats.wait()  # the warnings come from the check's thread
    assert label.tolist() == [float(line.split("\t")[0]) for line in good]
    assert (stats.rows, stats.malformed, stats.malformed_by_file, stats.files_checked) == (10, 3, {path: 3}, 1)
    assert _messages(record) == [
        f"{path}:3: skipped malformed line: expected 40 TSV fields, found 39",
        f"{path}:8: skipped malformed line: I3 must be an integer of at most 31 characters, or empty; received 'abc'",
        f"{path}:13: skipped malformed line: label must be 0 or 1; received '2'",
    ]


def test_csv_rejects_nan_dense_values(tmp_path, csv_file):
    lines = _lines(csv_file)
    fields = lines[1].split(",")
    fields[5] = "nan"  # I5
    path = tmp_path / "nan.csv"
    path.write_text("\n".join([lines[0], ",".join(fields), lines[2]]) + "\n")
    stats = CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning, match=r"nan\.csv:2: skipped malformed line: I5 must be a decimal number"):
        _, _, label = _collect(criteo(str(path), 8, stats=stats))
        stats.wait()
    assert (len(label), stats.malformed) == (1, 1)


def test_warnings_are_capped_per_file(tmp_path, tsv_file):
    cap = check_module.MAX_WARNINGS_PER_FILE
    path = tmp_path / "junk.tsv"
    path.write_text("".join(f"junk {i}\n" for i in range(cap + 5)) + _lines(tsv_file)[0] + "\n")
    stats = CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning) as record:
        _, _, label = _collect(criteo(str(path), 8, stats=stats))
        stats.wait()
    # cap per-line warnings (lines 1..cap) + 1 summary; all cap + 5 lines counted.
    messages = _messages(record)
    assert len(messages) == cap + 1
    assert messages[cap - 1].startswith(f"{path}:{cap}: ")
    assert messages[cap] == f"{path}: skipped {cap + 5} malformed lines in all; only the first {cap} were shown."
    assert (len(label), stats.malformed) == (1, cap + 5)


def test_malformed_line_warning_made_an_error_is_raised_by_the_counts(tmp_path, tsv_file):
    path, good = _write_with_bad_lines(tmp_path, tsv_file)
    stats = CriteoStats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CriteoMalformedLineWarning)
        _, _, label = _collect(criteo(path, 4, stats=stats))
        with pytest.raises(CriteoMalformedLineWarning, match=r"bad\.tsv:3: skipped malformed line"):
            stats.wait()
    # The pipeline never stops on a bad line; the counts keep raising.
    assert len(label) == len(good)
    with pytest.raises(CriteoMalformedLineWarning):
        _ = stats.malformed
    # A failed check is not cached: the next reader checks the file again.
    again = CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning):
        criteo(path, 4, stats=again)
        assert again.malformed == 3


def test_line_sharding_by_input_context_splits_rows(tsv_file):
    # One file, two pipelines: data line k goes to pipeline k % 2.
    dense, cat, label = _collect(criteo(tsv_file, 64))
    fn = criteo_dataset_fn(tsv_file, 64)
    parts = [_collect(fn(tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i))) for i in (0, 1)]
    for i, (d, c, lab) in enumerate(parts):
        assert len(lab) == SAMPLE_ROWS // 2
        np.testing.assert_array_equal(d, dense[i::2])
        np.testing.assert_array_equal(c, cat[i::2])
        np.testing.assert_array_equal(lab, label[i::2])
    # Disjoint (no row index in both) and complete (every index in one).
    union = np.concatenate([parts[0][1], parts[1][1]])
    assert len(np.unique(union, axis=0)) == len(np.unique(cat, axis=0))


def test_file_sharding_when_there_are_enough_files(tsv_file, csv_file):
    contexts = [tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=i) for i in (0, 1)]
    readers = [CriteoReader([tsv_file, csv_file], 64, input_context=ctx) for ctx in contexts]
    assert [r.files for r in readers] == [(tsv_file,), (csv_file,)]
    assert [r.line_shard for r in readers] == [(1, 0), (1, 0)]
    assert sum(len(_collect(r.dataset())[2]) for r in readers) == 2 * SAMPLE_ROWS
    # Each reader checks the files it reads.
    assert [(r.stats.files_checked, r.stats.rows) for r in readers] == [(1, SAMPLE_ROWS), (1, SAMPLE_ROWS)]


def test_batches_do_not_wait_for_the_check(tmp_path, monkeypatch, tsv_file):
    # The check of a 1 TB file takes hours: the pipeline must not wait for it.
    # Here the check is held until the first batch is out.
    path = write_criteo_sample(tmp_path / "held.tsv", SAMPLE_ROWS, seed=CRITEO_SEED, malformed=2).path
    release = threading.Event()
    real_scan = check_module._scan

    def held_scan(check):
        assert release.wait(HELD_CHECK_TIMEOUT_S), "the test never released the check"
        real_scan(check)

    monkeypatch.setattr(check_module, "_scan", held_scan)
    stats = CriteoStats()
    try:
        _, label = next(iter(criteo(path, 32, stats=stats)))
        assert label.shape == (32,)
        assert not stats.done and stats.wait(timeout_s=0.01) is False
    finally:
        release.set()
    with pytest.warns(CriteoMalformedLineWarning):
        assert stats.wait(timeout_s=HELD_CHECK_TIMEOUT_S)
    assert (stats.done, stats.rows, stats.malformed) == (True, SAMPLE_ROWS, 2)


def test_each_file_is_checked_once_and_counted_once_per_stats(tmp_path):
    path = write_criteo_sample(tmp_path / "once.tsv", 50, seed=1, malformed=3).path
    shared, other = CriteoStats(), CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning) as record:
        criteo(path, 8, stats=shared)
        shared.wait()
    assert len(_messages(record)) == 3
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always", CriteoMalformedLineWarning)
        # A second reader into the same stats, and readers of a 2-epoch and a
        # sharded pass: the file's lines are counted once per stats object,
        # and the file is not read (nor warned about) again.
        criteo(path, 8, stats=shared, num_epochs=2)
        criteo(path, 8, stats=other, input_context=tf.distribute.InputContext(2, 1))
        assert (shared.malformed, shared.rows, shared.files_checked) == (3, 50, 1)
        assert (other.malformed, other.rows, other.malformed_by_file) == (3, 50, {path: 3})
    assert _messages(again) == []
    # A rewritten file is another version: checked again.
    write_criteo_sample(path, 50, seed=1, malformed=5)
    with pytest.warns(CriteoMalformedLineWarning):
        criteo(path, 8, stats=shared)
        assert shared.malformed == 3 + 5
    assert repr(shared) == (
        f"CriteoStats(rows=100, malformed=8, files_checked=2, malformed_by_file={{{path!r}: 8}}, done=True)"
    )


def test_a_file_gone_before_the_check_is_an_error_naming_it(tmp_path, monkeypatch, tsv_file):
    path = tmp_path / "gone.tsv"
    path.write_bytes(pathlib.Path(tsv_file).read_bytes())
    reader = CriteoReader(str(path), 8)
    path.unlink()  # after construction, before dataset(): the pipeline would fail on read too
    monkeypatch.setattr(reader, "_pipeline", lambda: tf.data.Dataset.range(1))
    reader.dataset()
    with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
        reader.stats.wait()


def test_num_epochs_repeat_and_shuffle(tsv_file):
    rows = lambda ds: int(sum(lab.shape[0] for _, lab in ds))  # noqa: E731
    # 2 epochs x 200 rows at batch 64: 400 = 6 x 64 + 16; batches span the epoch boundary.
    assert [int(lab.shape[0]) for _, lab in criteo(tsv_file, 64, num_epochs=2)] == [64] * 6 + [16]
    assert rows(criteo(tsv_file, 64, drop_remainder=True)) == 192  # 3 x 64, the 8-row tail dropped
    assert rows(criteo(tsv_file, 64, repeat=True).take(10)) == 640  # past one epoch
    _, plain, _ = _collect(criteo(tsv_file, 64))
    _, shuffled, _ = _collect(criteo(tsv_file, 64, shuffle_buffer=200, seed=1))
    assert not np.array_equal(plain, shuffled)  # 200! orders; the identity has p = 1/200!
    np.testing.assert_array_equal(np.unique(plain, axis=0), np.unique(shuffled, axis=0))
    static = criteo(tsv_file, 64, drop_remainder=True).element_spec
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
        ({"paths": "{csv}", "format": "tsv"}, ValueError, r"format='tsv' but the file starts with a CSV header.*Fix: pass format='csv'"),
        ({"input_context": "bad"}, ValueError, r"input_pipeline_id must be in \[0, 2\)"),
        ({"stats": {}}, TypeError, r"Argument `stats` must be a tf_psx\.data\.CriteoStats or None\. Received: \{\}\. Fix: pass stats="),
    ],
)
def test_invalid_arguments_are_refused_at_construction(kwargs, error, match, tsv_file, csv_file):
    kwargs = dict(kwargs)
    paths = kwargs.pop("paths", "{tsv}")
    if isinstance(paths, str):
        paths = paths.format(tsv=tsv_file, csv=csv_file)
    batch_size = kwargs.pop("batch_size", 8)
    if kwargs.get("input_context") == "bad":
        kwargs["input_context"] = _bad_context()
    with pytest.raises(error, match=match):
        CriteoReader(paths, batch_size, **kwargs)


def test_csv_with_another_header_is_refused(tmp_path, csv_file):
    lines = _lines(csv_file)
    path = tmp_path / "swapped.csv"
    path.write_text("\n".join([lines[0].replace("I1,I2", "I2,I1")] + lines[1:3]) + "\n")
    with pytest.raises(ValueError, match=r"the CSV header must be 'label,I1,I2,.*received 'label,I2,I1,"):
        CriteoReader(str(path), 8)


# --- the pipeline: TensorFlow ops only, by the rules of the check ---

_PY_FUNC_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc"}


def _op_types(ds) -> set:
    """Every op type in the dataset's graph, its functions included."""
    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())  # pylint: disable=protected-access
    return _graph_op_types(graph)


def _graph_op_types(graph) -> set:
    types = {node.op for node in graph.node}
    for function in graph.library.function:
        types |= {node.op for node in function.node_def}
    return types


def _dense(values, missing=0.0):
    """The reader's transform of raw counts (nan = missing): log1p(max(I, 0))."""
    return np.where(np.isnan(values), missing, np.log1p(np.maximum(values, 0.0))).astype(np.float32)


@pytest.mark.parametrize(
    "layouts, pipeline, kwargs",
    [
        (["tsv"], None, {}),
        (["csv"], None, {"vocab_size": 1000}),
        (["tsv", "csv"], (3, 1), {}),  # line sharding across two files of both layouts
        (["tsv"], (2, 0), {"num_epochs": 2, "drop_remainder": True, "dense_missing_value": -1.0}),
    ],
)
def test_batches_are_the_generated_rows(layouts, pipeline, kwargs, criteo_sample):
    paths = [criteo_sample[layout].path for layout in layouts]
    ctx = None if pipeline is None else tf.distribute.InputContext(*pipeline)
    dense, cat, label = _collect(CriteoReader(paths, 37, input_context=ctx, **kwargs).dataset())
    # What the generator wrote, in file order; with fewer files than pipelines,
    # pipeline i of n gets data lines i, i + n, ... of the files one after another.
    samples = [criteo_sample[layout] for layout in layouts]
    want_label = np.concatenate([s.labels for s in samples])
    want_dense = _dense(np.concatenate([s.dense for s in samples]), kwargs.get("dense_missing_value", 0.0))
    want_cat = criteo_keys(tf.constant(np.concatenate([s.cat for s in samples]).astype(str)), kwargs.get("vocab_size"))
    share = slice(None) if pipeline is None else slice(pipeline[1], None, pipeline[0])
    rows = len(want_label[share])  # 200, 200, 133 (data lines 1, 4, ..., 397 of 400), 100
    epochs = kwargs.get("num_epochs", 1)
    kept = rows * epochs // 37 * 37 if kwargs.get("drop_remainder") else rows * epochs  # 2 x 100 -> 5 x 37 = 185
    assert len(label) == kept > 0
    np.testing.assert_array_equal(label, np.tile(want_label[share], epochs)[:kept])
    np.testing.assert_allclose(dense, np.tile(want_dense[share], (epochs, 1))[:kept], rtol=1e-6)
    np.testing.assert_array_equal(cat, np.tile(want_cat.numpy()[share], (epochs, 1))[:kept])


# One line per case: (name, change to a good line, kept in TSV, kept in CSV,
# I2 as read when kept). A change is {field index: new text}, or a function of
# the field list. I2 is field 2; "." = the line's own I2 (2).
_GOOD = ["1"] + [str(i) for i in range(1, 14)] + ["68fd1e64"] * 26
_CASES = [
    ("plain", {}, True, True, 2.0),
    ("CRLF", "\r\n", True, True, 2.0),
    ("two CRs", "\r\r\n", True, True, 2.0),
    ("label 0.0", {0: "0.0"}, True, True, 2.0),
    ("label 2", {0: "2"}, False, False, None),
    ("label empty", {0: ""}, False, False, None),
    ("plus sign", {2: "+5"}, True, True, 5.0),
    ("negative count", {2: "-3"}, True, True, 0.0),  # clipped at 0
    ("empty I2", {2: ""}, True, True, 0.0),  # the missing value
    ("space", {2: " 5"}, False, False, None),
    ("underscore", {2: "5_0"}, False, False, None),
    ("31 digits", {2: "9" * 31}, True, True, 1e31),  # the longest number StringToNumber takes
    ("32 digits", {2: "9" * 32}, False, False, None),  # StringToNumber would stop the pipeline
    ("decimal", {2: "3.5"}, False, True, 3.5),
    ("leading dot", {2: ".5"}, False, True, 0.5),
    ("exponent", {2: "1e99"}, False, True, 1e99),
    ("3-digit exponent", {2: "1e999"}, False, False, None),  # inf
    ("nan", {2: "nan"}, False, False, None),
    ("inf", {2: "inf"}, False, False, None),
    ("39 fields", lambda f: f[:-1], False, False, None),
    ("41 fields", lambda f: f + [""], False, False, None),
    ("empty line", lambda f: [], False, False, None),
    ("quoted", {2: '"5"', 15: '"ab"'}, False, True, 5.0),  # CSV reads without the quotes
    ("quoted comma", {16: '"a,b"'}, True, False, 2.0),  # a TSV value; 41 CSV fields
    ("not UTF-8", {17: "\udcff\udcfe"}, True, True, 2.0),  # categoricals are hashed as bytes
]


@pytest.mark.parametrize("layout", ["tsv", "csv"])
def test_the_pipeline_skips_exactly_the_lines_the_check_counts(tmp_path, layout):
    sep = "\t" if layout == "tsv" else ","
    lines, ids = [], []
    for k, (_, change, *_) in enumerate(_CASES):
        fields = list(_GOOD)
        fields[14] = f"{k:08x}"  # C1 names the case
        end = change if isinstance(change, str) else "\n"
        if callable(change):
            fields = change(fields)
        elif isinstance(change, dict):
            for index, text in change.items():
                fields[index] = text
        lines.append(sep.join(fields) + end)
        ids.append(f"{k:08x}")
    path = tmp_path / f"cases.{layout}"
    header = layout_module.CSV_HEADER + "\n" if layout == "csv" else ""
    path.write_bytes((header + "".join(lines)).encode("utf-8", "surrogateescape"))
    kept = [k for k, case in enumerate(_CASES) if case[2 if layout == "tsv" else 3]]

    stats = CriteoStats()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CriteoMalformedLineWarning)
        dense, cat, _ = _collect(criteo(str(path), 8, format=layout, stats=stats))
        stats.wait()
    # The pipeline's rows, named by their C1 key, are the kept cases in file order.
    case_of_key = dict(zip(criteo_keys(tf.constant([[i] + [""] * 25 for i in ids])).numpy()[:, 0], range(len(ids))))
    assert [case_of_key[key] for key in cat[:, 0]] == kept, [_CASES[case_of_key[key]][0] for key in cat[:, 0]]
    np.testing.assert_allclose(dense[:, 1], np.log1p([max(_CASES[k][4], 0.0) for k in kept]).astype(np.float32), rtol=1e-6)
    # The check counts the other lines, and finds each of them malformed.
    assert (stats.rows, stats.malformed) == (len(kept), len(_CASES) - len(kept))
    problems = [layout_module.problem(line.encode("utf-8", "surrogateescape"), layout) for line in lines]
    assert [k for k, problem in enumerate(problems) if problem is None] == kept


def test_no_python_runs_in_the_pipeline_built_eagerly_or_traced(tsv_file):
    # A from_generator (py_func) dataset on a ParameterServerStrategy worker calls
    # back into the coordinator; deleting its iterator after fit deadlocked the
    # coordinator's next eager op (examples/criteo_ps.py hung 3 runs in 5).
    generated = tf.data.Dataset.from_generator(lambda: iter([1]), output_signature=tf.TensorSpec([], tf.int32))
    assert _op_types(generated) & _PY_FUNC_OPS  # the check can see one
    types = _op_types(criteo(tsv_file, 8, repeat=True, shuffle_buffer=100, seed=0))
    assert "TextLineDataset" in types and not types & _PY_FUNC_OPS, types & _PY_FUNC_OPS
    # ParameterServerStrategy traces a dataset_fn once, on the coordinator, and runs the graph on each worker.
    fn = criteo_dataset_fn(tsv_file, 8, repeat=True, shuffle_buffer=100)
    traced = tf.function(lambda: fn(tf.distribute.InputContext())._variant_tensor).get_concrete_function()
    types = _graph_op_types(traced.graph.as_graph_def())
    assert "TextLineDataset" in types and not types & _PY_FUNC_OPS, types & _PY_FUNC_OPS
    assert "DatasetFromGraph" not in types  # built as is inside a function


def test_a_dataset_built_eagerly_leaves_no_function_in_the_eager_context(tsv_file):
    # Functions a dataset registers before the connection to a cluster are
    # unknown to the tasks: deleting them afterwards logged "Tried to remove
    # non-existent function" on every task. The dataset keeps none (and no
    # garbage collection runs here: functions held in reference cycles, as
    # tf.cond branches are, would show up).
    from tensorflow.python.eager import context  # pylint: disable=import-outside-toplevel

    before = set(context.context().list_function_names())
    ds = criteo(tsv_file, 8, shuffle_buffer=10, num_epochs=2, input_context=tf.distribute.InputContext(2, 1))
    _, label = next(iter(ds))
    assert label.shape == (8,)
    assert set(context.context().list_function_names()) - before == set()
    # The check can see them: a plain map registers its function.
    plain = tf.data.Dataset.range(3).map(lambda x: x + 1)
    assert set(context.context().list_function_names()) - before
    del plain


def test_criteo_dataset_fn_counts_into_stats(tmp_path):
    path = write_criteo_sample(tmp_path / "fn.tsv", 60, seed=2, malformed=4).path
    stats = CriteoStats()
    fn = criteo_dataset_fn(path, 16, stats=stats, repeat=True)
    assert stats.done and stats.files_checked == 0  # validated only: nothing read yet
    with pytest.warns(CriteoMalformedLineWarning):
        # Two pipelines, as two workers of MultiWorkerMirroredStrategy would build: the file counts once.
        halves = [fn(tf.distribute.InputContext(2, i)) for i in (0, 1)]
        assert (stats.rows, stats.malformed, stats.files_checked) == (60, 4, 1)
    assert sum(int(lab.shape[0]) for half in halves for _, lab in half.take(2)) == 4 * 16


# --- criteo() where users call it: peeked, then in fit's dataset_fn, in a subprocess ---

# A run takes 11 to 30 s on 2 loaded cores (the script's watchdog dumps the
# stacks of a hang at 200 s); the bug this guards against never ended.
EVERYWHERE_TIMEOUT_S = 240
# The script writes 200 rows with seed 0 (its ROWS and the generator's default
# seed) and the bad lines asked for: 7 gives the 4 kinds, 3 of them twice.
EVERYWHERE_ROWS, EVERYWHERE_MALFORMED = 200, 7


@pytest.mark.processes
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("--workers", "1", "--order", "after"), id="in-process-1-worker-peek-after"),
        pytest.param(("--workers", "2", "--order", "before"), id="in-process-2-workers-peek-before"),
        pytest.param(
            ("--processes", "--workers", "2", "--order", "before"),
            id="processes-2-workers-peek-before",
            marks=pytest.mark.processes,
        ),
    ],
)
def test_criteo_in_a_dataset_fn_fits_counts_and_exits(tmp_path, args):
    result = run_script(
        "criteo_everywhere.py", str(tmp_path), "--malformed", str(EVERYWHERE_MALFORMED), *args,
        timeout=EVERYWHERE_TIMEOUT_S,
    )
    out, err = result.stdout, result.stderr
    assert "Timeout" not in err, err[-6000:]  # the watchdog's stacks of a hang
    assert result.returncode == 0, out[-2000:] + err[-4000:]
    path = str(tmp_path / "day_0.tsv")
    # 2 epochs x 5 steps; each bad line counted once although the workers read the file many times.
    assert f"RESULT steps=10 malformed={EVERYWHERE_MALFORMED} by_file={path}:{EVERYWHERE_MALFORMED}" in out
    # The user sees where each bad line is (the same seed writes them at the same lines).
    twin = write_criteo_sample(tmp_path / "twin.tsv", EVERYWHERE_ROWS, malformed=EVERYWHERE_MALFORMED)
    for lineno in twin.malformed_lines:
        assert f"{path}:{lineno}: skipped malformed line" in err
    # The peeked dataset, deleted after the connection, asks no task to remove functions it never had.
    assert "non-existent function" not in err
    if "--processes" not in args:
        # Task processes are stopped before the interpreter frees fit's own
        # functions, which TF then fails to remove on them (with or without
        # this reader); in-process tasks live until the end.
        assert "Failed to remove function" not in err


# --- write_criteo_sample: the generated files the tests above read ---


def test_generator_public_api_is_pinned():
    assert generator_module.__all__ == ["CriteoSample", "write_criteo_sample"]
    assert set(generator_module.__all__) <= set(tf_psx.data.__all__)
    assert str(inspect.signature(write_criteo_sample)) == (
        "(path: 'PathLike', rows: 'int' = 200, *, layout: 'Layout' = 'tsv', seed: 'int' = 0, "
        "malformed: 'int' = 0) -> 'CriteoSample'"
    )
    assert generator_module.LAYOUTS == layout_module.FORMATS[1:] == ("tsv", "csv")
    assert generator_module.MALFORMED_KINDS == ("field_count", "label", "dense_text", "dense_nan")


def _bad_line_numbers(path, layout):
    """1-based numbers of the lines a plain-Python check finds malformed (the reader's rules)."""
    to_number = int if layout == "tsv" else float
    first = 2 if layout == "csv" else 1
    bad = []
    for lineno, line in enumerate(_lines(path)[first - 1 :], start=first):
        fields = line.split("\t" if layout == "tsv" else ",")
        try:
            ok = len(fields) == 40 and fields[0] in ("0", "1")
            ok = ok and all(v == "" or math.isfinite(to_number(v)) for v in fields[1:14])
        except ValueError:
            ok = False
        if not ok:
            bad.append(lineno)
    return bad


@pytest.mark.parametrize("layout", ["tsv", "csv"])
def test_generated_malformed_lines_are_skipped_and_counted_exactly(tmp_path, criteo_sample, layout):
    # 9 bad lines: the 4 kinds in turn ("field_count" 3 times, the others twice);
    # fewer than MAX_WARNINGS_PER_FILE, so every one is warned about.
    injected = 9
    assert injected < check_module.MAX_WARNINGS_PER_FILE
    path = str(tmp_path / f"bad.{layout}")
    sample = write_criteo_sample(path, SAMPLE_ROWS, layout=layout, seed=CRITEO_SEED, malformed=injected)
    assert Counter(sample.malformed_kinds) == {"field_count": 3, "label": 2, "dense_text": 2, "dense_nan": 2}
    assert len(_lines(path)) == SAMPLE_ROWS + injected + (layout == "csv")
    # An independent check finds exactly the injected lines malformed.
    assert _bad_line_numbers(path, layout) == list(sample.malformed_lines)
    assert _bad_line_numbers(criteo_sample[layout].path, layout) == []

    stats = CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning) as record:
        got = _collect(criteo(path, 64, stats=stats))
        stats.wait()  # the warnings come from the check's thread
    assert (stats.rows, stats.malformed, stats.malformed_by_file) == (SAMPLE_ROWS, injected, {path: injected})
    # Warned at the lines the generator reports, for the reason of each kind.
    number = "an integer" if layout == "tsv" else "a decimal number"
    dense = rf"I\d+ must be {number} of at most 31 characters, or empty; received"
    reasons = {
        "field_count": rf"expected 40 {layout.upper()} fields, found 39",
        "label": r"label must be 0 or 1; received '2'",
        "dense_text": rf"{dense} 'abc'",
        "dense_nan": rf"{dense} 'nan'",
    }
    messages = _messages(record)
    assert len(messages) == injected
    for message, lineno, kind in zip(messages, sample.malformed_lines, sample.malformed_kinds):
        prefix = re.escape(f"{path}:{lineno}: skipped malformed line: ")
        assert re.fullmatch(prefix + reasons[kind], message), (kind, message)
    # The well-formed rows are those of the clean file (the same seed), in order.
    clean = _collect(criteo(criteo_sample[layout].path, 64))
    for want, have in zip(clean, got):
        np.testing.assert_array_equal(have, want)


def test_generator_is_deterministic_and_bad_lines_leave_the_rows_alone(tmp_path):
    paths = [tmp_path / name for name in ("a.tsv", "b.tsv", "c.tsv", "d.tsv")]
    write_criteo_sample(paths[0], 50, seed=3)
    write_criteo_sample(paths[1], 50, seed=3)
    write_criteo_sample(paths[2], 50, seed=4)
    with_bad = write_criteo_sample(paths[3], 50, seed=3, malformed=5)
    assert paths[0].read_bytes() == paths[1].read_bytes()
    assert paths[0].read_bytes() != paths[2].read_bytes()
    lines = _lines(paths[3])
    kept = [line for n, line in enumerate(lines, start=1) if n not in with_bad.malformed_lines]
    assert kept == _lines(paths[0])


def test_generated_gzip_file_reads_like_the_plain_one(tmp_path, tsv_file, criteo_sample):
    path = tmp_path / "day_0.tsv.gz"
    write_criteo_sample(path, SAMPLE_ROWS, seed=CRITEO_SEED)
    with gzip.open(path, "rt", encoding="utf-8") as f:
        assert f.read() == pathlib.Path(tsv_file).read_text(encoding="utf-8")
    for want, have in zip(_collect(criteo(tsv_file, 64)), _collect(criteo(str(path), 64))):
        np.testing.assert_array_equal(have, want)


# A planted-model check: logistic regression on the 13 dense values, fit by
# Newton's method (converged in well under 20 steps on these 14 weights).
_NEWTON_STEPS = 20


def test_a_model_trained_on_generated_rows_beats_chance(tmp_path):
    sample = write_criteo_sample(tmp_path / "train.tsv", 6000, seed=1)
    dense, _, label = _collect(criteo(sample.path, 6000))
    x = np.hstack([dense, np.ones((len(label), 1))]).astype(np.float64)
    y = label.astype(np.float64)
    train, holdout = slice(0, 4000), slice(4000, None)
    w = np.zeros(x.shape[1])
    for _ in range(_NEWTON_STEPS):
        p = 1.0 / (1.0 + np.exp(-x[train] @ w))
        hessian = (x[train] * (p * (1 - p))[:, None]).T @ x[train]
        w -= np.linalg.solve(hessian + 1e-6 * np.eye(len(w)), x[train].T @ (p - y[train]))
    auc = roc_auc(y[holdout], x[holdout] @ w)
    bayes = roc_auc(y[holdout], sample.probs[holdout])
    # Above chance (labels independent of the features give 0.5 +- 0.013 on 2000
    # rows), and not above the planted probabilities' AUC: the dense part only.
    assert 0.6 < auc < bayes, (auc, bayes)
    assert 0.7 < sample.bayes_auc < 0.9


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rows": 0}, r"Argument `rows` must be an int >= 1\. Received: 0\. Fix: pass the number"),
        ({"rows": True}, r"Argument `rows` must be an int >= 1\. Received: True\."),
        ({"layout": "kaggle"}, r"Argument `layout` must be one of \('tsv', 'csv'\)\. Received: 'kaggle'\. Fix: pass 'tsv'"),
        ({"seed": -1}, r"Argument `seed` must be an int >= 0\. Received: -1\. Fix:"),
        ({"malformed": -2}, r"Argument `malformed` must be an int >= 0\. Received: -2\. Fix: pass 0 for a clean file"),
        ({"malformed": 1.5}, r"Argument `malformed` must be an int >= 0\. Received: 1\.5\."),
    ],
)
def test_write_criteo_sample_refuses_bad_arguments(tmp_path, kwargs, match):
    path = tmp_path / "never.tsv"
    with pytest.raises(ValueError, match=match):
        write_criteo_sample(path, **kwargs)
    assert not path.exists()  # checked before anything is written


def test_redaction_keeps_the_field_values_out_of_the_warnings(tmp_path, tsv_file, monkeypatch):
    from tf_psx import redaction  # pylint: disable=import-outside-toplevel

    monkeypatch.setenv(redaction.ENV, "1")
    path, _ = _write_with_bad_lines(tmp_path, tsv_file)
    stats = CriteoStats()
    with pytest.warns(CriteoMalformedLineWarning) as record:
        _collect(criteo(path, 4, stats=stats))
        assert stats.wait()
    # The file, the line, the field and the rule stay; the values ('abc', '2') do not.
    assert _messages(record) == [
        f"{path}:3: skipped malformed line: expected 40 TSV fields, found 39",
        f"{path}:8: skipped malformed line: I3 must be an integer of at most 31 characters, or empty; received <redacted>",
        f"{path}:13: skipped malformed line: label must be 0 or 1; received <redacted>",
    ]


def test_the_readers_position_is_checkpointed_with_its_iterator(tmp_path, tsv_file):
    # A checkpointed iterator goes on with the next batch after a restore (tf.train.Checkpoint of tf.data).
    iterator = iter(criteo(tsv_file, 4))
    next(iterator)
    checkpoint = tf.train.Checkpoint(data=iterator)
    saved = checkpoint.save(str(tmp_path / "position"))
    expected = [next(iterator) for _ in range(2)]
    checkpoint.restore(saved)
    again = [next(iterator) for _ in range(2)]
    for want, got in zip(tf.nest.flatten(expected), tf.nest.flatten(again)):
        np.testing.assert_array_equal(want.numpy(), got.numpy())

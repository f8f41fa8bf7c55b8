"""Hash-table lifecycle: admission, eviction, the disk tier, snapshots onto other ps counts, export.

The behaviour tests run on both stores (`store`: TFRA's tables on the TFRA stack, tf_psx's own on both);
the snapshot tests of TFRA's meta table on the TFRA stack.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tensorflow as tf

import tf_psx
from tf_psx import tables
from tf_psx.layers import DynamicEmbedding

from conftest import run_script, tfra_param

pytestmark = pytest.mark.unit


@pytest.fixture(params=[tfra_param("tfra"), pytest.param("native", marks=pytest.mark.smoke)])
def store(request):
    """The DynamicEmbedding store under test: TFRA's tables, or tf_psx's own."""
    return request.param

DIM = 2


def _linear_model(layer, width):
    """loss = -mean over the batch of the sum of the looked-up rows: constant gradients."""
    inputs = tf.keras.Input((width,), dtype=tf.int64)
    model = tf.keras.Model(inputs, tf.keras.layers.Lambda(lambda r: tf.reduce_sum(r, axis=[1, 2]))(layer(inputs)))
    return model


def _rows(layer) -> dict[int, np.ndarray]:
    keys, values = layer.export()
    return {int(k): v for k, v in zip(keys, values)}


def _slot_rows(layer) -> dict[int, np.ndarray]:
    """The first optimizer slot of every key that has one: TFRA's slot table, or a native value's slot columns."""
    if layer.store == "native":
        keys, values = layer.native_table.export(trained_only=True)
        return {int(k): v[DIM:2 * DIM] for k, v in zip(keys, values)}
    (accumulator,) = tables.slot_tables(layer)
    keys, values = (t.numpy() for t in accumulator.export())
    return {int(k): v for k, v in zip(keys, values)}


# -- arguments ---------------------------------------------------------------------


@pytest.mark.parametrize("argument,value", [
    ("min_count", 0), ("min_count", 2.0), ("min_count", True),
    ("max_rows", 0), ("max_rows", "1000"), ("max_age_steps", -1), ("max_age_steps", 1.5),
])
def test_policy_arguments_must_be_positive_ints(argument, value, store):
    minimum = 1
    with pytest.raises(ValueError, match=rf"Argument `{argument}` of DynamicEmbedding must be an int >= {minimum}"
                                         rf"( or None)?\. Received: {value!r}\. Fix:"):
        DynamicEmbedding(DIM, table=store, **{argument: value})


def test_spill_dir_needs_eviction(tmp_path, store):
    with pytest.raises(ValueError, match=r"`spill_dir` of DynamicEmbedding needs eviction .*Fix: pass max_rows"):
        DynamicEmbedding(DIM, table=store, spill_dir=tmp_path)


def test_table_eviction_arguments():
    with pytest.raises(ValueError, match=r"needs `every_n_steps` or `every_seconds`\. Received: neither"):
        tf_psx.callbacks.TableEviction()
    with pytest.raises(ValueError, match=r"`every_n_steps` of TableEviction must be an int >= 1 or None\. Received: 0"):
        tf_psx.callbacks.TableEviction(every_n_steps=0)
    with pytest.raises(ValueError, match=r"`every_seconds` of TableEviction must be a number > 0 or None\. Received: -1"):
        tf_psx.callbacks.TableEviction(every_seconds=-1)


def test_table_eviction_without_a_policy_layer_stops_fit_with_the_fix(store):
    model = _linear_model(DynamicEmbedding(DIM, table=store, name="no_policy"), 1)
    model.compile("sgd", loss=lambda y, p: -tf.reduce_mean(p))
    with pytest.raises(ValueError, match=r"has no DynamicEmbedding with max_age_steps, max_rows or min_count.*Fix"):
        model.fit(np.zeros((2, 1), np.int64), np.zeros(2), verbose=0,
                  callbacks=[tf_psx.callbacks.TableEviction(every_n_steps=1)])


def test_config_round_trips_the_policy(store):
    layer = DynamicEmbedding(DIM, table=store, min_count=3, max_rows=10, max_age_steps=5, name="cfg")
    config = layer.get_config()
    assert (config["min_count"], config["max_rows"], config["max_age_steps"], config["spill_dir"]) == (3, 10, 5, None)


# -- admission ---------------------------------------------------------------------


def test_a_key_seen_n_minus_1_times_has_no_row_and_reads_zeros(store):
    layer = DynamicEmbedding(DIM, table=store, min_count=3, initializer="ones", name="admit_eager")
    out = layer(tf.constant([[5, 7, 7]], tf.int64), training=True).numpy()[0, :, 0]
    # Key 7 is seen twice in this batch: not yet admitted, like key 5 (once).
    assert out.tolist() == [0.0, 0.0, 0.0]
    out = layer(tf.constant([[7, 5]], tf.int64), training=True).numpy()[0, :, 0]
    assert out.tolist() == [1.0, 0.0]  # 7 reached 3 occurrences; 5 has 2
    assert layer.policy.counts([5, 7, 9]).tolist() == [2, 3, 0]
    # A lookup outside training counts nothing.
    layer(tf.constant([[5]], tf.int64), training=False)
    assert layer.policy.counts([5]).tolist() == [2]


def test_admission_closed_form_with_sgd(store):
    # Batches of 2 rows; key 1 twice per batch, 2 once, keys 3 and 4 twice in all (n - 1).
    layer = DynamicEmbedding(DIM, table=store, min_count=3, initializer="zeros", name="admit_fit")
    model = _linear_model(layer, 2)
    model.compile(tf.keras.optimizers.SGD(1.0), loss=lambda y, p: -tf.reduce_mean(p))
    x = np.array([[1, 2], [1, 3]] * 2 + [[1, 2], [1, 4]] * 2, np.int64)
    model.fit(x, np.zeros(len(x)), batch_size=2, epochs=1, verbose=0, shuffle=False)
    # Key 1: counts 2, 4, 6, 8 -> admitted from step 2 on: 3 steps x 2 occurrences x lr/batch 0.5.
    # Key 2: counts 1, 2, 3, 4 -> admitted at step 3 and 4: 2 x 0.5. Keys 3 and 4: seen twice, no row.
    rows = _rows(layer)
    assert sorted(rows) == [1, 2]
    np.testing.assert_allclose(rows[1], [3.0, 3.0])
    np.testing.assert_allclose(rows[2], [1.0, 1.0])
    assert layer.policy.counts([1, 2, 3, 4]).tolist() == [8, 4, 2, 2]


def test_admission_slots_exist_only_for_admitted_keys(store):
    layer = DynamicEmbedding(DIM, table=store, min_count=2, initializer="zeros", name="admit_slots")
    model = _linear_model(layer, 1)
    model.compile(tf.keras.optimizers.Adagrad(0.1), loss=lambda y, p: -tf.reduce_mean(p))
    model.fit(np.array([[1], [2], [1], [3]], np.int64), np.zeros(4), batch_size=1, verbose=0, shuffle=False)
    assert sorted(_slot_rows(layer)) == [1] and sorted(_rows(layer)) == [1]


# -- eviction ----------------------------------------------------------------------


def _trained_for_eviction(name, store, **policy):
    layer = DynamicEmbedding(DIM, table=store, initializer="zeros", name=name, **policy)
    model = _linear_model(layer, 2)
    model.compile(tf.keras.optimizers.Adagrad(0.1), loss=lambda y, p: -tf.reduce_mean(p))
    # Key k is last used at step (the optimizer's iterations when looked up):
    # 0 -> 5, 1 -> 0, 2, 3 -> 1, 4, 5 -> 2, 6 -> 3, 7, 8 -> 4, 9 -> 5.
    x = np.array([[0, 1], [2, 3], [4, 5], [0, 6], [7, 8], [0, 9]], np.int64)
    model.fit(x, np.zeros(6), batch_size=1, verbose=0, shuffle=False)
    return model, layer


def test_eviction_by_age_then_size_removes_rows_slots_and_meta(store):
    model, layer = _trained_for_eviction("evict", store, max_rows=4, max_age_steps=3)
    assert layer.size() == 10
    report = layer.policy.evict()
    assert report.step == 6
    # Age > 3 at step 6: keys last used at steps 0..2 (1..5). Then 5 rows are
    # left, one over max_rows: the least recently used (6, step 3) goes.
    assert (report.evicted_by_age, report.evicted_by_size, report.rows_before, report.rows_after) == (5, 1, 10, 4)
    assert sorted(_rows(layer)) == [0, 7, 8, 9]
    assert sorted(_slot_rows(layer)) == [0, 7, 8, 9]
    assert layer.policy.tracked_keys() == 4 and layer.policy.rows_evicted == 6
    # An evicted key that comes back starts afresh: a zero row, the initial
    # accumulator 0.1, one Adagrad step of gradient 2: 0.1 * 2 / sqrt(0.1 + 4).
    model.fit(np.array([[1, 1]], np.int64), np.zeros(1), batch_size=1, verbose=0)
    np.testing.assert_allclose(_rows(layer)[1], [0.2 / np.sqrt(4.1)] * DIM, rtol=1e-6)


def test_table_eviction_callback_keeps_the_budget_during_fit(store):
    layer = DynamicEmbedding(DIM, table=store, max_rows=3, initializer="zeros", name="evict_cb")
    model = _linear_model(layer, 1)
    model.compile("sgd", loss=lambda y, p: -tf.reduce_mean(p))
    callback = tf_psx.callbacks.TableEviction(every_n_steps=2)
    model.fit(np.arange(8, dtype=np.int64).reshape(8, 1), np.zeros(8), batch_size=1, verbose=0, shuffle=False,
              callbacks=[callback])
    # Every 2 steps (fit's end adds no run: no step since the last one).
    assert [r.rows_after for r in callback.reports] == [2, 3, 3, 3]
    assert sorted(_rows(layer)) == [5, 6, 7]


def test_a_budget_below_one_batch_of_distinct_keys_is_an_error(store):
    layer = DynamicEmbedding(DIM, table=store, max_rows=2, name="tiny_budget")
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match=r"more distinct keys than max_rows=2.*Distinct keys in the batch: 3\. Fix: raise max_rows"):
        layer(tf.constant([[1, 2, 3]], tf.int64), training=True)
    model = _linear_model(DynamicEmbedding(DIM, table=store, max_rows=2, name="tiny_budget_fit"), 3)
    model.compile("sgd", loss=lambda y, p: -tf.reduce_mean(p))
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"more distinct keys than max_rows=2"):
        model.fit(np.array([[1, 2, 3]], np.int64), np.zeros(1), verbose=0)


# -- the disk tier -------------------------------------------------------------------


def test_disk_tier_round_trip_and_reopen(tmp_path):
    store = tables.DiskTier(tmp_path / "t", dim=2)
    keys = np.array([10, 20, 30], np.int64)
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    slots = rows + 100
    store.write(keys, [rows, slots], step=4)
    found, parts = tables.DiskTier(tmp_path / "t", dim=2).read(np.array([30, 99, 10], np.int64))
    assert found.tolist() == [30, 10]
    np.testing.assert_array_equal(parts[0], rows[[2, 0]])
    np.testing.assert_array_equal(parts[1], slots[[2, 0]])
    store.forget([30])
    assert len(tables.DiskTier(tmp_path / "t", dim=2)) == 2
    with pytest.raises(ValueError, match=r"rows of width 2, the store holds 4\. Fix: use a new spill_dir"):
        store.write(keys[:1], [rows[:1]], step=5)


def test_a_spilled_key_comes_back_with_its_row_and_slots(tmp_path, store):
    layer = DynamicEmbedding(DIM, table=store, max_rows=2, spill_dir=tmp_path / "spill", initializer="zeros", name="spill")
    model = _linear_model(layer, 1)
    model.compile(tf.keras.optimizers.Adagrad(0.5), loss=lambda y, p: -tf.reduce_mean(p))
    model.fit(np.array([[1], [1], [2], [3]], np.int64), np.zeros(4), batch_size=1, verbose=0, shuffle=False)
    row_1, slot_1 = _rows(layer)[1], _slot_rows(layer)[1]
    report = layer.policy.evict()
    assert (report.evicted_by_size, report.spilled) == (1, 1) and sorted(_rows(layer)) == [2, 3]
    assert layer.policy.counts([1]).tolist() == [tables.SPILLED]
    # Key 1 comes back: this step reads the default row and trains nothing for it.
    model.fit(np.array([[1]], np.int64), np.zeros(1), batch_size=1, verbose=0)
    assert 1 not in _rows(layer)
    report = layer.policy.evict()
    assert report.returned == 1
    np.testing.assert_array_equal(_rows(layer)[1], row_1)
    np.testing.assert_array_equal(_slot_rows(layer)[1], slot_1)
    # TFRA's meta table admits it again at min_count (1); a native table keeps its count (2) with its row on disk.
    assert layer.policy.counts([1]).tolist() == ([1] if store == "tfra" else [2])


# -- under the session cluster (1 worker, 2 ps) -----------------------------------------


@pytest.mark.cluster
def test_policy_under_the_cluster_with_fit_monitor_and_export(ps_strategy, tmp_path, store):
    with ps_strategy.scope():
        layer = DynamicEmbedding(DIM, table=store, min_count=2, max_rows=6, initializer="zeros", name="cluster_policy")
        model = _linear_model(layer, 2)
        model.compile(tf.keras.optimizers.SGD(1.0), loss=lambda y, p: -tf.reduce_mean(p))
    # Keys 100..109 once each (never admitted); key 0 and 1 in every batch.
    x = np.array([[0, 100 + i] if i % 2 else [1, 100 + i] for i in range(10)], np.int64)
    x = np.concatenate([x, x[:, ::-1] * 0 + np.array([0, 1])])

    def dataset(_ctx=None):
        return tf.data.Dataset.from_tensor_slices((x, np.zeros(len(x), np.float32))).batch(2)

    monitor = tf_psx.callbacks.ClusterMonitor(tmp_path / "logs", every_n_steps=5)
    eviction = tf_psx.callbacks.TableEviction(every_n_steps=5)
    model.fit(tf.keras.utils.experimental.DatasetCreator(dataset), epochs=1, steps_per_epoch=10, verbose=0,
              callbacks=[monitor, eviction])
    assert sorted(_rows(layer)) == [0, 1]
    counts = layer.policy.counts([0, 1, 100, 101])
    assert counts.tolist() == [15, 15, 1, 1] or counts[2:].tolist() in ([0, 1], [1, 0], [0, 0])
    assert monitor.last_values["tables/cluster_policy/rows"] == 2.0
    assert "tables/cluster_policy/rows_evicted" in monitor.last_values
    assert counts[:2].tolist() == [15, 15]
    # Pending counters (keys seen once) have a budget of max_rows too: the
    # runs dropped 4 of the 10 (which run drops them depends on how far the
    # steps got when it ran; a key is seen once, so none is dropped twice).
    assert layer.policy.tracked_keys() == 2 + 6
    assert sum(report.pending_dropped for report in eviction.reports) == 4, eviction.reports
    exported = tf_psx.export_serving(model, str(tmp_path / "served"))
    served = tf.saved_model.load(exported)
    (out,) = served.serve(tf.constant([[0, 100]], tf.int64)).values()
    # Only the live keys were written; key 100 (never admitted) serves zeros.
    np.testing.assert_allclose(out.numpy(), [float(_rows(layer)[0].sum())], rtol=1e-6)


# -- multi-process / multi-worker ---------------------------------------------------------


def _result(completed) -> dict:
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.processes
@pytest.mark.parametrize("layer", [tfra_param("dynamic"), pytest.param("native", marks=pytest.mark.smoke)])
def test_admission_is_exact_with_two_workers(layer):
    # 40 steps, min_count 41: keys seen once per batch are never admitted;
    # the others follow the closed form from the step that admitted them.
    completed = run_script("exact_updates.py", "--layer", layer, "--optimizer", "sgd", "adagrad",
                           "--workers", "2", "--steps", "40", "--min-count", "41")
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = [json.loads(line[len("RESULT "):]) for line in completed.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == 2
    for result in results:
        assert result["steps"] == 40 and result["counts_exact"], result
        assert result["rows_of_unadmitted_keys"] == 0, result
        assert abs(result["share"] - 1.0) <= 1e-4 and result["max_row_error"] <= 1e-4, result
        assert result["keys"] == result["keys_trained"] > 0, result


@pytest.mark.processes
@pytest.mark.tfra  # TFRA's meta table under another layout (native tables: test_native_tables.py)
@pytest.mark.parametrize("saved_policy,restored_policy,ps", [("none", "none", 3), ("none", "admit", 2)])
def test_adam_step_counters_go_on_from_the_snapshot_under_another_layout(tmp_path, saved_policy, restored_policy, ps):
    # Saved per shard on 2 ps tasks after 6 steps (2 counters of 6). Restored onto 3 ps tasks (a third shard)
    # or with an admission policy (the table updated whole, one counter): every counter the restored table
    # uses goes on from 6, so after 6 more steps each is 12. A counter started at 0 would give Adam's bias
    # correction of a first step to the restored moments.
    saved = _result(run_script("table_restore.py", "save", str(tmp_path), "2", saved_policy, "adam"))
    assert saved["size"] > 0
    restored = _result(run_script("table_restore.py", "restore", str(tmp_path), str(ps), restored_policy, "adam"))
    assert restored["restored_step"] == 6 and restored["rows_max_diff"] == 0.0, restored
    expected = 3 if restored_policy == "none" else 1
    assert len(restored["table_steps"]) == expected and set(restored["table_steps"].values()) == {12}, restored


@pytest.mark.processes
@pytest.mark.tfra  # TFRA's meta table under another layout (native tables: test_native_tables.py)
@pytest.mark.parametrize("saved_policy,restored_policy,ps", [("admit", "admit", 3), ("none", "admit", 3),
                                                             ("admit", "none", 1)])
def test_snapshot_restores_onto_another_number_of_ps_tasks(tmp_path, saved_policy, restored_policy, ps):
    saved = _result(run_script("table_restore.py", "save", str(tmp_path), "2", saved_policy))
    assert saved["size"] > 0
    restored = _result(run_script("table_restore.py", "restore", str(tmp_path), str(ps), restored_policy))
    assert restored["restored_step"] == 6, restored
    assert restored["size_restored"] == restored["size_saved"] and restored["exists_equal"], restored
    assert restored["rows_max_diff"] == 0.0 and restored["accumulators_equal"], restored
    if saved_policy == restored_policy == "admit":
        assert restored["counts_equal_saved"], restored
    elif restored_policy == "admit":
        # No counts in the snapshot: every restored row is admitted as it was.
        assert restored["counts_seeded"], restored

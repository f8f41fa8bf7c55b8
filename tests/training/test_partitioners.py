"""Partitioners, spec strings and hot-spot analysis (unit tier: no servers)."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from tf_psx import partitioners as P
from tf_psx.layers import ShardedEmbedding, balanced_permutation

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("partitioner, shape, want", [
    (P.FixedShardsPartitioner(4), (1000, 8), [4, 1]),
    (P.FixedShardsPartitioner(4), (3,), [3]),            # a bias: never more shards than rows
    (P.FixedShardsPartitioner(4), (), []),               # a scalar is never split
    (P.MaxIDPartitioner(1000), (2500, 16), [3, 1]),      # ceil(2500 / 1000)
    (P.MaxIDPartitioner(1000), (1000, 16), [1, 1]),
    (P.MaxIDPartitioner(1000), (1, 16), [1, 1]),
    (P.PerPSPartitioner(2).bind(3), (600, 4), [6, 1]),
    (P.PerPSPartitioner(2).bind(3), (4,), [4]),
])
def test_partition_counts(partitioner, shape, want):
    assert partitioner(shape=shape, dtype="float32") == want


@pytest.mark.parametrize("spec, kind, attr, value", [
    ("fixed:4", P.FixedShardsPartitioner, "num_shards", 4),
    ("max_ids:1000000", P.MaxIDPartitioner, "max_ids_per_shard", 1_000_000),
    ("per_ps", P.PerPSPartitioner, "shards_per_ps", 1),
    ("per_ps:3", P.PerPSPartitioner, "shards_per_ps", 3),
])
def test_from_spec_builds_our_partitioners(spec, kind, attr, value):
    partitioner = P.from_spec(spec)
    assert isinstance(partitioner, kind) and getattr(partitioner, attr) == value


@pytest.mark.parametrize("spec, attr, value", [
    ("min_size:256k", "_min_shard_bytes", 256 << 10),
    ("max_size:64m", "_max_shard_bytes", 64 << 20),
    ("max_size:1g", "_max_shard_bytes", 1 << 30),
])
def test_from_spec_builds_tf_size_partitioners(spec, attr, value):
    assert getattr(P.from_spec(spec), attr) == value


def _tf_size_partitioners():
    import tensorflow as tf

    return tf, tf.distribute.experimental.partitioners


def test_min_size_spec_without_a_ps_count_is_tfs_partitioner_with_tfs_defaults():
    tf, tf_partitioners = _tf_size_partitioners()
    # TF's default cap is one shard; the spec keeps it when it has no ps count.
    tf_default = inspect.signature(tf_partitioners.MinSizePartitioner).parameters["max_shards"].default
    assert tf_default == 1
    ours, theirs = P.from_spec("min_size:256k"), tf_partitioners.MinSizePartitioner(min_shard_bytes=256 << 10)
    assert type(ours) is type(theirs)
    assert vars(ours) == vars(theirs)  # min_shard_bytes, max_shards and bytes_per_string
    # 1M rows x 8 float32 = 32 MB: TF's default never splits it.
    assert ours(tf.TensorShape([1_000_000, 8]), tf.float32) == [1, 1]


@pytest.mark.parametrize("rows, num_ps, want", [
    (1_000_000, 2, [2, 1]),  # 32 MB: 122 shards of 256 KiB, capped at one per ps
    (1_000_000, 8, [8, 1]),
    # TF's rule: ceil(bytes / min_shard_bytes) shards, at most max_shards.
    (10_000, 8, [2, 1]),     # 320,000 B / 262,144 = 1.2: 2 shards, not 8
    (16_384, 8, [2, 1]),     # exactly 2 x 256 KiB
    (16_385, 8, [3, 1]),     # 32 B more: a third shard
    (1_000, 2, [1, 1]),      # 32 KB < 256 KiB: stays whole
])
def test_min_size_spec_with_the_ps_count_caps_tfs_partitioner_at_one_shard_per_ps(rows, num_ps, want):
    # What TF's ParameterServerStrategy docs call the commonly used partitioner:
    # MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=num_ps).
    tf, tf_partitioners = _tf_size_partitioners()
    theirs = tf_partitioners.MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=num_ps)
    ours = P.from_spec("min_size:256k", num_ps=num_ps)
    assert vars(ours) == vars(theirs)
    shape = tf.TensorShape([rows, 8])
    assert ours(shape, tf.float32) == theirs(shape, tf.float32) == want


def test_max_size_spec_is_tfs_partitioner_with_tfs_default_cap():
    tf, tf_partitioners = _tf_size_partitioners()
    assert inspect.signature(tf_partitioners.MaxSizePartitioner).parameters["max_shards"].default is None
    ours = P.from_spec("max_size:16m", num_ps=2)  # the ps count does not cap it
    assert vars(ours) == vars(tf_partitioners.MaxSizePartitioner(max_shard_bytes=16 << 20))
    # 1M rows x 16 float32 = 64 MB: 4 shards of 16 MiB, more than the 2 ps tasks.
    assert ours(tf.TensorShape([1_000_000, 16]), tf.float32) == [4, 1]


def test_per_ps_spec_binds_the_ps_count():
    assert P.from_spec("per_ps:2", num_ps=3)(shape=(100, 1), dtype="float32") == [6, 1]


@pytest.mark.parametrize("spec, why", [
    ("fixed:0", "'0' is not an int >= 1"),
    ("fixed:", "'' is not an int >= 1"),
    ("max_ids:-5", "'-5' is not an int >= 1"),
    ("min_size:12q", "'12q' is not a size such as 256k"),
    ("round_robin:2", "unknown kind 'round_robin'"),
    (4, "a spec is a string"),
])
def test_bad_specs_list_the_forms(spec, why):
    with pytest.raises(ValueError, match=r"Partitioner spec must be one of fixed:N, max_ids:N, per_ps\[:K\], "
                                         r"min_size:SIZE, max_size:SIZE .*received " + repr(spec).replace("[", r"\[") + ": " + why):
        P.from_spec(spec)


@pytest.mark.parametrize("make, match", [
    (lambda: P.FixedShardsPartitioner(0), r"`num_shards` of FixedShardsPartitioner must be an int >= 1\. Received: 0"),
    (lambda: P.FixedShardsPartitioner(2.5), r"`num_shards` .* Received: 2\.5"),
    (lambda: P.MaxIDPartitioner(0), r"`max_ids_per_shard` of MaxIDPartitioner must be an int >= 1\. Received: 0"),
    (lambda: P.MaxIDPartitioner(10, max_shards=0), r"`max_shards` of MaxIDPartitioner .* Received: 0"),
    (lambda: P.PerPSPartitioner(True), r"`shards_per_ps` of PerPSPartitioner must be an int >= 1\. Received: True"),
])
def test_bad_arguments_are_rejected_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_max_id_bound_that_cannot_be_kept_says_what_to_raise():
    with pytest.raises(ValueError, match=r"needs 5 shards\. Fix: raise max_shards to 5 or max_ids_per_shard to 250"):
        P.MaxIDPartitioner(200, max_shards=4)(shape=(1000, 2), dtype="float32")


def test_unbound_per_ps_says_how_to_bind():
    with pytest.raises(ValueError, match=r"does not know the ps count.*\.bind\(num_ps\)"):
        P.PerPSPartitioner()(shape=(10, 1), dtype="float32")


def test_div_placement_matches_sharded_variable():
    # TF's docstring: 13 rows over 5 shards are [[0,1,2],[3,4,5],[6,7,8],[9,10],[11,12]].
    assert P.div_shard_of(np.arange(13), 13, 5).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 4]


def test_balanced_permutation_is_a_bijection():
    for n in (1, 2, 7, 1000, 99_991, 2 ** 16):
        rows = balanced_permutation(np.arange(n), n)
        assert sorted(rows.tolist()) == list(range(n))


def _zipf_ids(num_rows, size, seed=0):
    rng = np.random.default_rng(seed)
    probs = np.arange(1, num_rows + 1, dtype=np.float64) ** -1.05
    return rng.choice(num_rows, size=size, p=probs / probs.sum())


def test_shard_load_finds_the_frequency_sorted_hot_spot_and_balance_removes_it():
    ids = _zipf_ids(100_000, 4096 * 8)
    div = P.shard_load(ids, 100_000, 8, "div", batch_size=4096)
    balanced = P.shard_load(ids, 100_000, 8, ShardedEmbedding(100_000, 4), batch_size=4096)
    assert div.lookup_imbalance > 5.0      # the head ids all live on shard 0
    assert div.lookups.argmax() == 0
    assert balanced.imbalance < 1.10       # the target of bench/shard_balance.py
    assert div.lookups.sum() == balanced.lookups.sum() == ids.size
    assert "imbalance (max/mean)" in balanced.table()


def test_shard_load_rejects_bad_input():
    with pytest.raises(ValueError, match=r"must lie in \[0, num_rows=10\); received id 10"):
        P.shard_load(np.array([1, 10]), 10, 2)
    with pytest.raises(ValueError, match=r"`placement` of shard_load must be one of \['div', 'mod'\]"):
        P.shard_load(np.array([1]), 10, 2, placement="random")

"""TensorFlow Recommenders' tutorial models under the strategy, only the strategy line changed.

Ports of TFRS's basic ranking and basic retrieval tutorials (the tutorial
code as written; synthetic data of MovieLens's schema: TFDS cannot download
here). Session cluster: 1 worker and 2 ps, so the steps apply in order and a
one-process run with the same batches is the closed form: trained weights and
reported metrics equal within float rounding (rtol 1e-4: the sharded
embeddings gather the same rows, the sums run in another order).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_recommenders as tfrs

import tf_psx

from conftest import run_script, script_results

pytestmark = pytest.mark.cluster

USERS, MOVIES, RATINGS = 60, 80, 1200
EMBEDDING = 8
RTOL = 1e-4


def _ratings():
    rng = np.random.default_rng(11)
    users = np.array([f"u{i}" for i in rng.integers(0, USERS, RATINGS)])
    titles = np.array([f"m{i}" for i in rng.integers(0, MOVIES, RATINGS)])
    stars = rng.integers(1, 6, RATINGS).astype("float32")
    return users, titles, stars


def _lookup_tower(vocabulary):
    return tf.keras.Sequential([
        tf.keras.layers.StringLookup(vocabulary=vocabulary, mask_token=None),
        tf.keras.layers.Embedding(len(vocabulary) + 1, EMBEDDING, embeddings_initializer=tf.keras.initializers.RandomUniform(seed=1)),
    ])


class RankingModel(tfrs.models.Model):
    """TFRS's basic ranking tutorial: two towers, an MLP, `tasks.Ranking` with a default-reduction MSE."""

    def __init__(self, users, titles):
        super().__init__()
        self.user_embeddings = _lookup_tower(users)
        self.movie_embeddings = _lookup_tower(titles)
        init = tf.keras.initializers.GlorotUniform(seed=2)
        self.ratings = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu", kernel_initializer=init),
                                            tf.keras.layers.Dense(1, kernel_initializer=init)])
        self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError(),
                                       metrics=[tf.keras.metrics.RootMeanSquaredError()])

    def call(self, features):
        return self.ratings(tf.concat([self.user_embeddings(features["user_id"]),
                                       self.movie_embeddings(features["movie_title"])], axis=1))

    def compute_loss(self, features, training=False):
        labels = features.pop("user_rating")
        return self.task(labels=labels, predictions=self(features))


class RetrievalModel(tfrs.Model):
    """TFRS's basic retrieval tutorial: two towers, `tasks.Retrieval` with `FactorizedTopK` over a candidates dataset."""

    def __init__(self, users, titles, movies):
        super().__init__()
        self.user_model = _lookup_tower(users)
        self.movie_model = _lookup_tower(titles)
        self.task = tfrs.tasks.Retrieval(metrics=tfrs.metrics.FactorizedTopK(
            candidates=movies.batch(32).map(self.movie_model), ks=(1, 5, 10)))

    def compute_loss(self, features, training=False):
        return self.task(self.user_model(features["user_id"]), self.movie_model(features["movie_title"]))


def _ranking(strategy, initial=None):
    users, titles, stars = _ratings()
    data = tf.data.Dataset.from_tensor_slices({"user_id": users, "movie_title": titles, "user_rating": stars})
    with strategy.scope():
        model = RankingModel(np.unique(users), np.unique(titles))
        # The one-process reference runs eagerly: TF 2.21 + tf-keras 2.21 leave a model's own step unconverted
        # (tf_psx._tf.versions.step_converted); the maths is the same.
        model.compile(optimizer=tf.keras.optimizers.Adagrad(learning_rate=0.1), run_eagerly=initial is None)
        model({"user_id": users[:2], "movie_title": titles[:2]})  # built, so both start from the same weights
    if initial is not None:
        model.set_weights(initial)
    start = model.get_weights() if initial is None else initial
    train, test = data.take(1000).batch(100).cache(), data.skip(1000).batch(100).cache()
    history = model.fit(train, epochs=2, verbose=0)
    return model, history.history, model.evaluate(test, return_dict=True, verbose=0), start


def _retrieval(strategy, initial=None):
    users, titles, _ = _ratings()
    data = tf.data.Dataset.from_tensor_slices({"user_id": users, "movie_title": titles})
    movie_titles = np.array([f"m{i}" for i in range(MOVIES)])
    movies = tf.data.Dataset.from_tensor_slices(movie_titles)
    with strategy.scope():
        model = RetrievalModel(np.unique(users), movie_titles, movies)
        model.compile(optimizer=tf.keras.optimizers.Adagrad(learning_rate=0.1), run_eagerly=initial is None)
        model.user_model(users[:2])
        model.movie_model(titles[:2])
    if initial is not None:
        model.set_weights(initial)
    start = model.get_weights() if initial is None else initial
    train, test = data.take(1000).batch(100).cache(), data.skip(1000).batch(100).cache()
    history = model.fit(train, epochs=2, verbose=0)
    return model, history.history, model.evaluate(test, return_dict=True, verbose=0), movies, start


def _per_worker(variable) -> bool:
    from tf_psx._tf.shadows import _PerWorkerHandle  # pylint: disable=import-outside-toplevel

    return isinstance(getattr(variable, "_v", variable), _PerWorkerHandle)


def _assert_same_weights(distributed, local):
    mine_all, theirs_all = tf_psx.unsharded_weights(distributed), local.get_weights()
    assert len(mine_all) == len(theirs_all)
    # A step's scratch variable with a copy per worker (Streaming's row counter, tf_psx._tf.worker_scratch) holds
    # nothing between steps; the coordinator reads its original, which no step writes.
    per_worker = {getattr(variable, "name", None) for variable in distributed.weights if _per_worker(variable)}
    scratch = [getattr(variable, "name", None) in per_worker for variable in local.weights]
    assert len(scratch) == len(mine_all) and sum(scratch) == len(per_worker), (per_worker, scratch)
    for mine, theirs, skip in zip(mine_all, theirs_all, scratch):
        if skip:
            continue
        if np.asarray(theirs).dtype.kind in "fc":
            np.testing.assert_allclose(mine, theirs, rtol=RTOL, atol=1e-5)
        else:  # a preprocessing layer's state (a vocabulary, counts): equal
            np.testing.assert_array_equal(mine, theirs)


def test_basic_ranking_tutorial_matches_one_process(ps_strategy):
    local, local_history, local_eval, start = _ranking(tf.distribute.get_strategy())
    model, history, evaluated, _ = _ranking(ps_strategy, start)
    _assert_same_weights(model, local)
    for name in ("root_mean_squared_error", "loss"):
        np.testing.assert_allclose(history[name], local_history[name], rtol=RTOL)
        np.testing.assert_allclose(evaluated[name], local_eval[name], rtol=RTOL)
    assert history["root_mean_squared_error"][-1] < history["root_mean_squared_error"][0]


def test_basic_retrieval_tutorial_trains_evaluates_and_serves(ps_strategy, tmp_path):
    # The candidates dataset that FactorizedTopK iterates in every step is rebuilt in the step on the worker
    # (tf_psx._tf.captured_datasets): with TF's class the first step fails ("Unable to parse tensor proto").
    local, local_history, local_eval, movies, start = _retrieval(tf.distribute.get_strategy())
    model, history, evaluated, _, _ = _retrieval(ps_strategy, start)
    _assert_same_weights(model, local)
    # Top-k accuracy is discrete: a near-tie in scores may rank one example either side of k after float
    # rounding that differs in the last bits (seen: 0.053 against 0.054 over 1,000 training examples, 0.075
    # against 0.065 over the 200 evaluated, up to 5 of 1,000 in another run). Bound: 1% of the training
    # examples, 2% of the evaluated ones (the weights agree to
    # rtol 1e-4 above, which is the closed form).
    for name in ("factorized_top_k/top_5_categorical_accuracy", "factorized_top_k/top_10_categorical_accuracy"):
        np.testing.assert_allclose(history[name], local_history[name], rtol=0, atol=0.01)
        np.testing.assert_allclose(evaluated[name], local_eval[name], rtol=0, atol=0.02)
    np.testing.assert_allclose(evaluated["loss"], local_eval["loss"], rtol=RTOL)

    index = tfrs.layers.factorized_top_k.BruteForce(model.user_model)
    index.index_from_dataset(tf.data.Dataset.zip((movies.batch(20), movies.batch(20).map(model.movie_model))))
    _, top = index(tf.constant(["u7"]), k=5)
    local_index = tfrs.layers.factorized_top_k.BruteForce(local.user_model)
    local_index.index_from_dataset(tf.data.Dataset.zip((movies.batch(20), movies.batch(20).map(local.movie_model))))
    _, local_top = local_index(tf.constant(["u7"]), k=5)
    assert top.numpy().tolist() == local_top.numpy().tolist()
    path = str(tmp_path / "index")
    tf.saved_model.save(index, path)
    _, served = tf.saved_model.load(path)(tf.constant(["u7"]))
    assert served.numpy()[0, :5].tolist() == top.numpy()[0].tolist()


def test_a_captured_dataset_that_cannot_be_rebuilt_is_refused_naming_its_holder(ps_strategy):
    class Holder(tf.keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = tf.keras.layers.Dense(1)
            self.extra = tf.data.Dataset.range(10**9)  # infinite enough: not read on the coordinator

        def train_step(self, data):
            ids, labels = data
            total = self.extra.take(3).reduce(tf.constant(0, tf.int64), lambda a, b: a + b)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((self.dense(ids) - labels) ** 2) + tf.cast(total, tf.float32) * 0.0
            self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
            return {"loss": loss}

    with ps_strategy.scope():
        model = Holder()
        model.compile(tf.keras.optimizers.SGD(0.1))
    # Raised while the step is traced, before it runs; AutoGraph re-raises it as its StagingError, message kept.
    with pytest.raises(Exception, match=r"CapturedDatasetError: The model's step uses a tf.data.Dataset built on "
                                        r"the coordinator \(held by layer 'holder' \(Holder\), attribute 'extra'"):
        model.fit(np.ones((8, 2), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)


class MultitaskModel(tfrs.models.Model):
    """TFRS's multitask tutorial: a rating task and a retrieval task on shared towers, with loss weights."""

    def __init__(self, users, titles, movies, rating_weight, retrieval_weight):
        super().__init__()
        self.movie_model = _lookup_tower(titles)
        self.user_model = _lookup_tower(users)
        init = tf.keras.initializers.GlorotUniform(seed=3)
        self.rating_model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="relu", kernel_initializer=init),
                                                 tf.keras.layers.Dense(1, kernel_initializer=init)])
        self.rating_task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError(),
                                              metrics=[tf.keras.metrics.RootMeanSquaredError()])
        self.retrieval_task = tfrs.tasks.Retrieval(metrics=tfrs.metrics.FactorizedTopK(
            candidates=movies.batch(32).map(self.movie_model), ks=(1, 5, 10)))
        self.rating_weight, self.retrieval_weight = rating_weight, retrieval_weight

    def call(self, features):
        user_embeddings = self.user_model(features["user_id"])
        movie_embeddings = self.movie_model(features["movie_title"])
        return user_embeddings, movie_embeddings, self.rating_model(
            tf.concat([user_embeddings, movie_embeddings], axis=1))

    def compute_loss(self, features, training=False):
        ratings = features.pop("user_rating")
        user_embeddings, movie_embeddings, rating_predictions = self(features)
        rating_loss = self.rating_task(labels=ratings, predictions=rating_predictions)
        retrieval_loss = self.retrieval_task(user_embeddings, movie_embeddings)
        return self.rating_weight * rating_loss + self.retrieval_weight * retrieval_loss


class FeaturizedUserModel(tf.keras.Model):
    """TFRS's featurization / deep recommenders tutorials: an id, a discretized and a normalized timestamp."""

    def __init__(self, users, timestamps, buckets):
        super().__init__()
        uniform = tf.keras.initializers.RandomUniform(seed=4)
        self.user_embedding = tf.keras.Sequential([tf.keras.layers.StringLookup(vocabulary=users, mask_token=None),
                                                   tf.keras.layers.Embedding(len(users) + 1, EMBEDDING,
                                                                             embeddings_initializer=uniform)])
        self.timestamp_embedding = tf.keras.Sequential([tf.keras.layers.Discretization(buckets.tolist()),
                                                        tf.keras.layers.Embedding(len(buckets) + 1, EMBEDDING,
                                                                                  embeddings_initializer=uniform)])
        self.normalized_timestamp = tf.keras.layers.Normalization(axis=None)
        self.normalized_timestamp.adapt(timestamps)

    def call(self, inputs):
        return tf.concat([self.user_embedding(inputs["user_id"]), self.timestamp_embedding(inputs["timestamp"]),
                          tf.reshape(self.normalized_timestamp(inputs["timestamp"]), (-1, 1))], axis=1)


class FeaturizedMovieModel(tf.keras.Model):
    """The tutorials' candidate tower: a title id and the title's words (TextVectorization, mean of embeddings)."""

    def __init__(self, titles):
        super().__init__()
        uniform = tf.keras.initializers.RandomUniform(seed=5)
        self.title_embedding = tf.keras.Sequential([tf.keras.layers.StringLookup(vocabulary=titles, mask_token=None),
                                                    tf.keras.layers.Embedding(len(titles) + 1, EMBEDDING,
                                                                              embeddings_initializer=uniform)])
        self.title_vectorizer = tf.keras.layers.TextVectorization(max_tokens=200)
        self.title_vectorizer.adapt(titles)
        self.title_text_embedding = tf.keras.Sequential([
            self.title_vectorizer,
            tf.keras.layers.Embedding(200, EMBEDDING, mask_zero=True, embeddings_initializer=uniform),
            tf.keras.layers.GlobalAveragePooling1D()])

    def call(self, titles):
        return tf.concat([self.title_embedding(titles), self.title_text_embedding(titles)], axis=1)


class DeepRetrievalModel(tfrs.models.Model):
    """The deep recommenders tutorial: featurized towers, a Dense layer on top of each, the retrieval task."""

    def __init__(self, users, timestamps, buckets, titles, movies):
        super().__init__()
        init = tf.keras.initializers.GlorotUniform(seed=6)
        self.query_model = tf.keras.Sequential([FeaturizedUserModel(users, timestamps, buckets),
                                                tf.keras.layers.Dense(EMBEDDING, kernel_initializer=init)])
        self.candidate_model = tf.keras.Sequential([FeaturizedMovieModel(titles),
                                                    tf.keras.layers.Dense(EMBEDDING, kernel_initializer=init)])
        self.task = tfrs.tasks.Retrieval(metrics=tfrs.metrics.FactorizedTopK(
            candidates=movies.batch(32).map(self.candidate_model), ks=(1, 5, 10)))

    def compute_loss(self, features, training=False):
        query_embeddings = self.query_model({"user_id": features["user_id"], "timestamp": features["timestamp"]})
        return self.task(query_embeddings, self.candidate_model(features["movie_title"]))


def _titles():
    # Titles with words, as MovieLens's ("Toy Story (1995)"): the text tower has tokens to share.
    return np.array([f"movie {i} part {i % 7} ({1990 + i % 11})" for i in range(MOVIES)])


def _fit_from(strategy, build, features, initial, metrics):
    """Builds the model under `strategy`, starts it from `initial` (or keeps its own), fits and evaluates."""
    data = tf.data.Dataset.from_tensor_slices(features)
    with strategy.scope():
        model = build()
        model.compile(optimizer=tf.keras.optimizers.Adagrad(learning_rate=0.1), run_eagerly=initial is None)
        model.compute_loss({k: v[:2] for k, v in features.items()}, training=False)  # built
    if initial is not None:
        model.set_weights(initial)
    start = model.get_weights() if initial is None else initial
    train, test = data.take(1000).batch(100).cache(), data.skip(1000).batch(100).cache()
    history = model.fit(train, epochs=2, verbose=0).history
    evaluated = model.evaluate(test, return_dict=True, verbose=0)
    return model, {name: (history[name], evaluated[name]) for name in metrics}, start


def _assert_tutorial_matches_one_process(ps_strategy, build, features, metrics):
    local, local_metrics, start = _fit_from(tf.distribute.get_strategy(), build, features, None, metrics)
    model, found, _ = _fit_from(ps_strategy, build, features, start, metrics)
    _assert_same_weights(model, local)
    for name, (history, evaluated) in found.items():
        # Losses and RMSE: rtol 1e-4; top-k accuracies: near-ties, as in the retrieval port above.
        tolerance = dict(rtol=0, atol=0.02) if "top_" in name else dict(rtol=RTOL)
        np.testing.assert_allclose(history, local_metrics[name][0], **tolerance)
        np.testing.assert_allclose(evaluated, local_metrics[name][1], **tolerance)


def test_multitask_tutorial_matches_one_process(ps_strategy):
    users, _, stars = _ratings()
    titles = _titles()
    picked = titles[np.random.default_rng(12).integers(0, MOVIES, RATINGS)]
    movies = tf.data.Dataset.from_tensor_slices(titles)
    features = {"user_id": users, "movie_title": picked, "user_rating": stars}
    _assert_tutorial_matches_one_process(
        ps_strategy, lambda: MultitaskModel(np.unique(users), titles, movies, rating_weight=1.0, retrieval_weight=1.0),
        features, ("root_mean_squared_error", "factorized_top_k/top_10_categorical_accuracy", "total_loss"))


@pytest.fixture(scope="module")
def unsharded_strategy(local_cluster):
    # The featurized towers nest subclassed models in Sequentials; their sharded weights do not take the
    # one-process model's list (21 against 13), so this port trains unsharded variables on the ps tasks.
    return tf_psx.ParameterServerStrategy(local_cluster)


def test_deep_recommenders_tutorial_with_featurization_matches_one_process(unsharded_strategy):
    users, _, _ = _ratings()
    titles = _titles()
    rng = np.random.default_rng(13)
    picked = titles[rng.integers(0, MOVIES, RATINGS)]
    timestamps = rng.integers(874_724_710, 893_286_638, RATINGS).astype("int64")
    buckets = np.linspace(timestamps.min(), timestamps.max(), num=50)
    movies = tf.data.Dataset.from_tensor_slices(titles)
    features = {"user_id": users, "movie_title": picked, "timestamp": timestamps}
    _assert_tutorial_matches_one_process(
        unsharded_strategy, lambda: DeepRetrievalModel(np.unique(users), timestamps, buckets, titles, movies),
        features, ("factorized_top_k/top_10_categorical_accuracy", "total_loss"))


@pytest.fixture(scope="module")
def sync_strategy(local_cluster):
    return tf_psx.ParameterServerStrategy(local_cluster, sync=True)


def test_ranking_and_retrieval_under_sync_training_match_one_process(sync_strategy):
    # sync=True with the session's 1 worker: each sync step is one batch, so the one-process run with the same
    # batches is the closed form here too.
    local, _, local_eval, start = _ranking(tf.distribute.get_strategy())
    model, _, evaluated, _ = _ranking(sync_strategy, start)
    _assert_same_weights(model, local)
    np.testing.assert_allclose(evaluated["root_mean_squared_error"], local_eval["root_mean_squared_error"], rtol=RTOL)
    local, _, local_eval, _, start = _retrieval(tf.distribute.get_strategy())
    model, _, evaluated, _, _ = _retrieval(sync_strategy, start)
    _assert_same_weights(model, local)
    np.testing.assert_allclose(evaluated["loss"], local_eval["loss"], rtol=RTOL)


@pytest.mark.processes
@pytest.mark.smoke
def test_retrieval_with_two_async_workers_trains_and_evaluates_as_one_process_would():
    # TFRS's Streaming top-k keeps a per-call row counter in a variable: with 2 workers on one ps both steps reset
    # and advanced it at once ("Requires start <= limit", in every run of this script before the fix). Each worker
    # now has its own (tf_psx._tf.worker_scratch), and the logs are the metrics' state (tf_psx._tf.metric_results).
    result = script_results(run_script("tfrs_workers.py", "--workers", "2", "--epochs", "2"))[0]
    assert [name.split(":")[0] for name in result["per_worker"]] == ["counter"], result["per_worker"]
    # Evaluation of given weights is deterministic: the cluster's equals one process's on the same weights (before
    # the fix its top-k accuracies were those of 600 of the 800 examples, read from one step's return).
    for name, value in result["local_evaluated"].items():
        if "categorical_accuracy" in name:
            assert result["evaluated"][name] == pytest.approx(value, abs=1e-6), name
    # Each epoch's accuracy is a count over exactly that epoch's 3,200 examples.
    for name, values in result["history"].items():
        if "categorical_accuracy" in name:
            for value in values:
                assert abs(value * 3200 - round(value * 3200)) < 1e-3, (name, values)

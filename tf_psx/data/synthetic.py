"""Synthetic clicks from a planted logistic model over Zipf ids.

Because the model that made the labels is known, so is the best AUC any model
can reach on the data (the Bayes-optimal AUC: the AUC of the true click
probabilities). Benchmarks and the demo report the gap to it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tf_psx.errors import ArgumentError

__all__ = ["SyntheticCTR", "synthetic_ctr", "roc_auc", "log_loss", "holdout_quality", "describe_quality"]

# Weight scale of the planted model: with 8-26 fields it gives a Bayes AUC
# of about 0.75-0.85, the range of real CTR data.
DEFAULT_WEIGHT_SCALE = 0.6
# Planted bias: about a 25 % click rate, as on the Criteo Kaggle data.
DEFAULT_BIAS = -1.2


@dataclasses.dataclass
class SyntheticCTR:
    """Synthetic CTR examples.

    Attributes:
      ids: int64 [num_examples, num_fields]. Row ids into one table of
        `num_rows = num_fields * vocab_size` rows: field f uses rows
        [f * vocab_size, (f + 1) * vocab_size), and inside each field id 0
        is the most frequent (frequency-sorted).
      labels: float32 [num_examples], 0 or 1.
      probs: float64 [num_examples], the true click probabilities.
      num_rows: the table size the ids index.
      bayes_auc: the AUC of `probs` against `labels`: no model does better
        on these examples, except by chance.
    """

    ids: np.ndarray
    labels: np.ndarray
    probs: np.ndarray
    num_rows: int
    bayes_auc: float

    def split(self, holdout_fraction: float) -> tuple["SyntheticCTR", "SyntheticCTR"]:
        """Splits into (train, holdout); each part has its own Bayes AUC."""
        if not 0.0 < holdout_fraction < 1.0:
            raise ArgumentError(
                f"Argument `holdout_fraction` must be in (0, 1). Received: {holdout_fraction!r}."
            )
        cut = int(round(len(self.labels) * (1.0 - holdout_fraction)))
        return self._take(slice(0, cut)), self._take(slice(cut, None))

    def _take(self, index: slice) -> "SyntheticCTR":
        labels, probs = self.labels[index], self.probs[index]
        return SyntheticCTR(self.ids[index], labels, probs, self.num_rows, roc_auc(labels, probs))


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The ROC AUC (Mann-Whitney U), ties counted as one half.

    Example:

    >>> roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
    0.75

    Args:
      labels: [n] 0/1 labels.
      scores: [n] scores; higher means more likely 1.

    Returns:
      The AUC in [0, 1].

    Raises:
      ValueError: when the labels hold only one class.
    """
    labels = np.asarray(labels).reshape(-1).astype(bool)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    num_pos = int(labels.sum())
    num_neg = labels.size - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ArgumentError(f"AUC needs both classes; received {num_pos} positives and {num_neg} negatives.")
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(labels.size, dtype=np.float64)
    sorted_scores = scores[order]
    # Average ranks over ties (1-based).
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - num_pos * (num_pos + 1) / 2.0) / (num_pos * num_neg))


# Probabilities are clipped this far from 0 and 1: a confident wrong
# prediction costs -log(1e-7) ~ 16, not infinity.
_LOG_LOSS_CLIP = 1e-7


def log_loss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy of click probabilities `probs` [n] against 0/1 `labels` [n].

    Example:

    >>> round(log_loss(np.array([0, 1]), np.array([0.5, 0.5])), 4)  # ln 2
    0.6931
    """
    probs = np.clip(np.asarray(probs, np.float64).reshape(-1), _LOG_LOSS_CLIP, 1 - _LOG_LOSS_CLIP)
    labels = np.asarray(labels, np.float64).reshape(-1)
    return float(-np.mean(labels * np.log(probs) + (1 - labels) * np.log(1 - probs)))


def holdout_quality(labels: np.ndarray, scores: np.ndarray, probs: np.ndarray | None = None) -> dict:
    """How good click scores are, next to what is known to be reachable.

    Args:
      labels: [n] 0/1 clicks.
      scores: [n] the model's click probabilities.
      probs: [n] the true click probabilities (a `SyntheticCTR`'s `probs`), if known.

    Returns:
      {"auc", "log_loss", "base_rate_log_loss"} and, with `probs`, {"bayes_auc",
      "bayes_log_loss"}: the model's AUC and log loss, the log loss of
      predicting the click rate p for everyone (-p log p - (1-p) log(1-p)),
      and the best any model can reach on average.
    """
    labels = np.asarray(labels).reshape(-1)
    result = {
        "auc": roc_auc(labels, scores),
        "log_loss": log_loss(labels, scores),
        "base_rate_log_loss": log_loss(labels, np.full(len(labels), labels.mean())),
    }
    if probs is not None:
        result["bayes_auc"] = roc_auc(labels, probs)
        result["bayes_log_loss"] = log_loss(labels, probs)
    return result


def describe_quality(result: dict, label: str = "holdout") -> str:
    """The lines an example prints for `holdout_quality`'s dict."""
    auc = f"{label} AUC {result['auc']:.4f}"
    loss = f"{label} log loss {result['log_loss']:.4f}   click rate alone {result['base_rate_log_loss']:.4f}"
    if "bayes_auc" in result:
        auc += f"   best possible (Bayes) AUC {result['bayes_auc']:.4f}   gap {result['bayes_auc'] - result['auc']:.4f}"
        loss += f"   Bayes {result['bayes_log_loss']:.4f}"
    return auc + "\n" + loss


def _zipf_probs(vocab_size: int, exponent: float) -> np.ndarray:
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -exponent
    return weights / weights.sum()


def synthetic_ctr(
    num_examples: int,
    num_fields: int,
    vocab_size: int,
    zipf: float = 1.05,
    seed: int = 0,
    weight_scale: float = DEFAULT_WEIGHT_SCALE,
    bias: float = DEFAULT_BIAS,
) -> SyntheticCTR:
    """Draws CTR examples from a planted logistic model over Zipf ids.

    Each (field, id) has a weight w ~ N(0, weight_scale / sqrt(num_fields) * 2);
    an example's click probability is sigmoid(bias + sum over fields of w).

    Example:

    >>> data = synthetic_ctr(2000, num_fields=4, vocab_size=100, seed=1)
    >>> data.ids.shape, data.num_rows
    ((2000, 4), 400)
    >>> 0.6 < data.bayes_auc < 0.95
    True

    Args:
      num_examples: examples to draw (>= 2).
      num_fields: categorical fields per example (>= 1).
      vocab_size: ids per field (>= 1).
      zipf: the Zipf exponent of id frequencies (> 0).
      seed: the random seed; the same seed gives the same data.
      weight_scale: the spread of the planted weights.
      bias: the planted logit bias.

    Returns:
      A `SyntheticCTR`.
    """
    for name, value, minimum in (("num_examples", num_examples, 2), ("num_fields", num_fields, 1), ("vocab_size", vocab_size, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            raise ArgumentError(f"Argument `{name}` must be an int >= {minimum}. Received: {value!r}.")
    if not zipf > 0:
        raise ArgumentError(f"Argument `zipf` must be > 0. Received: {zipf!r}.")
    rng = np.random.default_rng(seed)
    local = rng.choice(vocab_size, size=(num_examples, num_fields), p=_zipf_probs(vocab_size, zipf))
    ids = (local + np.arange(num_fields) * vocab_size).astype(np.int64)
    weights = rng.normal(0.0, 2.0 * weight_scale / np.sqrt(num_fields), size=num_fields * vocab_size)
    logits = bias + weights[ids].sum(axis=1)
    probs = 1.0 / (1.0 + np.exp(-logits))
    labels = (rng.random(num_examples) < probs).astype(np.float32)
    return SyntheticCTR(ids, labels, probs, num_fields * vocab_size, roc_auc(labels, probs))

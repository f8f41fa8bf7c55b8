"""The int64 keys of Criteo's categorical values (`criteo_keys`): what an embedding table is indexed by."""

from __future__ import annotations

from tf_psx.data.layout import CATEGORICAL_NAMES

__all__ = ["criteo_keys", "HASH_KEY_SPACE", "MISSING_TOKEN"]

# Keys are Fingerprint64(salted value) mod 2**62: non-negative int64 keys
# (some hash tables reserve negative keys as empty/deleted markers) and, for
# the ~9e8 distinct values of Criteo Terabyte, about n**2 / 2**63 ~ 0.1
# expected colliding pairs in all.
HASH_KEY_SPACE = 2**62
# Hashed in place of an empty categorical field, so each column has its own
# "missing" key. Real values are 8 hex digits, so they never equal it.
MISSING_TOKEN = "<missing>"


def criteo_keys(cat, vocab_size: int | None = None):
    """Turns raw Criteo categorical strings into int64 keys.

    key = Fingerprint64(f"C{j}:{value}") mod (vocab_size or 2**62) for column
    j in 1..26, with `value` = "<missing>" for an empty field. The column salt
    keeps equal strings in different columns apart; Fingerprint64
    (`tf.strings.to_hash_bucket_fast`) is stable across platforms and TF
    versions, so serving can call this function on raw strings and get the
    training keys.

    Example:

    >>> import tensorflow as tf
    >>> keys = criteo_keys(tf.constant([["05db9164"] * 26, [""] * 26]), vocab_size=1000)
    >>> keys.shape, keys.dtype.name
    (TensorShape([2, 26]), 'int64')
    >>> bool(keys[0, 0] != keys[0, 1])  # same string, columns C1 and C2
    True
    >>> int(keys[1, 0]) == int(tf.strings.to_hash_bucket_fast("C1:<missing>", 1000))
    True

    Args:
      cat: string [..., 26], the values of C1..C26 (empty = missing).
      vocab_size: None for keys in [0, 2**62) (for a hash-table embedding), or
        N for keys in [0, N) (for a fixed-size embedding table).

    Returns:
      int64 [..., 26].
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    cat = tf.convert_to_tensor(cat, dtype=tf.string)
    prefixes = tf.constant([f"{name}:" for name in CATEGORICAL_NAMES])
    values = tf.where(tf.equal(cat, ""), MISSING_TOKEN, cat)
    salted = tf.strings.join([tf.broadcast_to(prefixes, tf.shape(values)), values])
    return tf.strings.to_hash_bucket_fast(salted, HASH_KEY_SPACE if vocab_size is None else vocab_size)

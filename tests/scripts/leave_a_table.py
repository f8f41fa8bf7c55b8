"""A coordinator that makes a TABLE_FLOATS float32 table on the ps of $TF_CONFIG, then vanishes.

It leaves by os._exit, as a killed or stopped chief does: nothing closes its
contexts, so the ps frees the table only when the context expires
($TF_PSX_KEEP_ALIVE_S after its last RPC). Prints "made" once the table is on the ps.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # pylint: disable=wrong-import-position

import tf_psx  # pylint: disable=wrong-import-position

TABLE_FLOATS = 32 * 1024 * 1024  # 128 MB: far above the ps's noise, small enough to make fast

strategy = tf_psx.ParameterServerStrategy()
with strategy.scope():
    table = tf.Variable(tf.zeros([TABLE_FLOATS // 16, 16]))
print("made", float(tf.reduce_sum(table[:1]).numpy()), flush=True)
os._exit(0)  # pylint: disable=protected-access

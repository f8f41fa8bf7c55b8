"""The training core: what a step does under a strategy beyond TF's own.

* `exact_compile`: what a model's optimizer becomes at compile.
* `exact_updates`: the per-variable lock protocol of exact async updates.
* `step_once`: a re-run step's updates applied once (step tokens, journals).
* `sync_training`, `sync_accumulators`: synchronous training and its sums.
* `stalls`: the stall doctor.

Hash tables' parts of these (their update, their sums) live with the tables,
in tf_psx.tables. Importing this package imports nothing; each module says
whether it imports TensorFlow.
"""

"""What a user without TFRA (the newest stack) gets: tf_psx's own hash tables, and for a TFRA part an error naming the extra and its stack."""

from __future__ import annotations

import pytest

import tf_psx
from tf_psx.errors import TFRAMissingError

pytestmark = [pytest.mark.unit, pytest.mark.no_tfra]


def test_dynamic_embedding_without_tfra_keeps_its_rows_in_tf_psx_tables():
    layer = tf_psx.layers.DynamicEmbedding(4)
    assert layer.store == "native"


def test_a_table_store_that_needs_tfra_names_the_extra_and_the_stack():
    with pytest.raises(TFRAMissingError, match=r"DynamicEmbedding needs tensorflow-recommenders-addons") as caught:
        tf_psx.layers.DynamicEmbedding(4, table="tfra")
    message = str(caught.value)
    assert 'pip install "tf-psx[tfra]"' in message and "TensorFlow 2.16.2" in message and "make install-tfra" in message
    assert isinstance(caught.value, RuntimeError)


def test_tfra_arguments_without_tfra_name_the_tfra_store():
    with pytest.raises(ValueError, match=r"Argument\(s\) init_capacity of DynamicEmbedding need TFRA's tables in this "
                                         r"release.*Received: table='native'.*Fix: install the TFRA stack"):
        tf_psx.layers.DynamicEmbedding(4, init_capacity=1000)


def test_everything_else_imports_without_tfra():
    import importlib  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    for name in ("tf_psx.layers", "tf_psx.callbacks", "tf_psx.optimizers", "tf_psx.strategies", "tf_psx.export",
                 "tf_psx.snapshots.engine", "tf_psx.tables", "tf_psx.tables.tfra_updates"):
        importlib.import_module(name)
    assert "tensorflow_recommenders_addons" not in sys.modules

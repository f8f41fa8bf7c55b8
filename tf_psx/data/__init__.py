"""Data for CTR training: the synthetic generator with a known optimum."""

from tf_psx.data.synthetic import SyntheticCTR, roc_auc, synthetic_ctr

__all__ = ["SyntheticCTR", "roc_auc", "synthetic_ctr"]

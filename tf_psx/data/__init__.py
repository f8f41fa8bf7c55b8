"""Data for CTR training: the synthetic generator with a known optimum."""

from tf_psx.data.synthetic import SyntheticCTR, roc_auc, synthetic_ctr
from tf_psx.data.criteo import (  # the function `criteo` shadows its module here
    CriteoMalformedLineWarning,
    CriteoReader,
    CriteoStats,
    criteo,
    criteo_dataset_fn,
    criteo_keys,
)

__all__ = ["SyntheticCTR", "roc_auc", "synthetic_ctr"]
__all__ += ["CriteoMalformedLineWarning", "CriteoReader", "CriteoStats", "criteo", "criteo_dataset_fn", "criteo_keys"]

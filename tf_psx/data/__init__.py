"""Data for CTR training: the synthetic generators with a known optimum, the Criteo reader."""

from tf_psx.data.synthetic import SyntheticCTR, describe_quality, holdout_quality, log_loss, roc_auc, synthetic_ctr
from tf_psx.data.criteo import (  # the function `criteo` shadows its module here
    CriteoMalformedLineWarning,
    CriteoReader,
    CriteoStats,
    criteo,
    criteo_dataset_fn,
    criteo_keys,
)
from tf_psx.data.synthetic_criteo import CriteoSample, write_criteo_sample

__all__ = ["SyntheticCTR", "describe_quality", "holdout_quality", "log_loss", "roc_auc", "synthetic_ctr"]
__all__ += ["CriteoMalformedLineWarning", "CriteoReader", "CriteoStats", "criteo", "criteo_dataset_fn", "criteo_keys"]
__all__ += ["CriteoSample", "write_criteo_sample"]

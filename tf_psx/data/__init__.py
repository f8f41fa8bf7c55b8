"""Data for CTR training: the synthetic generators with a known optimum, the Criteo reader.

The Criteo reader is `tf_psx.data.criteo` (`CriteoReader`, `criteo`,
`criteo_dataset_fn`) with its parts beside it: `layout` (fields, header, a
line's rules), `keys` (`criteo_keys`), `files` (paths, patterns, opening)
and `file_check` (`CriteoStats`, the malformed-line warnings).
"""

from tf_psx.data.synthetic import SyntheticCTR, describe_quality, holdout_quality, log_loss, roc_auc, synthetic_ctr
from tf_psx.data.file_check import CriteoMalformedLineWarning, CriteoStats
from tf_psx.data.keys import criteo_keys
from tf_psx.data.criteo import CriteoReader, criteo, criteo_dataset_fn  # the function `criteo` shadows its module here
from tf_psx.data.synthetic_criteo import CriteoSample, write_criteo_sample

__all__ = ["SyntheticCTR", "describe_quality", "holdout_quality", "log_loss", "roc_auc", "synthetic_ctr"]
__all__ += ["CriteoMalformedLineWarning", "CriteoReader", "CriteoStats", "criteo", "criteo_dataset_fn", "criteo_keys"]
__all__ += ["CriteoSample", "write_criteo_sample"]

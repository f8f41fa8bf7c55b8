"""`python -m tf_psx.tlsmesh`: the entry point that manifests, docs and scripts name.

The module itself is `tf_psx.cluster.tlsmesh`; this file only runs its `main`.
"""

import sys

from tf_psx.cluster.tlsmesh import main

if __name__ == "__main__":
    sys.exit(main())

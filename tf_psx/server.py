"""`python -m tf_psx.server`: the entry point that manifests, docs and scripts name.

The module itself is `tf_psx.cluster.server`; this file only runs its `main`.
"""

import sys

from tf_psx.cluster.server import main

if __name__ == "__main__":
    sys.exit(main())

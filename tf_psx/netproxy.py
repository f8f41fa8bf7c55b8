"""`python -m tf_psx.netproxy`: the entry point that manifests, docs and scripts name.

The module itself is `tf_psx.cluster.netproxy`; this file only runs its `main`.
"""

import sys

from tf_psx.cluster.netproxy import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m tf_psx.cli`: the `tf-psx` command (the console script runs `tf_psx.cli.main` too)."""

import sys

from tf_psx.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""Dies by SIGSEGV the first time, inside an import or in its own code, then runs: the check of `run_script`'s retry.

Usage: crash_once.py MARKER_FILE {import,code}
The first run (no MARKER_FILE yet) writes the file and crashes; a later
run prints `RESULT {"runs": 2}`. No TensorFlow: it checks the harness only.
"""

from __future__ import annotations

import json
import os
import signal
import sys

MARKER, WHERE = sys.argv[1], sys.argv[2]

if not os.path.exists(MARKER):
    with open(MARKER, "w", encoding="utf-8") as f:
        f.write("crashed\n")
    if WHERE == "import":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import crash_once_module  # noqa: F401  pylint: disable=unused-import,import-error
    os.kill(os.getpid(), signal.SIGSEGV)

print("RESULT " + json.dumps({"runs": 2}), flush=True)

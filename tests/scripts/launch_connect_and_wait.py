"""A chief for `tf-psx launch` tests: connects to the cluster, says so, and waits.

    python tests/scripts/launch_connect_and_wait.py STOP_FILE [TIMEOUT_S]

Creating the strategy connects to every task and starts the chief's own
server on its port, so once "tf_psx connected" is printed every port of the
cluster listens. It then waits until STOP_FILE exists (exit 0) or TIMEOUT_S
passes (exit 1), without building a model.
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tf_psx  # noqa: E402

# Long enough for the test to probe every port; short enough not to hang a run.
DEFAULT_TIMEOUT_S = 300.0
POLL_S = 0.2

stop_file = sys.argv[1]
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_TIMEOUT_S
strategy = tf_psx.ParameterServerStrategy()
print(f"tf_psx connected pid={os.getpid()} strategy={type(strategy).__name__}", flush=True)
deadline = time.monotonic() + timeout
while not os.path.exists(stop_file):
    if time.monotonic() > deadline:
        print("tf_psx connect_and_wait: timed out", flush=True)
        sys.exit(1)
    time.sleep(POLL_S)
print("tf_psx connect_and_wait: stop file seen", flush=True)

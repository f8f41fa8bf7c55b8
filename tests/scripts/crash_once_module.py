"""Imported by crash_once.py: dies by SIGSEGV while it is being imported, as a native crash in `import tensorflow` would."""

import os
import signal

os.kill(os.getpid(), signal.SIGSEGV)

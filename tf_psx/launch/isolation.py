"""`tf-psx launch --isolate`: the whole job in a private network namespace (Linux).

TensorFlow's gRPC servers have no authentication and listen on every
interface (docs/security.md). With `--isolate` the launcher runs itself again
(`python -m tf_psx.cli launch ...`) in a new network namespace, entered with
unshare(2) before exec: as root a network namespace alone, otherwise a user
namespace as well, as `unshare --net --map-root-user` does. The re-executed
launcher (`in_private_namespace()`) sets its loopback interface up
(`bring_up_loopback`) and runs the job there; nothing outside the job can
reach its ports, and the job cannot reach the network.

Importing this module does not import TensorFlow.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TextIO

from tf_psx.errors import LaunchError, NetworkSetupError
from tf_psx.launch.contract import exit_code

# Set in the re-executed launcher that already runs in its private namespace.
ISOLATED_ENV = "TF_PSX_LAUNCH_ISOLATED"
# The Linux clone flags and ioctls used by isolate=True (linux/sched.h, sockios.h).
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH22x"  # struct ifreq: the name, then the flags, padded to 40 bytes.


def require_support() -> None:
    """Raises LaunchError unless this system has network namespaces (Linux)."""
    if not sys.platform.startswith("linux"):
        raise LaunchError(
            f"Option `--isolate` needs Linux network namespaces; this is {sys.platform}. Fix: "
            "drop --isolate and keep the machine on a trusted network (docs/security.md)."
        )


def in_private_namespace() -> bool:
    """True in the launcher that `run_isolated` started (it already runs in its namespace)."""
    return os.environ.get(ISOLATED_ENV) == "1"


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def bring_up_loopback() -> None:
    """Sets `lo` up in this (fresh) network namespace, as `ip link set lo up` does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack(_IFREQ, b"lo", 0)
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


def _copy_lines(stream, target, lock: threading.Lock) -> None:
    """Copies the lines of a byte stream to target() (a text stream) until EOF."""
    try:
        for line in iter(stream.readline, b""):
            with lock:
                target().write(line.decode("utf-8", errors="replace"))
                target().flush()
    finally:
        stream.close()


def run_isolated(cli_args: Sequence[str], out: Callable[[], TextIO], err: Callable[[], TextIO],
                 lock: threading.Lock) -> int:
    """Runs `tf-psx <cli_args>` again, in a new network namespace, and waits for it.

    Args:
      cli_args: the arguments of `tf-psx` that start the same launch.
      out: where the child's stdout goes (called for each line).
      err: where the child's stderr goes (called for each line).
      lock: held while a line is written.

    Returns:
      The child's exit status (128 + N when it died of signal N).

    Raises:
      LaunchError: the namespace cannot be created.
    """
    env = dict(os.environ)
    env[ISOLATED_ENV] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()

    def _enter_namespace():  # runs in the child, before exec
        if libc.unshare(_CLONE_NEWNET) == 0:
            return
        if ctypes.get_errno() != errno.EPERM:
            raise NetworkSetupError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
        # Not root: a user namespace gives the child CAP_NET_ADMIN over a
        # network namespace of its own, as `unshare --net --map-root-user` does.
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
            raise NetworkSetupError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWNET) failed")
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w", encoding="ascii") as handle:
                handle.write(text)

    try:
        proc = subprocess.Popen(  # pylint: disable=consider-using-with
            [sys.executable, "-m", "tf_psx.cli", *cli_args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_enter_namespace,  # pylint: disable=subprocess-popen-preexec-fn
        )
    except (OSError, subprocess.SubprocessError) as error:
        raise LaunchError(
            f"Option `--isolate` could not create a private network namespace ({error}). Fix: run "
            "as root, enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), "
            "or drop --isolate and keep the machine on a trusted network (docs/security.md)."
        ) from None
    copiers = [
        threading.Thread(target=_copy_lines, args=(proc.stdout, out, lock), daemon=True),
        threading.Thread(target=_copy_lines, args=(proc.stderr, err, lock), daemon=True),
    ]
    for copier in copiers:
        copier.start()
    handlers = {}
    for signum in (signal.SIGINT, signal.SIGTERM):
        try:
            handlers[signum] = signal.signal(signum, lambda s, f: proc.send_signal(s))
        except ValueError:  # not the main thread
            pass
    try:
        code = proc.wait()
        for copier in copiers:
            copier.join()
        return exit_code(code)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)

"""Loopback ports and reachability: the one place tf_psx opens a probe socket.

`free_ports` picks ports for `LocalCluster` and `tf-psx launch`;
`port_is_listening` / `address_listens` tell whether a task accepts TCP
connections (the strategy's wait for its cluster, the sync watchdog);
`connect_seconds` times one connection (`tf-psx doctor`); `port_is_free`
tells whether this host can bind a port (the chief's, before a run).
Importing this module does not import TensorFlow.

Example:

>>> port = free_ports(1)[0]
>>> port_is_listening(port), port_is_free(port)
(False, True)
>>> split_address("[::1]:2222"), split_address("w0:2222")
(('::1', 2222), ('w0', 2222))
"""

from __future__ import annotations

import socket
import time

__all__ = [
    "LOOPBACK",
    "PROBE_TIMEOUT_S",
    "address_listens",
    "connect_seconds",
    "free_ports",
    "is_loopback_host",
    "port_is_free",
    "port_is_listening",
    "split_address",
]

LOOPBACK = "127.0.0.1"
# The bound on one connection attempt of a listening probe: a task on this
# machine or the next answers well within it, and a waiting loop tries again.
PROBE_TIMEOUT_S = 0.1
# Hosts that name this machine's loopback interface (IPv6 with or without brackets).
_LOOPBACK_PREFIXES = ("127.", "localhost", "::1", "[::1]")


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of a "host:port" or "[IPv6]:port" address; an empty host is "localhost".

    Raises:
      ValueError: the part after the last colon is not a port number.
    """
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "localhost", int(port)


def is_loopback_host(host: str) -> bool:
    """True when `host` names this machine's loopback interface ("127.x", "localhost", "::1")."""
    return host.startswith(_LOOPBACK_PREFIXES)


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Returns `count` distinct ports that are free on `host` right now.

    All sockets stay open until every port is chosen, so the ports differ.
    Another program can still take a port before the server binds it; that
    window is a few milliseconds.
    """
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def connect_seconds(host: str, port: int, timeout_s: float) -> float:
    """Opens (and closes) one TCP connection to host:port; returns the seconds it took.

    Raises:
      OSError: nothing accepts the connection within `timeout_s` (refused,
        unknown host, unreachable network, timeout).
    """
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=timeout_s):
        return time.monotonic() - start


def port_is_listening(port: int, host: str = LOOPBACK, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        connect_seconds(host, port, timeout_s)
        return True
    except OSError:
        return False


def address_listens(address: str) -> bool:
    """True when the task at "host:port" accepts TCP connections; False for an unknown host or a bad port."""
    try:
        host, port = split_address(address)
    except ValueError:  # a bad port: not reachable (yet)
        return False
    return port_is_listening(port, host)


def port_is_free(port: int, host: str = "") -> bool:
    """True when this process could bind `port` on `host` ("": every interface) right now."""
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
            return True
        except OSError:
            return False

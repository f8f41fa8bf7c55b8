"""The cost of the TLS tunnel (`tf_psx.cluster.netproxy.TLSTunnel`) against a plain relay and a direct connection.

An echo server on loopback; a client sends PAYLOAD_MB while it reads the
echo back (bytes/s counts the payload once) and times small round trips:
directly, through a plain relay (`DelayProxy` with no delay), and through a
pair of TLS tunnels (connect -> accept, mutual TLS with a self-signed CA made
by openssl). Three rounds each, interleaved; the median is kept. No target:
the issue asks for the cost to be measured.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PAYLOAD_MB, ROUNDS, SMALL_TRIPS = 64, 3, 200
CHUNK = 65536
IO_TIMEOUT_S = 60  # a relay that stops forwarding fails the run instead of hanging it


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _pki(directory):
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ca", "-keyout", "ca.key",
             "-out", "ca.pem", cwd=directory)
    for name in ("task", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=directory)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "1", "-out", f"{name}.pem", cwd=directory)
    path = lambda name: os.path.join(directory, name)  # noqa: E731
    return path("ca.pem"), (path("task.pem"), path("task.key")), (path("client.pem"), path("client.key"))


def _echo_server():
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn):
        with conn:
            while data := conn.recv(CHUNK):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server


def _measure(address) -> tuple[float, float]:
    """(MB/s of the payload, median ms of a 1-byte round trip)."""
    payload = os.urandom(CHUNK)
    total = PAYLOAD_MB * 1024 * 1024
    with socket.create_connection(address, timeout=IO_TIMEOUT_S) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        trips = []
        for _ in range(SMALL_TRIPS):
            start = time.perf_counter()
            client.sendall(b"x")
            client.recv(1)
            trips.append(time.perf_counter() - start)

        def send():
            for _ in range(total // CHUNK):
                client.sendall(payload)

        start = time.perf_counter()
        sender = threading.Thread(target=send)
        sender.start()
        received = 0
        while received < total:
            data = client.recv(CHUNK * 4)
            if not data:
                raise SystemExit(f"{address}: the connection ended after {received} of {total} bytes")
            received += len(data)
        seconds = time.perf_counter() - start
        sender.join(IO_TIMEOUT_S)
    return PAYLOAD_MB / seconds, 1000 * statistics.median(trips)


def main() -> None:
    from _common import write_result  # pylint: disable=import-outside-toplevel

    from tf_psx.cluster.netproxy import DelayProxy, TLSTunnel, tls_context  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory() as directory:
        ca, task, client = _pki(directory)
        server = _echo_server()
        echo = server.getsockname()
        relay = DelayProxy({"127.0.0.1:0": echo}, 0).start()
        accept = TLSTunnel({"127.0.0.1:0": echo}, "accept", tls_context("accept", *task, ca)).start()
        connect = TLSTunnel({"127.0.0.1:0": accept.address(0)}, "connect", tls_context("connect", *client, ca)).start()
        paths = {"direct": echo, "plain relay": relay.address(0), "TLS tunnels": connect.address(0)}
        results = {name: [] for name in paths}
        for _ in range(ROUNDS):
            for name, address in paths.items():
                results[name].append(_measure(address))
        connect.close()
        accept.close()
        relay.close()
        server.close()
    mbps = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
    rtt = {name: statistics.median(r[1] for r in runs) for name, runs in results.items()}
    rows = []
    for name in paths:
        rows.append({"metric": f"{name}: payload throughput", "value": round(mbps[name], 1), "unit": "MB/s"})
        rows.append({"metric": f"{name}: 1-byte round trip", "value": round(rtt[name], 3), "unit": "ms"})
    rows.append({"metric": "TLS tunnels / plain relay, throughput", "value": round(mbps["TLS tunnels"] / mbps["plain relay"], 3)})
    rows.append({"metric": "TLS tunnels / direct, throughput", "value": round(mbps["TLS tunnels"] / mbps["direct"], 3)})
    write_result("tls_tunnel", f"{PAYLOAD_MB} MB echoed on loopback (sent while read back) and {SMALL_TRIPS} 1-byte "
                 "round trips: directly, through a plain relay (DelayProxy, no delay), through a connect and an "
                 "accept TLSTunnel (mutual TLS, RSA 2048, self-signed CA); median of 3 interleaved rounds.",
                 rows, {"runs": results})


if __name__ == "__main__":
    main()

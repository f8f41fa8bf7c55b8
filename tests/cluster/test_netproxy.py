"""DelayProxy: the delay is really added, bytes arrive whole and in order, ends and errors are passed on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tf_psx.cluster.netproxy import READY_MARK, DelayProxy

from echo_server import EchoServer

pytestmark = pytest.mark.unit

DELAY_MS = 40
# A delayed round trip crosses the proxy twice; scheduling can only add to it.
MIN_EXTRA_RTT_S = 2 * DELAY_MS / 1000 * 0.95
ROUND_TRIPS = 5
PAYLOAD_BYTES = 3 * 1024 * 1024
WAIT_S = 30


@pytest.fixture(name="echo")
def _echo_fixture():
    server = EchoServer()
    yield server
    server.close()


def _median_rtt(address) -> float:
    with socket.create_connection(address, timeout=WAIT_S) as client:
        client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for i in range(ROUND_TRIPS):
            start = time.monotonic()
            client.sendall(bytes([i]))
            assert client.recv(1) == bytes([i])
            times.append(time.monotonic() - start)
    return sorted(times)[len(times) // 2]


def test_each_round_trip_is_delayed_twice(echo):
    direct = _median_rtt(echo.address)
    with DelayProxy({"127.0.0.1:0": echo.address}, delay_ms=DELAY_MS) as proxy:
        delayed = _median_rtt(proxy.address(0))
        stats = proxy.stats()
    assert delayed - direct >= MIN_EXTRA_RTT_S, (direct, delayed)
    (route,) = stats.values()
    assert route["connections"] == 1 and route["bytes_up"] == route["bytes_down"] == ROUND_TRIPS


def test_bytes_arrive_whole_in_order_and_the_end_is_passed_on(echo):
    payload = os.urandom(PAYLOAD_BYTES)
    with DelayProxy({"127.0.0.1:0": echo.address}, delay_ms=5) as proxy:
        with socket.create_connection(proxy.address(0), timeout=WAIT_S) as client:
            sender = threading.Thread(target=lambda: (client.sendall(payload), client.shutdown(socket.SHUT_WR)))
            sender.start()
            received = bytearray()
            while data := client.recv(65536):  # b"" only once the echo server closed after our EOF
                received += data
            sender.join(WAIT_S)
        assert bytes(received) == payload
        stats = proxy.stats()
    (route,) = stats.values()
    assert route["bytes_up"] == route["bytes_down"] == PAYLOAD_BYTES


def test_a_target_that_is_down_closes_the_client_and_is_recorded():
    free = socket.create_server(("127.0.0.1", 0))
    target = free.getsockname()
    free.close()
    with DelayProxy({"127.0.0.1:0": target}, delay_ms=1) as proxy:
        with socket.create_connection(proxy.address(0), timeout=WAIT_S) as client:
            assert client.recv(1) == b""
        deadline = time.monotonic() + WAIT_S
        while not next(iter(proxy.stats().values()))["errors"] and time.monotonic() < deadline:
            time.sleep(0.05)
        (route,) = proxy.stats().values()
    assert route["connections"] == 0 and f"connect to 127.0.0.1:{target[1]}" in route["errors"][0]


@pytest.mark.parametrize("routes, delay, match", [
    ({}, 1, "`routes` of DelayProxy must be a non-empty dict"),
    ({"127.0.0.1:1": "127.0.0.1:2"}, -1, r"`delay_ms` of DelayProxy must be a number >= 0. Received: -1"),
    ({"127.0.0.1:1": "127.0.0.1:2"}, True, r"`delay_ms`.*Received: True"),
    ({"127.0.0.1": "127.0.0.1:2"}, 1, r"listen address '127.0.0.1' must be \"host:port\".*Received: '127.0.0.1'"),
    ({"127.0.0.1:1": "host:99999"}, 1, r"target of '127.0.0.1:1' must be .*Received: 'host:99999'"),
])
def test_bad_arguments_are_named(routes, delay, match):
    with pytest.raises(ValueError, match=match):
        DelayProxy(routes, delay)


def test_a_listen_address_in_use_is_named(echo):
    port = echo.address[1]
    with pytest.raises(OSError, match=f"DelayProxy cannot listen on 127.0.0.1:{port}"):
        DelayProxy({f"127.0.0.1:{port}": echo.address}, delay_ms=1).start()


@pytest.mark.processes
def test_the_command_reports_ready_and_its_byte_counts(echo):
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    proc = subprocess.Popen(  # pylint: disable=consider-using-with
        [sys.executable, "-m", "tf_psx.netproxy", "--delay-ms", "1", f"127.0.0.1:{port}={echo.address[0]}:{echo.address[1]}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready = threading.Timer(WAIT_S, proc.kill)  # a proxy that never gets ready fails the test, not hangs it
        ready.start()
        line = proc.stdout.readline().strip()
        ready.cancel()
        assert line == READY_MARK
        assert _median_rtt(("127.0.0.1", port)) > 0
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    stats = json.loads(out.strip().splitlines()[-1])
    assert stats[f"127.0.0.1:{port}"]["bytes_up"] == ROUND_TRIPS


@pytest.mark.processes
def test_the_command_refuses_a_malformed_route():
    out = subprocess.run([sys.executable, "-m", "tf_psx.netproxy", "--delay-ms", "1", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=WAIT_S, check=False)
    assert out.returncode == 2 and "a route must be LISTEN=TARGET" in out.stderr

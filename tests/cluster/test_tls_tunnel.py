"""TLS tunnels: bytes cross encrypted, and only holders of a certificate of the cluster's CA get through."""

from __future__ import annotations

import os
import socket

import pytest

from tf_psx.cluster.netproxy import TLSTunnel, tls_context

from echo_server import EchoServer
from tls_pki import make_pki, needs_openssl, refused_without_certificate

WAIT_S = 30
PAYLOAD = os.urandom(256 * 1024)

pytestmark = [pytest.mark.unit, needs_openssl]


@pytest.fixture(name="pki", scope="module")
def _pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")))


def _round_trip(address, payload=PAYLOAD) -> bytes:
    with socket.create_connection(address, timeout=WAIT_S) as client:
        client.sendall(payload)
        received = bytearray()
        while len(received) < len(payload):
            data = client.recv(65536)
            if not data:
                break
            received += data
    return bytes(received)


def test_bytes_cross_two_tunnels_encrypted_and_whole(pki):
    echo = EchoServer()
    accept = TLSTunnel({"127.0.0.1:0": echo.address}, "accept", tls_context("accept", *pki["task"], pki["ca"])).start()
    connect = TLSTunnel({"127.0.0.1:0": accept.address(0)}, "connect",
                        tls_context("connect", *pki["client"], pki["ca"])).start()
    try:
        assert _round_trip(connect.address(0)) == PAYLOAD
        (inner,) = accept.stats().values()
        assert inner["connections"] == 1 and inner["bytes_up"] == inner["bytes_down"] == len(PAYLOAD)
        assert echo.received == len(PAYLOAD) and not accept.refused
    finally:
        connect.close()
        accept.close()
        echo.close()


@pytest.mark.parametrize("who", ["no certificate", "a foreign CA's certificate", "plain TCP"])
def test_a_client_without_the_clusters_certificate_is_refused(pki, who):
    echo = EchoServer()
    accept = TLSTunnel({"127.0.0.1:0": echo.address}, "accept", tls_context("accept", *pki["task"], pki["ca"])).start()
    try:
        if who == "plain TCP":
            with socket.create_connection(accept.address(0), timeout=WAIT_S) as raw:
                raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
                try:
                    answer = raw.recv(1024)
                except OSError:
                    answer = b""
                assert b"HTTP" not in answer
        else:
            refused_without_certificate(accept.address(0), pki["ca"], pki["rogue"] if who != "no certificate" else None)
        (route,) = accept.stats().values()
        assert route["connections"] == 0 and echo.received == 0
    finally:
        accept.close()
        echo.close()


def test_a_missing_certificate_file_is_named(tmp_path):
    with pytest.raises(OSError, match=r"The TLS certificate file '.*/none.pem' does not exist"):
        tls_context("accept", str(tmp_path / "none.pem"), str(tmp_path / "k"), str(tmp_path / "ca"))
    with pytest.raises(ValueError, match=r'`side` of tls_context must be "accept" or "connect". Received: \'both\''):
        tls_context("both", "a", "b", "c")

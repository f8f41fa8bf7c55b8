"""TLS tunnels: bytes cross encrypted, and only holders of a certificate of the cluster's CA get through."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess

import pytest

from tf_psx.netproxy import TLSTunnel, tls_context

from echo_server import EchoServer

WAIT_S = 30
REFUSAL_TIMEOUT_S = 10  # the tunnel answers a bad handshake at once; a timeout would be a hang
PAYLOAD = os.urandom(256 * 1024)

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="the test makes its certificates with openssl")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(directory, name):
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory)
    return os.path.join(directory, f"{name}.pem")


def _cert(directory, name, ca):
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=directory)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.pem", cwd=directory)
    return os.path.join(directory, f"{name}.pem"), os.path.join(directory, f"{name}.key")


@pytest.fixture(name="pki", scope="module")
def _pki(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("pki"))
    ca = _ca(directory, "cluster-ca")
    rogue_ca = _ca(directory, "rogue-ca")
    return {"ca": ca, "task": _cert(directory, "task", "cluster-ca"), "client": _cert(directory, "client", "cluster-ca"),
            "rogue": _cert(directory, "rogue", "rogue-ca"), "rogue_ca": rogue_ca}


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
        host, port = accept.address(0)
        with socket.create_connection((host, port), timeout=WAIT_S) as raw:
            if who == "plain TCP":
                raw.sendall(b"GET / HTTP/1.0\r\n\r\n")
                try:
                    answer = raw.recv(1024)
                except OSError:
                    answer = b""
                assert b"HTTP" not in answer
            else:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                context.check_hostname = False
                context.load_verify_locations(pki["ca"])
                if who != "no certificate":
                    context.load_cert_chain(*pki["rogue"])
                raw.settimeout(REFUSAL_TIMEOUT_S)
                with pytest.raises((ssl.SSLError, ConnectionError)) as refused:
                    with context.wrap_socket(raw) as tls:  # TLS 1.3: the refusal may come with the first read
                        tls.sendall(b"hello")
                        if not tls.recv(1024):
                            raise ConnectionError("closed by the tunnel")
                assert not isinstance(refused.value, socket.timeout)  # refused, not a tunnel that hangs
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

"""Test certificates (a cluster CA, task and client certificates, a foreign CA) made with openssl, and a refusal probe."""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess

import pytest

# The tunnel answers a bad handshake at once; a timeout would be a hang.
REFUSAL_TIMEOUT_S = 10

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="the test makes its certificates with openssl")


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


def make_pki(directory: str) -> dict:
    """{"ca", "task": (cert, key), "client": (cert, key), "rogue": (cert, key), "rogue_ca", "mesh_dir"}.

    "mesh_dir" holds the cluster CA and the task certificate under the names
    tf_psx.tlsmesh reads (ca.crt, tls.crt, tls.key).
    """
    ca = _ca(directory, "cluster-ca")
    rogue_ca = _ca(directory, "rogue-ca")
    pki = {"ca": ca, "task": _cert(directory, "task", "cluster-ca"), "client": _cert(directory, "client", "cluster-ca"),
           "rogue": _cert(directory, "rogue", "rogue-ca"), "rogue_ca": rogue_ca}
    mesh_dir = os.path.join(directory, "mesh")
    os.makedirs(mesh_dir)
    for source, name in ((ca, "ca.crt"), (pki["task"][0], "tls.crt"), (pki["task"][1], "tls.key")):
        shutil.copy(source, os.path.join(mesh_dir, name))
    pki["mesh_dir"] = mesh_dir
    return pki


def refused_without_certificate(address, ca: str, cert: tuple | None = None) -> str:
    """Connects with TLS and no client certificate (or `cert`); returns the error that refused it.

    Raises AssertionError if the handshake and a first exchange succeed, or if
    the refusal took a timeout (a tunnel that hangs instead of refusing).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(ca)
    if cert is not None:
        context.load_cert_chain(*cert)
    with socket.create_connection(address, timeout=REFUSAL_TIMEOUT_S) as raw:
        try:
            with context.wrap_socket(raw) as tls:  # TLS 1.3: the refusal may come with the first read
                tls.sendall(b"hello")
                if not tls.recv(1024):
                    return "closed by the tunnel"
        except socket.timeout as err:
            raise AssertionError(f"{address}: no answer within {REFUSAL_TIMEOUT_S} s instead of a refusal") from err
        except (ssl.SSLError, ConnectionError) as err:
            return repr(err)
    raise AssertionError(f"{address} accepted a client without the cluster's certificate")

"""A loopback echo server for the relay tests (not a test module)."""

from __future__ import annotations

import socket
import threading


class EchoServer:
    """Every connection gets its bytes back, then EOF after the client's EOF; `received` counts the bytes."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = self.sock.getsockname()
        self.received = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn):
        with conn:
            while data := conn.recv(65536):
                with self._lock:
                    self.received += len(data)
                conn.sendall(data)

    def close(self):
        self.sock.close()

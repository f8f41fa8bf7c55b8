"""Userspace TCP relays: network latency without `tc netem` (`DelayProxy`), and TLS tunnels (`TLSTunnel`).

`DelayProxy` listens on one address per route and relays every connection to
the route's target, holding each chunk of bytes for `delay_ms` in each
direction, in order. A round trip through it therefore takes `2 * delay_ms`
longer; bandwidth is not limited. It needs no root and no kernel module, so
latency tests run where the netem qdisc is missing (the multi-host test
routes every task's gRPC port through it when `tc qdisc add ... netem`
fails).

Put it between the tasks of a cluster by giving `TF_CONFIG` the proxy's
addresses: TensorFlow's server binds its port on every interface, so a task
whose cluster address is `PROXY_HOST:PORT` still listens on `PORT` on its own
host, and the proxy (on another host or network namespace) forwards
`PROXY_HOST:PORT` to `TASK_HOST:PORT`.

Example:

>>> import socket, threading, time
>>> echo = socket.create_server(("127.0.0.1", 0))
>>> def serve():
...     conn, _ = echo.accept()
...     with conn:
...         while data := conn.recv(1024):
...             conn.sendall(data)
>>> _ = threading.Thread(target=serve, daemon=True).start()
>>> with DelayProxy({"127.0.0.1:0": echo.getsockname()}, delay_ms=25) as proxy:
...     client = socket.create_connection(proxy.address(0))
...     start = time.monotonic()
...     client.sendall(b"ping")
...     reply = client.recv(1024)
...     rtt_ms = 1000 * (time.monotonic() - start)
...     client.close()
>>> reply, rtt_ms >= 50
(b'ping', True)
>>> echo.close()

From a shell (the proxy prints `tf_psx.netproxy ready` once it listens, and
its byte counts when SIGTERM or SIGINT stop it):

    python -m tf_psx.netproxy --delay-ms 20 10.0.0.254:2222=10.0.0.1:2222

`TLSTunnel` is the same relay with mutual TLS on one side (encrypted links
between hosts, only holders of a certificate of the cluster's CA get in):

    python -m tf_psx.netproxy --tls accept --cert task.pem --key task.key --ca ca.pem 0.0.0.0:3222=127.0.0.1:2222
    python -m tf_psx.netproxy --tls connect --cert client.pem --key client.key --ca ca.pem 127.0.0.1:4222=host1:3222

Known limitations:
  * One thread per connection direction: meant for the few long-lived gRPC
    connections of a test cluster, not for thousands of clients.
  * The delay is per chunk read (up to `CHUNK_BYTES`), applied on the
    relay's clock; there is no jitter, loss or rate limit.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import Mapping

from tf_psx.errors import ArgumentError, MissingFileError, NetworkSetupError

# Printed (with flush) once every route listens; tests and scripts wait for it.
READY_MARK = "tf_psx.netproxy ready"
# Bytes read per recv: one gRPC frame is at most 16 KiB by default, so a
# chunk carries a few frames and the per-chunk overhead stays small.
CHUNK_BYTES = 65536
# How long a relay thread waits before it checks whether the proxy closed.
POLL_S = 0.2
# Chunks read ahead of a slow sink, per direction (16 MB at most): then the reader waits.
QUEUED_CHUNKS = 256
# Connecting to a target: a task that is not up yet is a refused connection at once,
# a host that does not answer is bounded by this.
CONNECT_TIMEOUT_S = 10.0
# close() waits at most this long for each relay thread.
JOIN_TIMEOUT_S = 5.0
_ADDRESS_FORM = '"host:port" or a (host, port) pair'


def _address(value, field: str) -> tuple[str, int]:
    """(host, port) from "host:port" or a pair; ValueError naming `field` otherwise."""
    host, port = None, None
    if isinstance(value, str):
        host, _, port_text = value.rpartition(":")
        port = int(port_text) if port_text.isdigit() else None
    elif isinstance(value, (tuple, list)) and len(value) == 2:
        host, port = value
    if not host or isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ArgumentError(
            f"{field} must be {_ADDRESS_FORM} with a port in 0..65535. Received: {value!r}. "
            'Fix: pass e.g. "127.0.0.1:2222".'
        )
    return str(host).strip("[]"), port


def _parse_routes(routes, owner: str) -> list:
    """[_Route] of {listen: target}; ValueError naming `owner`, the route and the fix otherwise."""
    if not isinstance(routes, Mapping) or not routes:
        raise ArgumentError(
            f"Argument `routes` of {owner} must be a non-empty dict {{listen: target}}. Received: {routes!r}. "
            'Fix: pass e.g. {"127.0.0.1:3222": "127.0.0.1:2222"}.'
        )
    return [_Route(_address(listen, f"{owner} route listen address {listen!r}"),
                   _address(target, f"{owner} route target of {listen!r}"))
            for listen, target in routes.items()]


class _Route:
    """One listening socket and the connections it relays."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]):
        self.listen, self.target = listen, target
        self.connections = 0
        self.bytes_up = 0  # client -> target
        self.bytes_down = 0  # target -> client
        self.errors: list[str] = []
        self.sock: socket.socket | None = None
        self.bound = listen  # the real address once listening (port 0 picks one)


class DelayProxy:
    """Relays TCP connections, each byte delayed by `delay_ms` in each direction.

    Args:
      routes: {listen address: target address}, each "host:port" or a
        (host, port) pair. A listen port of 0 picks a free port (see
        `address()`).
      delay_ms: float >= 0, the one-way delay added to every byte.

    Raises:
      ValueError: a malformed address or delay.
      OSError: from `start()`, naming the address, when a listen address
        cannot be bound (in use, or not an address of this host).
    """

    def __init__(self, routes: Mapping, delay_ms: float):
        if isinstance(delay_ms, bool) or not isinstance(delay_ms, (int, float)) or not delay_ms >= 0:
            raise ArgumentError(f"Argument `delay_ms` of DelayProxy must be a number >= 0. Received: {delay_ms!r}. "
                                "Fix: pass e.g. delay_ms=20.")
        self.delay_s = float(delay_ms) / 1000.0
        self._routes = _parse_routes(routes, "DelayProxy")
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> "DelayProxy":
        """Binds every listen address and starts relaying; returns self."""
        for route in self._routes:
            try:
                route.sock = socket.create_server(route.listen, reuse_port=False)
            except OSError as err:
                self.close()
                raise NetworkSetupError(err.errno, f"DelayProxy cannot listen on {route.listen[0]}:{route.listen[1]}: "
                                                   f"{err.strerror}. Fix: pick a free port on an address of this host.") from err
            route.sock.settimeout(POLL_S)
            route.bound = route.sock.getsockname()[:2]
            self._spawn(self._accept, route)
        return self

    def address(self, index: int) -> tuple[str, int]:
        """The (host, port) route `index` listens on (its real port when 0 was asked)."""
        return self._routes[index].bound

    def stats(self) -> dict[str, dict]:
        """{listen "host:port": {target, connections, bytes_up, bytes_down, errors}}."""
        with self._lock:
            return {f"{host}:{port}": {"target": f"{r.target[0]}:{r.target[1]}", "connections": r.connections,
                                       "bytes_up": r.bytes_up, "bytes_down": r.bytes_down, "errors": list(r.errors)}
                    for r, (host, port) in ((r, self.address(i)) for i, r in enumerate(self._routes))}

    def close(self) -> None:
        """Stops listening, drops every connection and joins the relay threads (bounded)."""
        self._closed.set()
        for route in self._routes:
            if route.sock is not None:
                route.sock.close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:
            _close_quietly(sock)
        for thread in list(self._threads):
            if thread is not threading.current_thread():
                thread.join(JOIN_TIMEOUT_S)

    def __enter__(self) -> "DelayProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- relaying ---------------------------------------------------------------

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"tf_psx.netproxy.{target.__name__}")
        self._threads.append(thread)
        thread.start()

    def _accept(self, route: _Route) -> None:
        while not self._closed.is_set():
            try:
                client, _ = route.sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(route.target, timeout=CONNECT_TIMEOUT_S)
            except OSError as err:
                with self._lock:
                    route.errors.append(f"connect to {route.target[0]}:{route.target[1]}: {err}")
                _close_quietly(client)
                continue
            with self._lock:
                route.connections += 1
                self._sockets += [client, upstream]
                self._threads = [thread for thread in self._threads if thread.is_alive()]
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(POLL_S)
            ends = [0]  # directions finished; the second closes both sockets
            for source, sink, field in ((client, upstream, "bytes_up"), (upstream, client, "bytes_down")):
                chunks: queue.Queue = queue.Queue(maxsize=QUEUED_CHUNKS)
                self._spawn(self._read, route, source, chunks, field)
                self._spawn(self._write, sink, chunks, (client, upstream), ends)

    def _put(self, chunks: queue.Queue, item) -> bool:
        """Queues `item`, waiting while the queue is full (the sink is slow); False once closed."""
        while not self._closed.is_set():
            try:
                chunks.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _read(self, route: _Route, source: socket.socket, chunks: queue.Queue, field: str) -> None:
        """Stamps each chunk with the time it may leave; None marks the end of the stream."""
        while not self._closed.is_set():
            try:
                data = source.recv(CHUNK_BYTES)
            except socket.timeout:
                continue
            except OSError:
                data = b""
            if not data:
                break
            with self._lock:
                setattr(route, field, getattr(route, field) + len(data))
            if not self._put(chunks, (time.monotonic() + self.delay_s, data)):
                return
        self._put(chunks, None)

    def _send(self, sink: socket.socket, data: bytes) -> bool:
        """Sends all of `data`; a peer slow to read is waited for (the socket's timeout is only a poll)."""
        view = memoryview(data)
        while view:
            if self._closed.is_set():
                return False
            try:
                view = view[sink.send(view):]
            except socket.timeout:
                continue
            except OSError:
                return False
        return True

    def _write(self, sink: socket.socket, chunks: queue.Queue, pair: tuple, ends: list) -> None:
        ok = True
        while ok and not self._closed.is_set():
            try:
                item = chunks.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                break
            due, data = item
            wait = due - time.monotonic()
            if wait > 0 and self._closed.wait(wait):
                return
            ok = self._send(sink, data)
        # The peer finished sending (or the sink failed): pass the end on.
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            ok = False
        with self._lock:
            ends[0] += 1
            done = ends[0] == 2 or not ok
            if done:
                self._sockets = [sock for sock in self._sockets if sock not in pair]
        if done:
            for sock in pair:
                _close_quietly(sock)


# ----------------------------------------------------------------------------
# TLS tunnels


# TLS below 1.2 is broken; every Python 3.11 build has 1.2 and 1.3.
_MIN_TLS = "TLSv1_2"


def tls_context(side: str, cert: str, key: str, ca: str):
    """A mutual-TLS `ssl.SSLContext` for one side of a tunnel.

    Both sides present a certificate signed by the cluster's CA and accept
    only peers that do: trust is "holds a certificate of this cluster's CA",
    not a host name (`check_hostname` is off), so one CA and one certificate
    per task (or per cluster) are enough.

    Args:
      side: "accept" (the end in front of a task's port) or "connect" (the
        end a local client talks to).
      cert, key: this side's certificate and private key (PEM files).
      ca: the CA certificate (PEM) that signed every certificate of the cluster.

    Raises:
      ValueError: a bad `side`; OSError or ssl.SSLError naming the file that
        cannot be read.
    """
    import ssl  # pylint: disable=import-outside-toplevel

    if side not in ("accept", "connect"):
        raise ArgumentError(f'Argument `side` of tls_context must be "accept" or "connect". Received: {side!r}. '
                            'Fix: "accept" in front of a task\'s port, "connect" for the clients of a remote one.')
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if side == "accept" else ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = getattr(ssl.TLSVersion, _MIN_TLS)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_REQUIRED
    for path, what in ((cert, "certificate"), (key, "private key"), (ca, "CA certificate")):
        if not os.path.isfile(path):
            raise MissingFileError(f"The TLS {what} file {path!r} does not exist. Fix: pass the PEM file's path.")
    context.load_cert_chain(cert, key)
    context.load_verify_locations(ca)
    return context


class TLSTunnel:
    """Relays TCP connections with TLS on one side: in front of a task, or towards one.

    An "accept" tunnel listens with TLS (mutual: the client must show a
    certificate of the cluster's CA) and forwards plain bytes to a local
    port; a "connect" tunnel listens in plain (on loopback) and forwards
    over TLS to an "accept" tunnel. Put an accept tunnel in front of each
    task's port on every host and point local clients at connect tunnels:
    the bytes between hosts are encrypted and only holders of a cluster
    certificate get through. One asyncio loop on one thread serves every
    connection (OpenSSL objects must not be shared between threads).

    Args:
      routes: {listen address: target address}, as for `DelayProxy`.
      side: "accept" or "connect".
      context: the `ssl.SSLContext` of that side (`tls_context`).

    Known limitations:
      * TensorFlow's gRPC server still listens in plain on every interface
        (its bind address is fixed); the tunnel encrypts the traffic that
        goes through it, and only a firewall, a network policy or a network
        namespace (`tf-psx launch --isolate`) keeps other hosts off the
        plain port. `tf_psx.tlsmesh` sets the tunnels of a whole cluster up
        from its TF_CONFIG.
    """

    def __init__(self, routes: Mapping, side: str, context):
        if side not in ("accept", "connect"):
            raise ArgumentError(f'Argument `side` of TLSTunnel must be "accept" or "connect". Received: {side!r}. '
                                'Fix: "accept" in front of a task\'s port, "connect" for the clients of a remote one.')
        self.side, self.context = side, context
        self._routes = _parse_routes(routes, "TLSTunnel")
        self._loop = None
        self._thread: threading.Thread | None = None
        self._servers: list = []
        self._writers: set = set()
        self._lock = threading.Lock()
        self.refused: list[str] = []  # TLS handshakes that failed (no or a foreign certificate)

    def _on_loop_error(self, loop, context) -> None:
        del loop
        error = context.get("exception")
        with self._lock:
            self.refused.append(f"{context.get('message', 'error')}: {error!r}")

    def start(self) -> "TLSTunnel":
        import asyncio  # pylint: disable=import-outside-toplevel

        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._on_loop_error)
        started = threading.Event()
        failure: list[BaseException] = []

        def run():
            asyncio.set_event_loop(self._loop)
            try:
                self._loop.run_until_complete(self._listen())
            except OSError as err:
                failure.append(err)
            started.set()
            if not failure:
                self._loop.run_forever()

        self._thread = threading.Thread(target=run, daemon=True, name="tf_psx.cluster.netproxy.TLSTunnel")
        self._thread.start()
        if not started.wait(CONNECT_TIMEOUT_S):
            self.close()
            raise NetworkSetupError(f"TLSTunnel did not listen within {CONNECT_TIMEOUT_S:g} s on "
                                    f"{', '.join(f'{r.listen[0]}:{r.listen[1]}' for r in self._routes)}.")
        if failure:
            self.close()
            raise failure[0]
        return self

    async def _listen(self) -> None:
        import asyncio  # pylint: disable=import-outside-toplevel

        for route in self._routes:
            try:
                server = await asyncio.start_server(
                    lambda r, w, route=route: self._relay(route, r, w), route.listen[0], route.listen[1],
                    ssl=self.context if self.side == "accept" else None,
                    ssl_handshake_timeout=CONNECT_TIMEOUT_S if self.side == "accept" else None)
            except OSError as err:
                for started in self._servers:
                    started.close()
                raise NetworkSetupError(err.errno, f"TLSTunnel cannot listen on {route.listen[0]}:{route.listen[1]}: "
                                                   f"{err.strerror}. Fix: pick a free port on an address of this host.") from err
            route.bound = server.sockets[0].getsockname()[:2]
            self._servers.append(server)

    async def _relay(self, route: _Route, reader, writer) -> None:
        import asyncio  # pylint: disable=import-outside-toplevel

        try:
            target_reader, target_writer = await asyncio.wait_for(asyncio.open_connection(
                route.target[0], route.target[1], ssl=self.context if self.side == "connect" else None,
                server_hostname="" if self.side == "connect" else None), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as err:
            with self._lock:
                route.errors.append(f"connect to {route.target[0]}:{route.target[1]}: {err!r}")
            writer.close()
            return
        with self._lock:
            route.connections += 1
            self._writers.update((writer, target_writer))

        async def pump(source, sink, field):
            try:
                while data := await source.read(CHUNK_BYTES):
                    with self._lock:
                        setattr(route, field, getattr(route, field) + len(data))
                    sink.write(data)
                    await sink.drain()
                if sink.can_write_eof():  # pass the end on; the other direction may still answer
                    sink.write_eof()
            except (OSError, asyncio.IncompleteReadError, RuntimeError):
                sink.close()

        await asyncio.gather(pump(reader, target_writer, "bytes_up"), pump(target_reader, writer, "bytes_down"))
        for sink in (writer, target_writer):
            sink.close()
        with self._lock:
            self._writers.difference_update((writer, target_writer))

    def address(self, index: int) -> tuple[str, int]:
        return self._routes[index].bound

    def stats(self) -> dict[str, dict]:
        with self._lock:
            return {f"{r.bound[0]}:{r.bound[1]}": {"target": f"{r.target[0]}:{r.target[1]}",
                                                   "connections": r.connections, "bytes_up": r.bytes_up,
                                                   "bytes_down": r.bytes_down, "errors": list(r.errors)}
                    for r in self._routes}

    def close(self) -> None:
        loop = self._loop
        if loop is None:
            return
        self._loop = None

        def stop():
            for server in self._servers:
                server.close()
            with self._lock:
                writers = list(self._writers)
            for writer in writers:
                writer.close()
            loop.stop()

        if self._thread is not None and self._thread.is_alive():
            loop.call_soon_threadsafe(stop)
            self._thread.join(JOIN_TIMEOUT_S)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> "TLSTunnel":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _close_quietly(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    """`python -m tf_psx.netproxy --delay-ms MS LISTEN=TARGET ...`; runs until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog="python -m tf_psx.netproxy", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added to every byte")
    parser.add_argument("--tls", choices=("accept", "connect"),
                        help="a TLS tunnel instead: accept (TLS in, plain to the target) or connect (plain in, TLS out)")
    parser.add_argument("--cert", help="with --tls: this side's certificate (PEM)")
    parser.add_argument("--key", help="with --tls: this side's private key (PEM)")
    parser.add_argument("--ca", help="with --tls: the cluster's CA certificate (PEM)")
    parser.add_argument("routes", nargs="+", metavar="LISTEN=TARGET", help="e.g. 10.0.0.254:2222=10.0.0.1:2222")
    args = parser.parse_args(argv)
    routes = {}
    for text in args.routes:
        listen, sep, target = text.partition("=")
        if not sep:
            parser.error(f"a route must be LISTEN=TARGET, e.g. 127.0.0.1:3222=127.0.0.1:2222; received {text!r}")
        routes[listen] = target
    if args.tls and not (args.cert and args.key and args.ca):
        parser.error("--tls needs --cert, --key and --ca (PEM files)")
    try:
        if args.tls:
            proxy = TLSTunnel(routes, args.tls, tls_context(args.tls, args.cert, args.key, args.ca)).start()
        else:
            proxy = DelayProxy(routes, args.delay_ms).start()
    except (ValueError, OSError) as err:
        print(f"tf_psx.netproxy: {err}", file=sys.stderr, flush=True)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    print(READY_MARK, flush=True)
    while not stop.wait(POLL_S):
        pass
    proxy.close()
    print(json.dumps(proxy.stats()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

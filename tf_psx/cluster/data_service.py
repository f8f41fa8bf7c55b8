"""The tf.data service beside a cluster: a dispatcher and data workers that read and parse the input.

`fit` reads its input on the coordinator and sends each step's batches
with the step (tf_psx._tf.fit_inputs): that makes an epoch exact, and
bounds the input rate by one process. Where that process cannot read and
parse fast enough, the pipeline can run on tf.data service workers (on any
hosts) while the coordinator only receives ready batches:

    with tf_psx.LocalCluster(num_workers=2, num_ps=1, data_workers=2) as cluster:
        ...
        dataset = dataset.apply(tf.data.experimental.service.distribute(
            processing_mode="distributed_epoch", service=cluster.data_service))
        model.fit(dataset, epochs=3)

In "distributed_epoch" mode the dispatcher hands each split of the source
(files, or ranges of `from_tensor_slices` / `range`) to one data worker, so
each element is read once per pass while nothing fails, and the epochs of
`fit` stay exact (every batch the coordinator receives is one step).

Processes: `python -m tf_psx.cluster.data_service dispatcher --port P` and
`python -m tf_psx.cluster.data_service worker --port Q --dispatcher HOST:P`;
each prints `tf_psx.server.READY_MARK` once it listens and stops on SIGTERM
(exit status 0), as `tf_psx.server` does, so `LocalCluster(processes=True)`
and `tf-psx launch --data-workers N` supervise them like their other tasks.
Under the launcher the chief finds the address in `$TF_PSX_DATA_SERVICE`;
`service_address(cluster)` gives either:

    with tf_psx.launched_or(tf_psx.LocalCluster(2, 1, data_workers=2)) as cluster:
        service = data_service.service_address(cluster)  # from tf_psx.cluster import data_service

Known limitations:
  * With more than one data worker the order of the elements differs from
    run to run, so a resumed `fit` skips to the right step of another order
    (examples of the resumed epoch can repeat or be missed); an exact resume
    needs one data worker or the coordinator's own reading.
  * A data worker that dies loses the elements of its split in that pass
    (the tf.data service visits each element at most once).
  * A source that cannot be split (`from_generator`, a Python iterator)
    cannot use "distributed_epoch".
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from tf_psx.cluster.server import READY_MARK, SIGNAL_POLL_S

DISPATCHER, WORKER = "data_dispatcher", "data_worker"
TASK_TYPES = (DISPATCHER, WORKER)
# The dispatcher's address, in the environment of a launched chief.
ENV = "TF_PSX_DATA_SERVICE"
_MODULE = "tf_psx.cluster.data_service"


def address(port: int, host: str = "127.0.0.1") -> str:
    """The service address `distribute(service=...)` takes."""
    return f"grpc://{host}:{port}"


def service_address(cluster=None) -> str:
    """The dispatcher of `cluster` (a started LocalCluster with data workers) or, without one, of `$TF_PSX_DATA_SERVICE`.

    Raises:
      StateError: neither has one.
    """
    from tf_psx.errors import StateError  # pylint: disable=import-outside-toplevel

    found = getattr(cluster, "data_service", None) if cluster is not None else os.environ.get(ENV)
    if not found:
        where = "this LocalCluster" if cluster is not None else f"${ENV} (set by tf-psx launch --data-workers N)"
        raise StateError(f"No tf.data service: {where} has none. Fix: LocalCluster(..., data_workers=2), or "
                         "tf-psx launch --data-workers 2.")
    return found


def task_commands(ports: list[int], host: str = "127.0.0.1") -> list[tuple[tuple[str, int], list[str]]]:
    """((task type, index), argv) of a dispatcher on ports[0] and a data worker on each further port."""
    module = [sys.executable, "-m", _MODULE]
    commands = [((DISPATCHER, 0), [*module, "dispatcher", "--port", str(ports[0])])]
    commands += [((WORKER, index), [*module, "worker", "--port", str(port), "--dispatcher", f"{host}:{ports[0]}",
                                    "--host", host]) for index, port in enumerate(ports[1:])]
    return commands


def task_env(base) -> dict[str, str]:
    """The environment of a dispatcher or data worker process: no TF_CONFIG, no GPU, quiet TF, unbuffered lines."""
    from tf_psx.cluster import TF_CONFIG_ENV  # pylint: disable=import-outside-toplevel

    env = {key: value for key, value in base.items() if key not in (TF_CONFIG_ENV, ENV)}
    env.update(PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _dispatcher(port: int):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    service = tf.data.experimental.service
    return service.DispatchServer(service.DispatcherConfig(port=port))


def _worker(port: int, dispatcher: str, host: str):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel

    service = tf.data.experimental.service
    return service.WorkerServer(service.WorkerConfig(dispatcher_address=dispatcher, worker_address=f"{host}:{port}",
                                                     port=port))


def start_in_process(port: int, num_workers: int, worker_ports: list[int]) -> list:
    """Starts a dispatcher on `port` and `num_workers` data workers in this process; returns the servers."""
    return [_dispatcher(port)] + [_worker(worker_port, f"127.0.0.1:{port}", "127.0.0.1")
                                  for worker_port in worker_ports[:num_workers]]


def main(argv: list[str] | None = None) -> int:
    """Runs a dispatcher or a data worker until SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(prog=f"python -m {_MODULE}")
    parser.add_argument("role", choices=("dispatcher", "worker"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dispatcher", help="HOST:PORT of the dispatcher (role worker)")
    parser.add_argument("--host", default="127.0.0.1", help="the address other processes reach this one at")
    args = parser.parse_args(argv)
    if args.role == "worker" and not args.dispatcher:
        print("tf_psx.cluster.data_service: a worker needs --dispatcher HOST:PORT; received none. "
              "Fix: pass the dispatcher's address.", file=sys.stderr, flush=True)
        return 2

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if args.role == "dispatcher":
        server, name = _dispatcher(args.port), f"{DISPATCHER}:0"
    else:
        server, name = _worker(args.port, args.dispatcher, args.host), f"{WORKER}:{args.port}"
    print(f"{READY_MARK} {name} pid={os.getpid()}", flush=True)
    while not stop.wait(SIGNAL_POLL_S):
        pass
    del server
    os._exit(0)  # pylint: disable=protected-access  (gRPC servers have no clean shutdown in TF 2.16)


if __name__ == "__main__":
    sys.exit(main())

"""`tf-psx k8s`: write the Kubeflow TFJob manifest of a parameter-server job (tf_psx.cluster.k8s)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import yaml

from tf_psx.cli.common import EXIT_OK, PROG
from tf_psx.cluster import k8s_data as _k8s_data
from tf_psx.cluster.k8s import DEFAULT_PORT, ManifestError, network_policy, tfjob_manifest
from tf_psx.errors import CommandError


# tfjob_manifest argument -> how `tf-psx k8s` names it in an error.
_K8S_OPTION_LABELS = {
    "name": "Option `--name`",
    "image": "Option `--image`",
    "command": "The command after `--`",
    "workers": "Option `--workers`",
    "ps": "Option `--ps`",
    "cpu": "Option `--cpu`",
    "memory": "Option `--memory`",
    "gpus": "Option `--gpus`",
    "namespace": "Option `--namespace`",
    "port": "Option `--port`",
    "tls_secret": "Option `--tls-secret`",
    "data_workers": "Option `--data-workers`",
}


def _add_k8s(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "k8s",
        help="write a Kubeflow TFJob manifest",
        description=(
            "Write the Kubeflow TFJob (kubeflow.org/v1) of a parameter-server job as YAML: one "
            "Chief running CMD, --workers Workers and --ps PS running python -m tf_psx.server, "
            "and with --evaluator one Evaluator running CMD. Example: tf-psx k8s --name ctr "
            "--image registry.example.com/ctr:1 --workers 4 --ps 2 -- python train.py"
        ),
    )
    parser.add_argument("--name", required=True, help="the TFJob name (lowercase letters, digits, '-')")
    parser.add_argument("--image", required=True, help="the container image of every replica")
    parser.add_argument("--workers", required=True, type=int, metavar="N", help="the number of workers")
    parser.add_argument("--ps", required=True, type=int, metavar="M", help="the number of parameter servers")
    parser.add_argument("--evaluator", action="store_true", help="add an Evaluator replica running CMD")
    parser.add_argument("--cpu", help='CPU request and limit of every container, e.g. "4" or "500m"')
    parser.add_argument("--memory", help='memory request and limit of every container, e.g. "16Gi"')
    parser.add_argument("--gpus", type=int, default=0, metavar="G", help="GPUs of the chief and each worker")
    parser.add_argument("--namespace", help="metadata.namespace (default: left to kubectl)")
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"the port of every task (default: {DEFAULT_PORT})"
    )
    parser.add_argument(
        "--tls-secret", metavar="SECRET",
        help="the tasks talk over mutual TLS only (tf_psx.tlsmesh), with the certificates of this secret "
             "(ca.crt, tls.crt, tls.key); a NetworkPolicy admitting only --port is written too",
    )
    parser.add_argument(
        "--data-workers", type=int, default=0, metavar="N",
        help="add a tf.data service: a dispatcher and N data workers (Deployments); the Chief gets its address "
             "in $TF_PSX_DATA_SERVICE",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write the YAML to FILE instead of stdout")
    parser.add_argument("command", nargs="*", metavar="CMD", help="after --: the chief's command")
    parser.set_defaults(run=_run_k8s)


def _run_k8s(args: argparse.Namespace) -> int:
    if not args.command:
        raise CommandError(
            "The command after `--` is missing; received no CMD (the Chief's and the Evaluator's "
            "command). Fix: end the options with --, then the command, e.g. -- python train.py."
        )
    try:
        manifest = tfjob_manifest(
            name=args.name,
            image=args.image,
            command=args.command,
            workers=args.workers,
            ps=args.ps,
            evaluator=args.evaluator,
            cpu=args.cpu,
            memory=args.memory,
            gpus=args.gpus,
            namespace=args.namespace,
            port=args.port,
            tls_secret=args.tls_secret,
        )
        documents = [manifest]
        if args.tls_secret is not None:
            documents.append(network_policy(args.name, namespace=args.namespace, port=args.port))
        if args.data_workers:
            resources = manifest["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]["containers"][0].get("resources")
            documents += _k8s_data.data_service_manifests(args.name, args.image, args.data_workers, args.namespace,
                                                          resources, args.tls_secret)
            _k8s_data.give_address(manifest)
    except ManifestError as err:
        label = _K8S_OPTION_LABELS.get(err.argument)
        raise CommandError(err.renamed(label) if label else str(err)) from None
    text = yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)
    replicas = {rtype: spec["replicas"] for rtype, spec in manifest["spec"]["tfReplicaSpecs"].items()}
    summary = ", ".join(f"{count} {rtype}" for rtype, count in replicas.items())
    if args.tls_secret is not None:
        summary += "; TLS only, with its NetworkPolicy"
    if args.data_workers:
        summary += f"; a tf.data service of {args.data_workers} data worker(s)"
    if args.output is None:
        sys.stdout.write(text)
        print(f"{PROG} k8s: wrote TFJob {args.name} ({summary}) to stdout", file=sys.stderr)
        return EXIT_OK
    try:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    except OSError as err:
        raise CommandError(
            f'Option `-o` FILE "{args.output}" cannot be written ({err}). Fix: pass a path in an '
            "existing, writable directory, or leave out -o to write to stdout."
        ) from None
    print(
        f"{PROG} k8s: wrote TFJob {args.name} ({summary}) to {args.output}; "
        f"start it with: kubectl apply -f {args.output}",
        file=sys.stderr,
    )
    return EXIT_OK

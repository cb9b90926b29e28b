"""`ecrec-operator`: run the kopf operator for ECRecJobs (all namespaces, or the ones given).

`--health-port` serves kopf's liveness endpoint (`/healthz`, for the Deployment's liveness and readiness
probes); `--config` (or $ECREC_OPERATOR_CONFIG) names a YAML/JSON file of job-pod defaults (`render.PodDefaults`:
security contexts, default images, labels, the per-job NetworkPolicy), the Helm chart's ConfigMap.
"""

from __future__ import annotations

import argparse
import logging
import os

import kopf
from kubernetes import config as k8s_config
from prometheus_client import start_http_server

from . import render


@kopf.on.startup()
def _configure(settings: kopf.OperatorSettings, **_) -> None:
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 60
    # Progress is kept in annotations: the CRD's status schema prunes fields it does not know.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="ecrec.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="ecrec.dev")
    settings.persistence.finalizer = "ecrec.dev/operator"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="ecrec-operator")
    ap.add_argument("--namespace", action="append", help="watch only these namespaces (default: all)")
    ap.add_argument("--metrics-port", type=int, default=0, help="serve /metrics on this port (0: off)")
    ap.add_argument("--metrics-addr", default="127.0.0.1")
    ap.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="serve kopf's liveness endpoint /healthz on this port (0: off)",
    )
    ap.add_argument("--health-addr", default="127.0.0.1")
    ap.add_argument(
        "--config",
        default=os.environ.get("ECREC_OPERATOR_CONFIG"),
        help="YAML/JSON file of job-pod defaults (default: $ECREC_OPERATOR_CONFIG; unset: built-in defaults)",
    )
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.config:  # before anything runs: a bad config stops the operator with one line
        try:
            render.configure(render.PodDefaults.load(args.config))
        except (OSError, ValueError, TypeError) as e:
            ap.exit(2, f"ecrec-operator: --config {args.config}: {e}\n")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s operator %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if not args.verbose:  # kopf logs every successful timer pass (once a second per job)
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    try:  # the kubernetes client (pods, services) logs in like kopf: in-cluster, else KUBECONFIG
        k8s_config.load_incluster_config()
    except k8s_config.ConfigException:
        k8s_config.load_kube_config()
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_addr)
    from . import handlers  # noqa: F401 - registers the handlers

    liveness = None
    if args.health_port:
        host = f"[{args.health_addr}]" if ":" in args.health_addr else args.health_addr
        liveness = f"http://{host}:{args.health_port}/healthz"
    kopf.run(
        standalone=True,
        namespaces=args.namespace or (),
        clusterwide=not args.namespace,
        liveness_endpoint=liveness,
    )


if __name__ == "__main__":
    main()

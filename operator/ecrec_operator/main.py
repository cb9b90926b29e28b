"""`ecrec-operator`: run the kopf operator for ECRecJobs (all namespaces, or the ones given).

`--health-port` serves kopf's liveness endpoint (`/healthz`, for the Deployment's liveness and readiness
probes); `--config` (or $ECREC_OPERATOR_CONFIG) names a YAML/JSON file of job-pod defaults (`render.PodDefaults`:
security contexts, default images, labels, the per-job NetworkPolicy), the Helm chart's ConfigMap.

`--leader-elect` (the chart sets it) runs kopf only while this process holds the Lease `--leader-elect-name` in
`--leader-elect-namespace` (ecrec_operator.leader): replicas beyond the first wait as candidates, their
/healthz answering "standby", and a leader that loses the Lease exits at once (its pod restarts as a candidate).
"""

from __future__ import annotations

import argparse
import http.server
import logging
import os
import signal
import socket
import threading
import uuid

import kopf
from kubernetes import config as k8s_config
from prometheus_client import start_http_server

from . import leader, render


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
    le = ap.add_argument_group("leader election (a coordination.k8s.io/v1 Lease, client-go's semantics)")
    le.add_argument("--leader-elect", action="store_true", help="act only while holding the Lease")
    le.add_argument(
        "--leader-elect-namespace",
        default=os.environ.get("POD_NAMESPACE") or "ecrec-system",
        help="the Lease's namespace (default: $POD_NAMESPACE, else ecrec-system)",
    )
    le.add_argument("--leader-elect-name", default="ecrec-operator", help="the Lease's name")
    le.add_argument("--leader-elect-identity", default="", help="this candidate (default: HOSTNAME_random)")
    le.add_argument("--leader-elect-lease-duration", type=float, default=leader.LEASE_DURATION)
    le.add_argument("--leader-elect-renew-deadline", type=float, default=leader.RENEW_DEADLINE)
    le.add_argument("--leader-elect-retry-period", type=float, default=leader.RETRY_PERIOD)
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
    election = None
    if args.leader_elect:
        try:
            election = _lead(args)
        except ValueError as e:
            ap.exit(2, f"ecrec-operator: {e}\n")
        if election is None:  # stopped (SIGTERM) while a candidate
            return
    try:
        kopf.run(
            standalone=True,  # no kopf peering: the Lease decides who acts
            namespaces=args.namespace or (),
            clusterwide=not args.namespace,
            liveness_endpoint=liveness,
        )
    finally:
        if election is not None:
            election.release()  # the successor takes over at its next try


def _lead(args: argparse.Namespace) -> leader.LeaderElection | None:
    """Block until this process holds the Lease (None: SIGTERM/SIGINT came first). Meanwhile /healthz answers
    on the health port, so the Deployment keeps a candidate alive and Ready."""
    identity = args.leader_elect_identity or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    lock = leader.LeaseLock(args.leader_elect_namespace, args.leader_elect_name)
    elector = leader.Elector(lock, identity, args.leader_elect_lease_duration)
    election = leader.LeaderElection(
        elector, args.leader_elect_renew_deadline, args.leader_elect_retry_period, on_lost=_lost
    )
    standby = _standby_health(args.health_addr, args.health_port) if args.health_port else None
    previous = {s: signal.signal(s, lambda *_: election.stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        leads = election.acquire()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if standby is not None:  # kopf serves /healthz from now on
            standby.shutdown()
            standby.server_close()
    return election if leads else None


def _lost() -> None:
    """Another candidate may lead from now on: stop acting at once, whatever kopf is doing (client-go's
    controllers exit too). The pod restarts as a candidate."""
    logging.shutdown()
    os._exit(1)


class _Standby(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ok = self.path.split("?")[0] == "/healthz"
        body = b"standby: waiting for the leader election\n" if ok else b"not found\n"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_) -> None:  # the probes would fill the log
        pass


def _standby_health(addr: str, port: int) -> http.server.ThreadingHTTPServer:
    cls = http.server.ThreadingHTTPServer
    if ":" in addr:
        cls = type("ThreadingHTTPServer6", (cls,), {"address_family": socket.AF_INET6})
    server = cls((addr, port), _Standby)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="standby-healthz").start()
    return server


if __name__ == "__main__":
    main()

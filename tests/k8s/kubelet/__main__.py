"""`python -m tests.k8s.kubelet --kubeconfig K --out out/k8s [--nodes N]`: the test kubelet until
SIGTERM/SIGINT (what `make k8s-up` runs, hack/k8s-up; `--nodes N` with `make k8s-up NODES=N`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from .kubelet import TestKubelet
from .node import NODE_NAME


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.k8s.kubelet",
        description="The test kubelet: runs the pods of a test control plane's nodes as local processes (and, "
        "for one node without kube-scheduler, binds them).",
    )
    ap.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="default: $KUBECONFIG")
    ap.add_argument("--out", default="out/k8s", help="kubelet.log and pods/<ns>_<pod>/ (default: out/k8s)")
    ap.add_argument("--node", default=NODE_NAME, help=f"node name (default: {NODE_NAME}); not with --nodes")
    ap.add_argument(
        "--nodes",
        type=int,
        help="serve N nodes, ecrec-local-0..N-1, from this process; kube-scheduler binds their pods",
    )
    ap.add_argument(
        "--zones", type=int, default=2, help="with --nodes: node i is in zone-<i mod ZONES> (default 2)"
    )
    ap.add_argument(
        "--no-bind",
        action="store_true",
        help="run only pods bound to the node already (kube-scheduler binds; always so with --nodes)",
    )
    ap.add_argument("--stop-grace", type=float, default=5.0, help="SIGTERM..SIGKILL on exit (default: 5 s)")
    args = ap.parse_args(argv)
    if not args.kubeconfig:
        ap.error("--kubeconfig or $KUBECONFIG is required")
    if args.nodes is not None and args.node != NODE_NAME:
        ap.error("--node and --nodes exclude each other")
    if args.nodes is not None and args.nodes < 1:
        ap.error("--nodes must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    kl = TestKubelet(
        args.kubeconfig,
        args.out,
        node_name=args.node,
        bind_pending=False if args.no_bind or args.nodes is not None else None,
        stop_grace=args.stop_grace,
        nodes=args.nodes,
        zones=args.zones,
    )
    kl.start()
    names = ", ".join(kl.node_names)
    print(f"test kubelet: node(s) {names} ready; pod logs in {kl.out_dir / 'pods'}", flush=True)
    while not done.wait(1):
        pass
    kl.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

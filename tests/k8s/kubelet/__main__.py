"""`python -m tests.k8s.kubelet --kubeconfig K --out out/k8s`: the test kubelet until SIGTERM/SIGINT (what
`make k8s-up` runs, hack/k8s-up)."""

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
        description="The test kubelet: schedules and runs the pods of a test control plane as local processes.",
    )
    ap.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="default: $KUBECONFIG")
    ap.add_argument("--out", default="out/k8s", help="kubelet.log and pods/<ns>_<pod>/ (default: out/k8s)")
    ap.add_argument("--node", default=NODE_NAME, help=f"node name (default: {NODE_NAME})")
    ap.add_argument("--no-bind", action="store_true", help="run only pods already bound to --node")
    ap.add_argument("--stop-grace", type=float, default=5.0, help="SIGTERM..SIGKILL on exit (default: 5 s)")
    args = ap.parse_args(argv)
    if not args.kubeconfig:
        ap.error("--kubeconfig or $KUBECONFIG is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    kl = TestKubelet(
        args.kubeconfig,
        args.out,
        node_name=args.node,
        bind_pending=not args.no_bind,
        stop_grace=args.stop_grace,
    )
    kl.start()
    print(f"test kubelet: node {args.node} ready; pod logs in {kl.out_dir / 'pods'}", flush=True)
    while not done.wait(1):
        pass
    kl.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`TestKubelet`: the kubelet process: API access, the watches, one pod worker per pod, start and stop.

`start()` opens the API client (the kubeconfig's), starts the fork server (`fork_ecrec`) and the userspace
kube-proxy (tests/k8s/kubeproxy.py), registers its nodes (node.py), watches the pods bound to each and, with
`bind_pending` (one node only), the unbound ones (scheduler.py); each pod bound to one of its nodes gets a
`PodWorker` thread (lifecycle.py) until its object is gone. `stop()` terminates every process the kubelet
started (SIGTERM, SIGKILL after `stop_grace`) and marks its nodes NotReady; pod objects stay as they are.
A node's machine can die for a while on its annotations (outages.py): its workers crash, its pod events are
ignored until it is back.

Per process: the API client, the fork server, the proxy, the pod IPs (ips.py), the log (`kubelet.log`), the
nodes' capacity (all alike: this machine's). Per node (`node_names`; one by default, `ecrec-local-0..N-1`
with `nodes=N`): the `Node` with its heartbeat thread and lease, and the watch of `spec.nodeName=<node>`.
With one node and `bind_pending`, the `Binder` binds every pending pod to it; with kube-scheduler running
(hack/kube-testenv starts it unless ECREC_KUBE_SCHEDULER=0), pass `bind_pending=False`: the scheduler binds,
the kubelet only runs what is bound to its nodes. Several nodes always leave the binding to the scheduler.

Locks: `_lock` guards `_workers`, `_finished`, `_streams` (the open watch responses) and the outages' `_down`
and `_lost`; a pod worker is started under it, so that stop() never misses one it must join, nor node_down()
one it must crash; nothing blocking runs with it held.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from tests.k8s.kubeproxy import ServiceProxy

from .api import TERMINAL
from .dns import target_port
from .ips import IPS
from .lifecycle import PodWorker
from .node import NODE_NAME, Node, node_capacity, node_names
from .outages import KubeletOutages
from .scheduler import Binder

LOGGER = "ecrec.test-kubelet"  # + ".<node>.<n>": one logger (and kubelet.log) per kubelet
_kubelets = itertools.count(1)  # two kubelets of one process (two control planes) may serve nodes of one name


class TestKubelet(KubeletOutages):
    """The kubelet of one or more nodes (and, for one node without kube-scheduler, its scheduler); see the
    package docstring. `start()` returns once the nodes are registered and the watches run; `stop()` kills
    every process it started and returns."""

    __test__ = False  # not a pytest test class despite its name

    def __init__(
        self,
        kubeconfig: str | os.PathLike,
        out_dir: str | os.PathLike,
        node_name: str = NODE_NAME,
        bind_pending: bool | None = None,
        stop_grace: float = 5.0,
        heartbeat_s: float = 10.0,
        fork_ecrec: bool = False,
        nodes: int | None = None,
        zones: int = 2,
    ):
        """`nodes=N`: serve the nodes ecrec-local-0..N-1 (instead of the one `node_name`), node i in zone
        `zone-<i mod zones>`; `bind_pending`: bind pending pods to the node (default: with one node only;
        False runs only pods bound to its nodes already: kube-scheduler binds, or a second kubelet in one
        cluster; several nodes refuse True);
        `stop_grace`: seconds between SIGTERM and SIGKILL of the pods' processes on `stop()`;
        `fork_ecrec`: a container whose command is the `ecrec` image's entrypoint is forked from a fork
        server (`ecrec.forkserver`, as `ecrec local` starts its processes) instead of starting a new
        interpreter: the same `ecrec ROLE ARGS` with the pod's env, cwd and log, in its own session, without
        1-2 s of CPU for imports per pod. Its children die with the kubelet's process, not with the pod's
        worker thread."""
        self.kubeconfig = Path(kubeconfig)
        self.out_dir = Path(out_dir).resolve()
        self.node_names = [node_name] if nodes is None else node_names(nodes)
        self.node_name = self.node_names[0]
        if bind_pending is None:
            bind_pending = len(self.node_names) == 1
        if bind_pending and len(self.node_names) > 1:
            raise ValueError(
                "the Binder binds to one node: several nodes need kube-scheduler (bind_pending=False)"
            )
        self.bind_pending = bind_pending
        self.zones = zones
        self.nodes: list[Node] = []  # from start()
        self.stop_grace = stop_grace
        self.heartbeat_s = heartbeat_s
        self.fork_ecrec = fork_ecrec
        self._forkserver: Any = None  # ecrec.forkserver.ForkServer, with fork_ecrec, from start()
        self.ips = IPS
        self.capacity = node_capacity()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._workers: dict[str, PodWorker] = {}  # uid -> worker, of every node
        self._worker_node: dict[str, str] = {}  # uid -> the node whose watch started its worker
        self._threads: list[threading.Thread] = []
        self._streams: set[Any] = set()
        self._finished: set[str] = set()  # uids whose worker ended: late events must not start them again
        self._down: set[str] = set()  # outages.py: nodes whose machine is down
        self._lost: dict[str, set[str]] = {}  # outages.py: node -> uids of the pods lost with its machine
        self._stop_deadline = 0.0
        self.log = logging.getLogger(f"{LOGGER}.{self.node_name}.{next(_kubelets)}")
        self._log_handler: logging.Handler | None = None
        self._started = False

    def forked(self, argv: list[str], env: dict[str, str], log: Path, name: str, cwd: Path) -> Any:
        """`ecrec ARGV` forked from the fork server (see `fork_ecrec`), Popen-like."""
        return self._forkserver.spawn(argv, env, log, name, cwd=cwd)

    # -- API access --
    def call(self, fn, *args, **kwargs) -> Any:
        """Calls a CoreV1Api method and returns the JSON body as dicts (camelCase, as kubectl shows it).

        Raw responses also dodge the client's failure to deserialize the Status a binding returns."""
        kwargs.setdefault("_request_timeout", 30)
        resp = fn(*args, _preload_content=False, **kwargs)
        return json.loads(resp.data) if resp.data else None

    # -- lifecycle --
    def start(self) -> TestKubelet:
        if self._started:
            raise RuntimeError("already started")
        self._started = True
        (self.out_dir / "pods").mkdir(parents=True, exist_ok=True)
        self._log_handler = logging.FileHandler(self.out_dir / "kubelet.log")
        self._log_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        self.log.addHandler(self._log_handler)
        self.log.setLevel(logging.INFO)
        if self.fork_ecrec:
            from ecrec.forkserver import ForkServer

            # From this thread, which outlives every pod's: the fork server dies with the thread that started
            # it (PR_SET_PDEATHSIG is per thread), and its children with it.
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            self._forkserver = ForkServer(self.out_dir, self.out_dir / "forkserver.log", env)
        cfg = k8s.Configuration()
        k8s_config.load_kube_config(config_file=str(self.kubeconfig), client_configuration=cfg)
        cfg.connection_pool_maxsize = 64  # one worker thread per pod, each calling the API
        self.api = k8s.ApiClient(cfg)
        self.core = k8s.CoreV1Api(self.api)
        self.proxy = ServiceProxy(self.call, self.core, target_port)
        coordination = k8s.CoordinationV1Api(self.api)
        # Per node: its object (heartbeat and lease), the watch of the pods bound to it; with one node and no
        # kube-scheduler, the binder that sends pending pods to it.
        self.nodes = [
            Node(name, self.capacity, self.call, self.core, self.log, f"zone-{i % self.zones}", coordination)
            for i, name in enumerate(self.node_names)
        ]
        self.node = self.nodes[0]
        watches = []
        for node in self.nodes:
            node.register()
            watches.append(
                (
                    f"node-{node.name}",
                    f"spec.nodeName={node.name}",
                    lambda etype, pod, node=node.name: self._on_pod_event(etype, pod, node),
                    lambda pods, node=node.name: self._sync_node_pods(pods, node),
                )
            )
        if self.bind_pending:
            binder = Binder(self.node, self.call, self.core, self.log)
            watches.append(("unbound", "spec.nodeName=", binder.on_event, binder.sync))
        for name, selector, handler, sync in watches:
            t = threading.Thread(
                target=self._watch_loop, args=(selector, handler, sync), name=f"watch-{name}", daemon=True
            )
            t.start()
            self._threads.append(t)
        for node in self.nodes:
            hb = threading.Thread(
                target=node.heartbeat_loop,
                args=(self._stopping, self.heartbeat_s, self.node_down, self.node_up),
                name=f"heartbeat-{node.name}",
                daemon=True,
            )
            hb.start()
            self._threads.append(hb)
        self.log.info(
            "test kubelet started: nodes %s (%s), out %s",
            ", ".join(self.node_names),
            "binds pending pods" if self.bind_pending else "kube-scheduler binds",
            self.out_dir,
        )
        return self

    def stop(self) -> None:
        """Stops watching, kills every pod process (SIGTERM, SIGKILL after stop_grace) and marks the nodes
        NotReady. Pod objects stay as they are."""
        if not self._started or self._stopping.is_set():
            return
        self._stop_deadline = time.monotonic() + self.stop_grace
        self._stopping.set()
        with self._lock:
            streams, workers = list(self._streams), list(self._workers.values())
        for s in streams:
            try:
                s.shutdown()  # unblocks the watch thread's read
            except Exception:
                pass
        for w in workers:
            w.wake()
        for w in workers:
            w.join(self.stop_grace + 15)
            if w.is_alive():
                self.log.error("%s: worker did not stop", w.key)
        for t in self._threads:
            t.join(10)
        if self._forkserver is not None:
            self._forkserver.close()
        self.proxy.stop()
        for node in self.nodes:
            try:
                node.patch_status(ready=False)
            except Exception as e:
                self.log.warning("could not mark node %s NotReady: %s", node.name, e)
        self.log.info("test kubelet stopped")
        if self._log_handler is not None:
            self.log.removeHandler(self._log_handler)
            self._log_handler.close()
        self.api.close()

    def __enter__(self) -> TestKubelet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def pids(self) -> dict[str, list[int]]:
        """`ns/pod` -> pids of its running container processes (for tests)."""
        with self._lock:
            workers = list(self._workers.values())
        return {w.key: [c.proc.pid for c in w.inits + w.mains if c.proc is not None] for w in workers}

    # -- watches --
    def _watch_loop(self, selector: str, handler, sync) -> None:
        """List, then watch from that resourceVersion; relist on 410 Gone or an error."""
        rv = None
        while not self._stopping.is_set():
            try:
                if rv is None:
                    lst = self.call(self.core.list_pod_for_all_namespaces, field_selector=selector)
                    rv = lst["metadata"]["resourceVersion"]
                    sync(lst["items"])
                resp = self.core.list_pod_for_all_namespaces(
                    watch=True,
                    field_selector=selector,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=300,
                    _preload_content=False,
                    _request_timeout=(10, 330),
                )
                with self._lock:
                    self._streams.add(resp)
                try:
                    if self._stopping.is_set():
                        break
                    for line in iter_resp_lines(resp):
                        if self._stopping.is_set():
                            break
                        if not line:
                            continue
                        ev = json.loads(line)
                        obj = ev["object"]
                        if ev["type"] == "ERROR":
                            if obj.get("code") == 410:  # too old a resourceVersion: list again
                                rv = None
                                break
                            raise RuntimeError(f"watch error: {obj}")
                        rv = obj["metadata"]["resourceVersion"]
                        if ev["type"] != "BOOKMARK":
                            handler(ev["type"], obj)
                finally:
                    with self._lock:
                        self._streams.discard(resp)
                    resp.release_conn()
            except Exception as e:
                if self._stopping.is_set():
                    break
                if isinstance(e, ApiException) and e.status == 410:
                    rv = None
                    continue
                self.log.warning("watch %s: %s: %s; again in 1 s", selector, type(e).__name__, e)
                rv = None
                self._stopping.wait(1)

    def _sync_node_pods(self, pods: list[dict], node: str) -> None:
        """A fresh list of the pods bound to `node`: its workers whose pod is not in it are gone. Ignored while
        its machine is down (node_up lists them again)."""
        uids = {p["metadata"]["uid"] for p in pods}
        with self._lock:
            if node in self._down:
                return
            vanished = [
                w
                for uid, w in self._workers.items()
                if self._worker_node.get(uid) == node and uid not in uids
            ]
        for w in vanished:
            w.gone()
        for p in pods:
            self._on_pod_event("ADDED", p, node)

    def _on_pod_event(self, etype: str, pod: dict, node: str) -> None:
        uid = pod["metadata"]["uid"]
        with self._lock:
            if node in self._down:
                return  # a dead machine sees nothing; node_up lists its pods again
            w = self._workers.get(uid)
            if etype == "DELETED":
                if w is not None:
                    w.gone()
                return
            if w is not None:
                w.update(pod)
                return
            if uid in self._finished or self._stopping.is_set():
                return
            if (pod.get("status") or {}).get("phase") in TERMINAL:
                return  # finished under an earlier kubelet: nothing to run
            w = PodWorker(self, pod)
            self._workers[uid] = w
            self._worker_node[uid] = node
            w.start()  # under the lock: stop() never sees a worker it cannot join

    def _forget(self, w: PodWorker) -> None:
        with self._lock:
            self._finished.add(w.uid)
            if self._workers.get(w.uid) is w:
                del self._workers[w.uid]
                self._worker_node.pop(w.uid, None)
        if w.ip != "127.0.0.1":
            self.ips.release(w.ip)

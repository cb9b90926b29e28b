"""A userspace kube-proxy for the test kubelet: Service ClusterIPs that lead somewhere.

The test control plane allocates Service ClusterIPs from 127.0.10.0/24 (hack/kube-testenv), on loopback, so
this process can listen on a Service's own ClusterIP and port and forward each TCP connection to a ready pod
behind the Service's selector (its targetPort), as kube-proxy's userspace mode did. The endpoint is chosen
per connection, when it is accepted: once the pod behind a Service is replaced, new connections reach the new
one under the same address, which is what lets a process keep a Service's address across the replacement of
the pod behind it (the ECRec coordinator's failover). Connections already open end with the pod they went to.

Only what the kubelet's env rewriting asks for is proxied (`ServiceProxy.ensure`); plain TCP, no UDP, no
session affinity, no NodePorts.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ecrec.test-kubeproxy")


def ready_endpoints(pods: list[dict], publish_not_ready: bool = False) -> list[dict]:
    """The pods a Service sends traffic to: with an IP, not being deleted, ready (or any, if the Service
    publishes not-ready addresses), in name order."""
    out = []
    for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
        st = p.get("status") or {}
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
        if st.get("podIP") and not p["metadata"].get("deletionTimestamp") and (ready or publish_not_ready):
            out.append(p)
    return out


class ServiceProxy:
    """Listeners on Service ClusterIPs. `call` is the kubelet's API call wrapper (returns JSON dicts), `core`
    its CoreV1Api, `target_port(svc, pod, port)` maps a Service port to the pod's port."""

    def __init__(self, call: Callable[..., Any], core: Any, target_port: Callable[[dict, dict, int], str]):
        self.call, self.core, self.target_port = call, core, target_port
        self._services: dict[tuple[str, int], tuple[str, str]] = {}  # (clusterIP, port) -> (ns, name)
        self._listeners: dict[tuple[str, int], socket.socket] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def ensure(self, svc: dict) -> bool:
        """Proxy every port of `svc` on its ClusterIP; False for a Service without one (headless)."""
        ip = svc["spec"].get("clusterIP")
        if not ip or ip == "None":
            return False
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        for sp in svc["spec"].get("ports") or []:
            key = (ip, int(sp["port"]))
            with self._lock:
                self._services[key] = (ns, name)  # a ClusterIP may be reused by a later Service
                if key in self._listeners:
                    continue
                lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                lsock.bind(key)
                lsock.listen(128)
                self._listeners[key] = lsock
            threading.Thread(
                target=self._accept_loop, args=(key, lsock), daemon=True, name=f"proxy-{ip}"
            ).start()
            log.info("proxying %s:%d for Service %s/%s", *key, ns, name)
        return True

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            listeners = list(self._listeners.values())
            self._listeners.clear()
        for s in listeners:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept_loop(self, key: tuple[str, int], lsock: socket.socket) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(key, client), daemon=True).start()

    def _upstream(self, key: tuple[str, int]) -> socket.socket | None:
        with self._lock:
            ns, name = self._services[key]
        try:
            svc = self.call(self.core.read_namespaced_service, name, ns)
            selector = svc["spec"].get("selector") or {}
            if svc["spec"].get("clusterIP") != key[0] or not selector:
                return None
            sel = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
            pods = self.call(self.core.list_namespaced_pod, ns, label_selector=sel)["items"]
        except Exception as e:  # noqa: BLE001 - an API hiccup refuses this connection only
            log.warning("proxy %s:%d: cannot read Service %s/%s: %s", *key, ns, name, e)
            return None
        for pod in ready_endpoints(pods, bool(svc["spec"].get("publishNotReadyAddresses"))):
            addr = (pod["status"]["podIP"], int(self.target_port(svc, pod, key[1])))
            try:
                return socket.create_connection(addr, timeout=2.0)
            except OSError:
                continue  # not answering (yet, or any more): the next endpoint
        return None

    def _serve(self, key: tuple[str, int], client: socket.socket) -> None:
        upstream = self._upstream(key)
        if upstream is None:
            client.close()  # no endpoint: the caller sees the connection closed, as with kube-proxy
            return
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
        t.start()
        _pipe(client, upstream)
        t.join()
        client.close()
        upstream.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy src -> dst until src ends, then end dst's write side (half-close, as TCP proxies do)."""
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
        try:
            sock.shutdown(how)
        except OSError:
            pass

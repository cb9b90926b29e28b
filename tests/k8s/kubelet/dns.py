"""The networking stand-in: Service DNS names in env values rewritten to an address.

There is no cluster DNS. This kubelet rewrites Service DNS names found in env *values* - `<svc>.<ns>.svc`,
`<svc>.<ns>.svc.cluster.local` and the per-pod form `<hostname>.<subdomain>.<ns>.svc[.cluster.local]` - to an
address, once a ready pod is behind the Service (chosen by the Service's selector; not-ready pods count if the
Service has publishNotReadyAddresses): for a Service with a ClusterIP, that ClusterIP (from 127.0.10.0/24, on
loopback), where `tests/k8s/kubeproxy.py`, a userspace kube-proxy, forwards each new connection to a ready
pod's targetPort - so the address keeps working when the pod behind it is replaced; for a headless Service,
the pod's IP (`:port` unchanged); a pod's own per-pod name is its own IP, as its /etc/hosts would say. Until
every such name resolves, the container waits in ContainerCreating, saying which name it waits for. Names in
command/args are not rewritten: pass them through env and `$(VAR)`. Short names (`<svc>`, `<svc>.<ns>`) are
not resolved. DNS rewriting and the proxy are the only place where the harness stands in for cluster
networking; no `*_SERVICE_HOST` env is injected.

`PodDNS` is a mixin of `PodWorker` (see pod.py); `target_port` is also the proxy's (kubelet.py hands it over).
"""

from __future__ import annotations

import re

from kubernetes.client.exceptions import ApiException

from .pod import NotYet, PodBase

# <hostname>.<subdomain>.<ns>.svc[.cluster.local] or <svc>.<ns>.svc[.cluster.local], then maybe :port
_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
SERVICE_NAME = re.compile(
    rf"(?<![-A-Za-z0-9.])(?:(?P<host>{_LABEL})\.)?(?P<svc>{_LABEL})\.(?P<ns>{_LABEL})\.svc"
    rf"(?:\.cluster\.local)?\.?(?![-A-Za-z0-9])(?::(?P<port>\d+)(?![0-9]))?"
)


class PodDNS(PodBase):
    """Service DNS names in env values -> addresses (a mixin of PodWorker)."""

    def _resolve_service_names(self, value: str) -> str:
        """Rewrites Service DNS names in an env value to a ready pod's IP (the networking stand-in)."""
        if ".svc" not in value:
            return value
        return SERVICE_NAME.sub(self._resolve_one, value)

    def _resolve_one(self, m: re.Match) -> str:
        host, svc_name, ns, port = m.group("host"), m.group("svc"), m.group("ns"), m.group("port")
        spec = self.pod["spec"]
        if host and ns == self.ns and host == spec.get("hostname") and svc_name == spec.get("subdomain"):
            return self.ip + (f":{port}" if port else "")  # the pod's own name: its /etc/hosts entry
        name = m.group(0)
        try:
            svc = self.kl.call(self.kl.core.read_namespaced_service, svc_name, ns)
        except ApiException as e:
            if e.status == 404:
                raise NotYet(f"waiting for Service {ns}/{svc_name} (for {name})") from None
            raise
        selector = svc["spec"].get("selector") or {}
        if not selector:
            raise NotYet(f"Service {ns}/{svc_name} has no selector: the test kubelet cannot resolve {name}")
        label_selector = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
        pods = self.kl.call(self.kl.core.list_namespaced_pod, ns, label_selector=label_selector)["items"]
        not_ready_ok = bool(svc["spec"].get("publishNotReadyAddresses"))
        chosen = None
        for p in sorted(pods, key=lambda p: p["metadata"]["name"]):
            st = p.get("status") or {}
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions") or [])
            if host and (p["spec"].get("hostname") != host or p["spec"].get("subdomain") != svc_name):
                continue
            if st.get("podIP") and not p["metadata"].get("deletionTimestamp") and (ready or not_ready_ok):
                chosen = p
                break
        if chosen is None:
            raise NotYet(f"waiting for a ready pod behind Service {ns}/{svc_name} (for {name})")
        ip = chosen["status"]["podIP"]
        if not host and self.kl.proxy.ensure(svc):
            # The Service's own ClusterIP, proxied (tests/k8s/kubeproxy.py): it keeps leading to a ready
            # pod when the one behind it now is replaced.
            ip = svc["spec"]["clusterIP"]
        elif port and not host and svc["spec"].get("clusterIP") != "None":
            port = target_port(svc, chosen, int(port))
        self.log.info(
            "%s: %s -> %s%s (pod %s)",
            self.key,
            name,
            ip,
            f":{port}" if port else "",
            chosen["metadata"]["name"],
        )
        return ip + (f":{port}" if port else "")


def target_port(svc: dict, pod: dict, port: int) -> str:
    """The pod port behind Service port `port` (what kube-proxy would forward to)."""
    for sp in svc["spec"].get("ports") or []:
        if sp.get("port") == port:
            target = sp.get("targetPort", port)
            if isinstance(target, int) or str(target).isdigit():
                return str(target)
            for ctr in pod["spec"].get("containers") or []:
                for cp in ctr.get("ports") or []:
                    if cp.get("name") == target:
                        return str(cp["containerPort"])
    return str(port)

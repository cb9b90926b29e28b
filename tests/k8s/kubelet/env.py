"""A container's process env, from the pod spec only, and Kubernetes' `$(VAR)` expansion.

Each container's command/args (`$(VAR)` references expanded as Kubernetes does) runs with the env of the pod
spec only: `value`, `valueFrom` (fieldRef: metadata.name, .namespace, .uid, .labels['k'], .annotations['k'],
spec.nodeName, spec.serviceAccountName, status.podIP, status.podIPs, status.hostIP; resourceFieldRef;
configMapKeyRef; secretKeyRef) and `envFrom`, over a minimal base (PATH, HOME, LANG, HOSTNAME), the
service-account KUBECONFIG (volumes.py) and the image's ENV (images.py). Paths under a mountPath are
rewritten (volumes.py) and Service DNS names resolved (dns.py) in every value.

`PodEnv` is a mixin of `PodWorker` (see pod.py); it uses `_rewrite_paths` (volumes.py) and
`_resolve_service_names` (dns.py). `_config_data` is also what configMap and secret volumes are written from.
"""

from __future__ import annotations

import base64
import math
import os
import re

from kubernetes.client.exceptions import ApiException

from .images import Image
from .pod import Container, NotYet, PodBase, PodFails

_QUANTITY = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([a-zA-Z]*)")
_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_SUFFIX.update({f"{p}i": 1024 ** (i + 1) for i, p in enumerate("KMGTPE")})


def quantity(text: str) -> float:
    """A resource quantity (`500m`, `2Gi`, `1.5`) as a number."""
    m = _QUANTITY.fullmatch(str(text).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"not a quantity: {text!r}")
    return float(m.group(1)) * _SUFFIX[m.group(2)]


_VAR_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known names replaced, unknown ones kept, `$$` -> `$`."""
    return _VAR_REF.sub(lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


class PodEnv(PodBase):
    """The env of a container's process (a mixin of PodWorker)."""

    def _env(self, c: Container, image: Image) -> dict[str, str]:
        """The process env: a minimal base, the image's ENV, then the container's env (pod spec only)."""
        spec = self.pod["spec"]
        env: dict[str, str] = {
            "PATH": os.pathsep.join([*image.path, "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "HOSTNAME": spec.get("hostname") or self.pod_name,
            **self.sa_env,
            **dict(image.env),
        }
        for src in c.spec.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                data = self._config_data("configmap", src["configMapRef"])
            elif "secretRef" in src:
                data = self._config_data("secret", src["secretRef"])
            else:
                continue
            env.update({prefix + k: v for k, v in data.items()})
        for var in c.spec.get("env") or []:
            name = var["name"]
            if "valueFrom" in var:
                value = self._value_from(c, var["valueFrom"])
                if value is None:
                    continue  # an optional key that is missing: no variable
                value = self._rewrite_paths(c, value)
            else:  # paths before $(VAR), as for args
                value = expand(self._rewrite_paths(c, var.get("value", "")), env)
            env[name] = self._resolve_service_names(value)
        return env

    def _value_from(self, c: Container, src: dict) -> str | None:
        meta = self.pod["metadata"]
        if "fieldRef" in src:
            path = src["fieldRef"]["fieldPath"]
            m = re.fullmatch(r"metadata\.(labels|annotations)\['(.*)'\]", path)
            if m:
                return (meta.get(m.group(1)) or {}).get(m.group(2), "")
            values = {
                "metadata.name": self.pod_name,
                "metadata.namespace": self.ns,
                "metadata.uid": self.uid,
                "spec.nodeName": self.pod["spec"].get("nodeName", ""),  # one of the kubelet's nodes
                "spec.serviceAccountName": self.pod["spec"].get("serviceAccountName", ""),
                "status.podIP": self.ip,
                "status.podIPs": self.ip,
                "status.hostIP": "127.0.0.1",
            }
            if path not in values:
                raise PodFails("CreateContainerConfigError", f"unsupported fieldRef {path!r}")
            return values[path]
        if "resourceFieldRef" in src:
            ref = src["resourceFieldRef"]
            target = c
            if ref.get("containerName"):
                target = next((x for x in self.inits + self.mains if x.name == ref["containerName"]), c)
            kind, _, res = ref["resource"].partition(".")
            given = ((target.spec.get("resources") or {}).get(kind) or {}).get(res)
            if given is None:  # no limit: the node's allocatable, as the kubelet does
                given = self.kl.capacity.get(res, "0")
            divisor = quantity(ref.get("divisor", "1") or "1")
            return str(math.ceil(quantity(given) / divisor))
        for key, kind in (("configMapKeyRef", "configmap"), ("secretKeyRef", "secret")):
            if key in src:
                ref = src[key]
                data = self._config_data(kind, ref)
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise NotYet(f"waiting for key {ref['key']} of {kind} {self.ns}/{ref.get('name')}")
                return data[ref["key"]]
        raise PodFails("CreateContainerConfigError", f"unsupported valueFrom {sorted(src)}")

    def _config_data(self, kind: str, ref: dict) -> dict[str, str]:
        """The data of a ConfigMap or Secret (decoded); {} if missing and optional; NotYet if missing."""
        name = ref.get("name") or ref.get("secretName") or ""
        read = (
            self.kl.core.read_namespaced_config_map
            if kind == "configmap"
            else self.kl.core.read_namespaced_secret
        )
        try:
            obj = self.kl.call(read, name, self.ns)
        except ApiException as e:
            if e.status != 404:
                raise
            if ref.get("optional"):
                return {}
            raise NotYet(f"waiting for {kind} {self.ns}/{name}") from None
        if kind == "secret":
            return {
                k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()
            }
        data = dict(obj.get("data") or {})
        data.update(
            {
                k: base64.b64decode(v).decode(errors="replace")
                for k, v in (obj.get("binaryData") or {}).items()
            }
        )
        return data

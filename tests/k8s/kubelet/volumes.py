"""Volumes and the service-account credentials: directories under the pod's directory, and paths to them.

**Volumes**: emptyDir, configMap and secret volumes are written under the pod's directory; since processes
cannot get a mount namespace here, every `mountPath` (with subPath) that appears as a path in command, args or
env values is rewritten to that directory. A persistentVolumeClaim volume is one directory per claim,
`persistentvolumes/<ns>_<claim>/`, shared by every pod that mounts it and kept when they go (the stand-in for a
ReadWriteMany volume; there is no PV controller: the claim must exist, its phase is not looked at; the pod
waits in ContainerCreating until it does). Other volume types fail the pod (UnsupportedVolume, checked in
lifecycle.py against VOLUME_KINDS). ConfigMap/Secret updates are not propagated after the pod started.

**Service-account credentials**: the API server runs without the ServiceAccount admission plugin, so no pod
gets the `kube-api-access` volume. Unless `automountServiceAccountToken: false` (pod or ServiceAccount), the
kubelet asks the API server for a token of the pod's ServiceAccount (TokenRequest bound to the pod, 24 h, not
refreshed) and writes what the projected volume would hold - `token`, `ca.crt`, `namespace` - under the pod's
directory, as if mounted at /var/run/secrets/kubernetes.io/serviceaccount (paths to it in command, args or env
are rewritten like any mountPath). The client libraries read that fixed path, which a process cannot have
without a mount namespace; so instead of the in-cluster env (KUBERNETES_SERVICE_HOST/PORT) the process gets
`KUBECONFIG` naming a kubeconfig there: this API server, its CA and the token file. The process then acts with
its ServiceAccount's rights (RBAC is enforced); only the libraries' in-cluster code path is not exercised. No
ServiceAccount `default` (nothing creates one here): no credentials; another ServiceAccount that does not
exist: the pod waits for it.

`PodVolumes` is a mixin of `PodWorker` (see pod.py); it uses `_config_data` (env.py).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from kubernetes.client.exceptions import ApiException

from .pod import Container, NotYet, PodBase

SA_VOLUME, SA_MOUNT = "kube-api-access", "/var/run/secrets/kubernetes.io/serviceaccount"
SA_TOKEN_SECONDS = 86400
VOLUME_KINDS = ("emptyDir", "configMap", "secret", "persistentVolumeClaim")


class PodVolumes(PodBase):
    """A pod's volumes and service-account credentials, and container paths into them (a mixin of PodWorker)."""

    def _volume_dir(self, name: str) -> Path:
        """Where volume `name` lives here: under the pod's directory, or a claim's directory shared by pods."""
        for v in self.pod["spec"].get("volumes") or []:
            if v["name"] == name and "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                return self.kl.out_dir / "persistentvolumes" / f"{self.ns}_{claim}"
        return self.vol_dir / name

    def _make_volumes(self) -> None:
        """Writes emptyDir/configMap/secret volumes under vol_dir (once, when the pod starts); finds claims."""
        volumes = self.pod["spec"].get("volumes") or []
        if not volumes:
            return
        shutil.rmtree(self.vol_dir, ignore_errors=True)
        for v in volumes:
            if "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                try:
                    self.kl.call(self.kl.core.read_namespaced_persistent_volume_claim, claim, self.ns)
                except ApiException as e:
                    if e.status != 404:
                        raise
                    raise NotYet(f'persistentvolumeclaim "{claim}" not found') from None
                self._volume_dir(v["name"]).mkdir(parents=True, exist_ok=True)
                continue
            d = self.vol_dir / v["name"]
            d.mkdir(parents=True, exist_ok=True)
            if "emptyDir" in v:
                continue
            kind = "configmap" if "configMap" in v else "secret"
            src = v["configMap"] if kind == "configmap" else v["secret"]
            data = self._config_data(kind, src)
            mode = src.get("defaultMode", 0o644)
            items = src.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] not in data:
                    if src.get("optional"):
                        continue
                    raise NotYet(
                        f"waiting for key {item['key']} of {kind} {self.ns}/{src.get('name') or src.get('secretName')}"
                    )
                f = d / item["path"]
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(data[item["key"]])
                f.chmod(item.get("mode", mode))

    def _service_account(self) -> None:
        """The stand-in for the projected service-account volume (see the module docstring)."""
        spec = self.pod["spec"]
        if spec.get("automountServiceAccountToken") is False:
            return
        name = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        try:
            sa = self.kl.call(self.kl.core.read_namespaced_service_account, name, self.ns)
        except ApiException as e:
            if e.status != 404:
                raise
            if name == "default":
                return
            raise NotYet(f"waiting for ServiceAccount {self.ns}/{name}") from None
        if sa.get("automountServiceAccountToken") is False:
            return
        request = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": SA_TOKEN_SECONDS,
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod_name, "uid": self.uid},
            },
        }
        token = self.kl.call(self.kl.core.create_namespaced_service_account_token, name, self.ns, request)
        d = self.vol_dir / SA_VOLUME
        d.mkdir(parents=True, exist_ok=True)
        cfg = self.kl.api.configuration
        (d / "token").write_text(token["status"]["token"])
        (d / "ca.crt").write_bytes(Path(cfg.ssl_ca_cert).read_bytes())
        (d / "namespace").write_text(self.ns)
        kubeconfig = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "in-cluster",
                    "cluster": {"server": cfg.host, "certificate-authority": str(d / "ca.crt")},
                }
            ],
            "users": [{"name": name, "user": {"tokenFile": str(d / "token")}}],
            "contexts": [
                {
                    "name": "in-cluster",
                    "context": {"cluster": "in-cluster", "user": name, "namespace": self.ns},
                }
            ],
            "current-context": "in-cluster",
        }
        (d / "kubeconfig").write_text(json.dumps(kubeconfig))
        self.sa_env = {"KUBECONFIG": str(d / "kubeconfig")}
        for c in self.inits + self.mains:  # where the volume would be mounted: paths to it are rewritten
            mounts = c.spec.setdefault("volumeMounts", [])
            if not any(m["mountPath"] == SA_MOUNT for m in mounts):
                mounts.append({"name": SA_VOLUME, "mountPath": SA_MOUNT, "readOnly": True})
        self.log.info("%s: credentials of ServiceAccount %s written (KUBECONFIG)", self.key, name)

    def _rewrite_paths(self, c: Container, text: str) -> str:
        """Container paths under a volumeMount -> the volume's local directory (there is no mount)."""
        mounts = c.spec.get("volumeMounts") or []
        if not mounts or "/" not in text:
            return text
        local = {}
        for vm in mounts:
            mp = vm["mountPath"].rstrip("/") or "/"
            local[mp] = str(self._volume_dir(vm["name"]) / vm.get("subPath", "")).rstrip("/")
        pattern = "|".join(re.escape(p) for p in sorted(local, key=len, reverse=True))
        return re.sub(rf"(?<![-\w./])({pattern})(?=/|$|[^-\w.])", lambda m: local[m.group(1)], text)

"""The few Kubernetes API calls `ecrec chaos` makes, answered as JSON dicts (camelCase, as kubectl shows them)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ecrec.podlabels import LABEL_JOB

from .faults import (
    CHAOS_MESH_GROUP,
    CHAOS_MESH_VERSION,
    ECREC_GROUP,
    ECREC_PLURAL,
    ECREC_VERSION,
    PAUSE_NODE_LABEL,
    PODCHAOS_PLURAL,
    ChaosError,
    pause_patch,
)


def _kubeconfig_files(explicit: str | None) -> str | None:
    """The kubeconfig as kubectl finds it: --kubeconfig, else $KUBECONFIG (a list of files), else
    ~/.kube/config; None: in-cluster (the pod's service account)."""
    if explicit:
        return explicit
    env = os.environ.get("KUBECONFIG")
    if env and any(Path(p).expanduser().exists() for p in env.split(os.pathsep) if p):
        return env
    home = Path("~/.kube/config").expanduser()
    return str(home) if home.exists() else None


IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class Cluster:
    """The few API calls chaos makes, as JSON dicts."""

    def __init__(self, kubeconfig: str | None, context: str | None, namespace: str | None):
        try:
            from kubernetes import client, config
        except ImportError:
            raise ChaosError(
                "ecrec chaos needs the kubernetes client: pip install 'ecrec[operator]'"
            ) from None

        files = _kubeconfig_files(kubeconfig)
        if files is not None:
            self.api = config.new_client_from_config(config_file=files, context=context)
            _, active = config.list_kube_config_contexts(config_file=files)
            if context:
                contexts, _ = config.list_kube_config_contexts(config_file=files)
                active = next((c for c in contexts if c["name"] == context), active)
            default_ns = (active or {}).get("context", {}).get("namespace") or "default"
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            self.api = client.ApiClient(cfg)
            default_ns = (
                IN_CLUSTER_NAMESPACE.read_text().strip() if IN_CLUSTER_NAMESPACE.exists() else "default"
            )
        else:
            raise ChaosError(
                "no kubeconfig: pass --kubeconfig, set KUBECONFIG, create ~/.kube/config, or run in a pod"
            )
        self.namespace = namespace or default_ns
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def close(self) -> None:
        self.api.close()

    @staticmethod
    def _json(resp) -> Any:
        return json.loads(resp.data) if resp.data else None

    def job(self, name: str) -> dict:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._json(
                self.custom.get_namespaced_custom_object(
                    ECREC_GROUP, ECREC_VERSION, self.namespace, ECREC_PLURAL, name, _preload_content=False
                )
            )
        except ApiException as e:
            if e.status == 404:
                raise ChaosError(f"ECRecJob {self.namespace}/{name} not found") from None
            raise ChaosError(f"ECRecJob {self.namespace}/{name}: {e.status} {e.reason}") from None

    def pods(self, job: str) -> list[dict]:
        resp = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{LABEL_JOB}={job}", _preload_content=False
        )
        return self._json(resp)["items"]

    def node_honours_annotation(self, node: str) -> bool:
        from kubernetes.client.exceptions import ApiException

        if not node:
            return False
        try:
            obj = self._json(self.core.read_node(node, _preload_content=False))
        except ApiException:  # e.g. no permission to read nodes: then only --injector annotation uses it
            return False
        return (obj["metadata"].get("labels") or {}).get(PAUSE_NODE_LABEL) == "true"

    def nodes(self) -> list[dict]:
        return self._json(self.core.list_node(_preload_content=False))["items"]

    def node(self, name: str) -> dict:
        return self._json(self.core.read_node(name, _preload_content=False))

    def patch_node(self, name: str, body: dict) -> None:
        self.core.patch_node(name, body, _content_type="application/merge-patch+json")

    def has_chaos_mesh(self) -> bool:
        """Whether the API server serves PodChaos (discovery: every authenticated user may ask)."""
        from kubernetes.client.exceptions import ApiException

        try:
            resp = self.custom.get_api_resources(CHAOS_MESH_GROUP, CHAOS_MESH_VERSION, _preload_content=False)
        except ApiException:  # 404: the group is not served
            return False
        return any(r.get("name") == PODCHAOS_PLURAL for r in self._json(resp).get("resources", []))

    def delete_pod(self, name: str, grace: int) -> bool:
        """Deletes the pod; False if it was already gone (a NoExecute taint's eviction, the operator, a user)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=grace)
        except ApiException as e:
            if e.status != 404:
                raise
            return False
        return True

    def pause(self, pod: str, duration: float, fault_id: str) -> None:
        self.core.patch_namespaced_pod(pod, self.namespace, pause_patch(duration, fault_id))

    def create_pod_chaos(self, manifest: dict) -> None:
        self.custom.create_namespaced_custom_object(
            CHAOS_MESH_GROUP, CHAOS_MESH_VERSION, self.namespace, PODCHAOS_PLURAL, manifest
        )

    def delete_pod_chaos(self, name: str) -> None:
        from kubernetes.client.exceptions import ApiException

        try:
            self.custom.delete_namespaced_custom_object(
                CHAOS_MESH_GROUP, CHAOS_MESH_VERSION, self.namespace, PODCHAOS_PLURAL, name
            )
        except ApiException as e:
            if e.status != 404:
                raise

"""Reports: the pod's status subresource, written by its worker and nothing else.

Phase, conditions (PodScheduled, Initialized, ContainersReady, Ready), containerStatuses and
initContainerStatuses (waiting/running/terminated, exitCode, restartCount, lastState) with merge patches of
the `status` subresource; a patch is sent only when the status changed. A 404, or a 409/422 on a pod whose
UID changed (a new pod of the same name), means the object is gone: the worker stops.

`PodStatus` is a mixin of `PodWorker` (see pod.py); it uses `gone` (lifecycle.py).
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from .api import TERMINAL, now_iso
from .images import RUNTIME
from .pod import Container, PodBase


class PodStatus(PodBase):
    """The pod's phase, conditions and container statuses, and writing them (a mixin of PodWorker)."""

    def _cid(self, c: Container) -> str:
        return f"{RUNTIME}://{self.uid[:8]}-{c.name}-{c.runs}"

    def _phase(self) -> str:
        """Kubernetes' getPhase over the containers' states."""
        if self.failure or self.init_failed:
            return "Failed"
        if not self.initialized:
            return "Pending"
        waiting = running = stopped = succeeded = 0
        for c in self.mains:
            if c.proc is not None:
                running += 1
            elif c.done:
                stopped += 1
                succeeded += c.exit_code == 0
            elif c.last_state:  # in back-off after an exit
                stopped += 1
            else:
                waiting += 1
        if waiting:
            return "Pending"
        if running:
            return "Running"
        if self.policy == "Always":
            return "Running"
        if stopped == succeeded and all(c.done for c in self.mains):
            return "Succeeded"
        if self.policy == "Never":
            return "Failed"
        return "Running"

    def _cond(self, type_: str, ok: bool, reason: str | None = None, message: str | None = None) -> dict:
        status = "True" if ok else "False"
        old = self._conds.get(type_)
        if old is None or old["status"] != status:
            old = {"type": type_, "status": status, "lastProbeTime": None, "lastTransitionTime": now_iso()}
        cond = {**old}
        for k, v in (("reason", reason), ("message", message)):
            if v:
                cond[k] = v
            else:
                cond.pop(k, None)
        self._conds[type_] = cond
        return cond

    def _container_status(self, c: Container) -> dict:
        st: dict[str, Any] = {
            "name": c.name,
            "image": c.image,
            "imageID": f"{RUNTIME}://{c.image}",
            "ready": c.ready and c.proc is not None,
            "started": c.proc is not None and c.started,
            "restartCount": c.restart_count,
            "state": c.state,
            "lastState": c.last_state,
        }
        if c.runs:
            st["containerID"] = self._cid(c)
        return st

    def _status(self) -> dict:
        terminal = self.phase in TERMINAL
        not_ready = [c.name for c in self.mains if not (c.ready and c.proc is not None)]
        ready = not terminal and not not_ready and bool(self.mains)
        why = "PodCompleted" if terminal else ("ContainersNotReady" if not_ready else None)
        msg = (
            None if terminal or not not_ready else f"containers with unready status: [{' '.join(not_ready)}]"
        )
        pending_init = [c.name for c in self.inits if not c.done]
        conds = [
            self._cond(
                "Initialized",
                self.initialized or terminal,
                None if self.initialized or terminal else "ContainersNotInitialized",
                None
                if self.initialized or terminal
                else f"containers with incomplete status: [{' '.join(pending_init)}]",
            ),
            self._cond("Ready", ready, why, msg),
            self._cond("ContainersReady", ready, why, msg),
            self._cond("PodScheduled", True),
        ]
        status: dict[str, Any] = {
            "phase": self.phase,
            "conditions": conds,
            "hostIP": "127.0.0.1",
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "containerStatuses": [self._container_status(c) for c in self.mains],
            "reason": self.failure[0] if self.failure else None,
            "message": self.failure[1] if self.failure else None,
        }
        if self.inits:
            status["initContainerStatuses"] = [self._container_status(c) for c in self.inits]
        return status

    def _write_status(self) -> None:
        status = self._status()
        text = json.dumps(status, sort_keys=True)
        if text == self._written or self._gone.is_set():
            return
        try:
            # merge patch: strategic merge appends to podIPs (422); the uid fails the patch on a new pod
            self.kl.call(
                self.kl.core.patch_namespaced_pod_status,
                self.pod_name,
                self.ns,
                {"metadata": {"uid": self.uid}, "status": status},
                _content_type="application/merge-patch+json",
            )
            self._written = text
        except ApiException as e:
            if e.status == 404 or (e.status in (409, 422) and self._uid_changed()):
                self.gone()  # deleted, or replaced by a new pod of the same name
            else:
                self.log.warning("%s: status write failed: %s %s", self.key, e.status, e.reason)

    def _uid_changed(self) -> bool:
        try:
            return (
                self.kl.call(self.kl.core.read_namespaced_pod, self.pod_name, self.ns)["metadata"]["uid"]
                != self.uid
            )
        except ApiException:
            return True

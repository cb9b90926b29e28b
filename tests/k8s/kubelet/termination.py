"""Deletes and kills: a container's or a whole pod's processes stopped, SIGTERM then SIGKILL.

On a pod's deletionTimestamp, SIGTERM to every container's process group, SIGKILL after the grace period (the
delete's, else terminationGracePeriodSeconds), then the pod object is removed (grace 0, UID precondition).
The same SIGTERM..SIGKILL kills one container whose startup or liveness probe failed (probes.py), and every
process on the kubelet's `stop()` (its stop_grace bounds every grace period). A paused process (pauses.py)
gets SIGCONT right after its SIGTERM, so that it handles it.

`PodTermination` is a mixin of `PodWorker` (see pod.py); it uses `_resume` (pauses.py) and `_cid`, `_phase`,
`_write_status` (status.py).
"""

from __future__ import annotations

import signal
import subprocess
import time

from kubernetes.client.exceptions import ApiException

from .api import TERMINAL, now_iso
from .pod import Container, PodBase
from .processes import killpg


class PodTermination(PodBase):
    """Stopping a pod's processes and removing its object (a mixin of PodWorker)."""

    def _grace(self) -> float:
        meta, spec = self.pod["metadata"], self.pod["spec"]
        g = meta.get("deletionGracePeriodSeconds")
        if g is None:
            g = spec.get("terminationGracePeriodSeconds", 30)
        return float(g)

    def _kill_container(self, c: Container, why: str) -> None:
        self.log.info("%s: container %s: %s, killing it", self.key, c.name, why)
        if c.proc is not None:
            killpg(c.proc.pid, signal.SIGTERM)
            if self._paused_until is not None:
                killpg(c.proc.pid, signal.SIGCONT)  # a paused process handles its SIGTERM
            c.kill_at = time.monotonic() + self._grace()

    def _kill_all(self, grace: float) -> None:
        """SIGTERM every container's process group, SIGKILL after `grace` s; waits for them."""
        running = [c for c in self.inits + self.mains if c.proc is not None]
        if not running:
            return
        sig = signal.SIGTERM if grace > 0 else signal.SIGKILL
        for c in running:
            killpg(c.proc.pid, sig)
        self._resume("stopping the pod")  # after the signal: a paused process handles it before anything else
        deadline = time.monotonic() + grace
        while grace > 0 and time.monotonic() < deadline and any(c.proc.poll() is None for c in running):
            if self._gone.is_set() and not self.kl._stopping.is_set():
                break  # force-deleted meanwhile: no more grace
            if self.kl._stopping.is_set():
                deadline = min(deadline, self.kl._stop_deadline)  # stop() bounds every grace period
            time.sleep(0.05)
        for c in running:
            killpg(c.proc.pid, signal.SIGKILL)
            try:
                rc = c.proc.wait(10)
            except subprocess.TimeoutExpired:  # cannot happen after SIGKILL, short of a D-state process
                self.log.error("%s: pid %d survived SIGKILL", self.key, c.proc.pid)
                continue
            self._exited_final(c, rc)

    def _exited_final(self, c: Container, rc: int) -> None:
        code, sig = (128 - rc, -rc) if rc < 0 else (rc, None)
        term = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": c.state.get("running", {}).get("startedAt", now_iso()),
            "finishedAt": now_iso(),
            "containerID": self._cid(c),
        }
        if sig:
            term["signal"] = sig
        self.log.info("%s: container %s stopped, exit code %d", self.key, c.name, code)
        c.proc, c.ready, c.done, c.exit_code = None, False, True, code
        c.state = {"terminated": term}

    def _terminate(self) -> None:
        """The pod is being deleted: stop its processes within the grace period, then remove the object."""
        grace = self._grace()
        self.log.info("%s: deleting (grace %gs)", self.key, grace)
        self._kill_all(grace=grace)
        if self.phase not in TERMINAL:
            self.phase = self._phase()
        self._write_status()
        try:
            self.kl.call(
                self.kl.core.delete_namespaced_pod,
                self.pod_name,
                self.ns,
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}},
            )
            self.log.info("%s: pod object removed", self.key)
        except ApiException as e:
            if e.status not in (404, 409):  # gone already, or a new pod of that name (not ours to delete)
                raise

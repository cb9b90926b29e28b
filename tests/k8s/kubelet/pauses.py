"""Pauses: the stand-in for Chaos Mesh's pod-failure, used by `ecrec chaos`.

A new value of the pod annotation `chaos.ecrec.dev/pause-id` with `chaos.ecrec.dev/pause-seconds: S` SIGSTOPs
every running container's process group and SIGCONTs it S seconds later; the pod stays Running and probes go
on. A pod being deleted or killed gets SIGCONT right after its SIGTERM (termination.py), so a paused process
still handles it. The node carries the label `chaos.ecrec.dev/pause-annotation=true` (node.py) to say it
honours the annotation.

`PodPauses` is a mixin of `PodWorker` (see pod.py).
"""

from __future__ import annotations

import math
import signal
import time

from ecrec.chaos import PAUSE_ID, PAUSE_SECONDS

from .pod import PodBase
from .processes import killpg


class PodPauses(PodBase):
    """SIGSTOP/SIGCONT of a pod's processes on its pause annotations (a mixin of PodWorker)."""

    def _pause_request(self) -> tuple[float, str] | None:
        """(seconds, id) of the pod's pause annotations, if it has valid ones."""
        ann = self.pod["metadata"].get("annotations") or {}
        pause_id, seconds = ann.get(PAUSE_ID), ann.get(PAUSE_SECONDS)
        try:
            s = float(seconds)
        except (TypeError, ValueError):
            return None
        return (s, pause_id) if pause_id and math.isfinite(s) and s > 0 else None

    def _pause_tick(self) -> None:
        """Starts a newly asked-for pause (SIGSTOP) and ends a pause whose time is up (SIGCONT)."""
        req = self._pause_request()
        if req is not None and req[1] != self._pause_id:
            self._pause_id = req[1]
            until = time.monotonic() + req[0]
            self._paused_until = max(until, self._paused_until or until)
            for c in self.inits + self.mains:
                if c.proc is not None:
                    killpg(c.proc.pid, signal.SIGSTOP)
            self.log.info("%s: paused for %gs (pause id %s)", self.key, req[0], req[1])
        if self._paused_until is not None and time.monotonic() >= self._paused_until:
            self._resume("the pause is over")

    def _resume(self, why: str) -> None:
        if self._paused_until is None:
            return
        self._paused_until = None
        for c in self.inits + self.mains:
            if c.proc is not None:
                killpg(c.proc.pid, signal.SIGCONT)
        self.log.info("%s: resumed: %s", self.key, why)

"""A pod's life on this node, from its binding to the removal of its object: one `PodWorker` thread per pod.

- **admits** the pod: its pod IP (ips.py; `hostNetwork` pods get 127.0.0.1), its working directory; an image
  without a local stand-in (images.py) fails it with ErrImagePull, a volume type that is not supported
  (volumes.py) with UnsupportedVolume.
- **runs** each container's command/args (`$(VAR)` references expanded as Kubernetes does, env.py) as a local
  process in its own session (processes.py), with the env of the pod spec only. With `fork_ecrec`, a command
  that is the `ecrec` entrypoint is forked from a fork server (ecrec.forkserver) instead. Init containers run
  first, one after the other. A container that cannot start (no executable, no working directory) exits 128
  with reason StartError.
- **honours restartPolicy**: Always/OnFailure restart the container (restartCount+1) after a back-off of
  0.5 s doubling to 10 s (CrashLoopBackOff meanwhile); Never leaves it terminated and the pod ends Succeeded
  (all exited 0) or Failed. Restart counts of a pod that an earlier kubelet ran are kept: its next start is a
  restart.

Each round of the loop honours a deletion or a stop (termination.py), a pause (pauses.py), drives the
containers (probes.py for the running ones) and writes the status if it changed (status.py).

- **crashes** with its node's machine (`crash`, outages.py): its process groups SIGKILLed at once, and the
  worker ends at its next round or status write (`Crashed`), wherever it was (a deletion's grace period too),
  having written nothing more: a dead machine reports nothing and removes no pod object.

Threads: every process of the pod is started from the worker's thread, so PR_SET_PDEATHSIG ties them to it.
The worker's state (pod.py's PodBase) belongs to its thread; other threads only call `update`, `gone`,
`wake` and `crash` (which also reads each container's current process, to SIGKILL it at once).
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from typing import Any

from .api import TERMINAL, now_iso
from .dns import PodDNS
from .env import PodEnv, expand
from .images import VENV, image_for, which
from .pauses import PodPauses
from .pod import Container, KubeletHost, NotYet, PodFails, ProbeState
from .probes import PodProbes
from .processes import killpg, spawn
from .status import PodStatus
from .termination import PodTermination
from .volumes import VOLUME_KINDS, PodVolumes

BACKOFF_START, BACKOFF_MAX, BACKOFF_RESET_AFTER = 0.5, 10.0, 10.0


class Crashed(Exception):
    """Unwinds a crashed worker (its node's machine died) before it writes anything: from its loop, or from
    inside a deletion, whose status write and object removal must not happen."""


class PodWorker(
    PodEnv, PodDNS, PodVolumes, PodProbes, PodPauses, PodTermination, PodStatus, threading.Thread
):
    """Runs one pod from its binding to the removal of its object; the only writer of that pod's status.

    Every process of the pod is started from this thread, so PR_SET_PDEATHSIG ties them to it: when it ends,
    whatever it left running is SIGKILLed by the kernel."""

    def __init__(self, kubelet: KubeletHost, pod: dict):
        meta = pod["metadata"]
        super().__init__(name=f"pod-{meta['namespace']}/{meta['name']}", daemon=True)
        self.kl = kubelet
        self.log = kubelet.log
        self.pod = pod
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.pod_name: str = meta["name"]
        self.key = f"{self.ns}/{self.pod_name}"
        self.dir = kubelet.out_dir / "pods" / f"{self.ns}_{self.pod_name}"
        self.vol_dir = self.dir / f"volumes-{self.uid[:8]}"
        self.work_dir = self.dir / "work"
        self.sa_env: dict[str, str] = {}  # KUBECONFIG of the pod's service-account credentials, if any
        self.ip: str | None = None
        self.start_time = (pod.get("status") or {}).get("startTime") or now_iso()
        spec = pod["spec"]
        self.policy: str = spec.get("restartPolicy", "Always")
        self.inits = [Container(c, True) for c in spec.get("initContainers") or []]
        self.mains = [Container(c, False) for c in spec.get("containers") or []]
        self._adopt_counts(pod)
        self.initialized = not self.inits
        self.volumes_ready = False
        self.failure: tuple[str, str] | None = None  # (reason, message): the pod Failed here
        self.init_failed = False
        self.phase = "Pending"
        self._conds: dict[str, dict] = {}
        self._written: str | None = None
        self._wake = threading.Event()
        self._gone = threading.Event()  # the object left the API (force-deleted, or deleted by us)
        self._crashed = threading.Event()  # its node's machine died (crash()): write nothing, end
        self._next_wait = 0.0  # monotonic time before which NotYet conditions are not retried
        # Pauses (chaos): one asked for before this worker admitted the pod is not for its processes.
        self._pause_id = (self._pause_request() or (0.0, None))[1]
        self._paused_until: float | None = None  # monotonic time of the SIGCONT while paused

    # -- called from other threads --
    def update(self, pod: dict) -> None:
        self.pod = pod
        self._wake.set()

    def gone(self) -> None:
        self._gone.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def crash(self) -> None:
        """Its node's machine died (outages.py): every process group SIGKILLed now, from the caller's thread
        (the worker may be waiting on the API or in a grace period); the worker ends without writing anything.
        The flag is set before the kill: a worker that sees a process gone by it sees the flag too."""
        self._crashed.set()
        for c in self.inits + self.mains:
            proc = c.proc
            if proc is not None:
                killpg(proc.pid, signal.SIGKILL)
        self._wake.set()

    # -- the loop --
    def run(self) -> None:
        try:
            self._run()
        except Crashed:
            self.log.info("%s: its node's machine died: processes killed, nothing reported", self.key)
        except Exception:
            self.log.exception("%s: pod worker failed", self.key)
        finally:
            self._kill_all(grace=0)
            self.kl._forget(self)

    def _run(self) -> None:
        self._setup()
        while True:
            if self._crashed.is_set():
                raise Crashed
            if self._gone.is_set():
                self.log.info("%s: the pod object is gone; killing its processes", self.key)
                self._kill_all(grace=0)
                return
            if self.kl._stopping.is_set():
                self._kill_all(grace=self.kl.stop_grace)
                return
            if self.pod["metadata"].get("deletionTimestamp"):
                self._terminate()
                return
            self._pause_tick()
            if self.phase not in TERMINAL:
                self._step()
            self._write_status()
            self._wake.wait(0.1)
            self._wake.clear()

    def _write_status(self) -> None:
        """PodStatus's, unless the node's machine died: then the worker unwinds (Crashed) instead, even from
        inside a deletion (termination.py), which would otherwise report and remove the pod object."""
        if self._crashed.is_set():
            raise Crashed
        super()._write_status()

    def _setup(self) -> None:
        status = self.pod.get("status") or {}
        if self.pod["spec"].get("hostNetwork"):
            self.ip = "127.0.0.1"
        else:
            self.ip = self.kl.ips.allocate(prefer=status.get("podIP"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.log.info("%s: admitted, pod IP %s", self.key, self.ip)
        unknown = [c for c in self.inits + self.mains if image_for(c.image) is None]
        if unknown:
            c = unknown[0]
            msg = (
                f'image "{c.image}" (container {c.name}) is not known to the test kubelet: it runs only images'
                f" named ecrec or ecrec-operator, from this repository's .venv"
                " (see image_for in tests/k8s/kubelet/images.py)"
            )
            self._fail(PodFails("ErrImagePull", msg), unknown)
            return
        for v in self.pod["spec"].get("volumes") or []:
            if not any(k in v for k in VOLUME_KINDS):
                kind = next((k for k in v if k != "name"), "?")
                msg = f"volume {v['name']} ({kind}): the test kubelet supports {', '.join(VOLUME_KINDS)}"
                self._fail(PodFails("UnsupportedVolume", msg), self.inits + self.mains)
                return

    def _fail(self, e: PodFails, containers: list[Container]) -> None:
        """Ends the pod Failed for a reason of its own (not a container's exit); `containers` wait for it."""
        self.log.warning("%s: Failed: %s: %s", self.key, e.reason, e.message)
        self.failure = (e.reason, e.message)
        for c in containers:
            if c.proc is None and "waiting" in c.state:
                c.state = {"waiting": {"reason": e.reason, "message": e.message}}
        self.phase = "Failed"

    def _adopt_counts(self, pod: dict) -> None:
        """Keeps restart counts of a pod that an earlier kubelet ran (its processes died with it)."""
        status = pod.get("status") or {}
        for key, containers in (("initContainerStatuses", self.inits), ("containerStatuses", self.mains)):
            old = {s["name"]: s for s in status.get(key) or []}
            for c in containers:
                s = old.get(c.name)
                if s and ("running" in s.get("state", {}) or "terminated" in s.get("state", {})):
                    c.restart_count, c.runs = s.get("restartCount", 0), 1  # the next start is a restart

    # -- one round --
    def _step(self) -> None:
        if not self.volumes_ready:
            if time.monotonic() < self._next_wait:
                return
            try:
                self._make_volumes()
                self._service_account()
                self.volumes_ready = True
            except NotYet as e:
                self._waiting_all("ContainerCreating", str(e))
                self._next_wait = time.monotonic() + 0.5
                return
            except PodFails as e:
                self._fail(e, self.inits + self.mains)
                return
        if not self.initialized:
            pending = next((c for c in self.inits if not c.done), None)
            if pending is None:
                self.initialized = True
            else:
                self._drive(pending)
                if pending.done and pending.exit_code != 0:  # restartPolicy Never: the pod fails
                    self.init_failed = True
                elif pending.done:
                    self._wake.set()  # next init container (or the main ones) at once
                if not self.initialized:
                    self.phase = self._phase()
                    return
        for c in self.mains:
            self._drive(c)
        self.phase = self._phase()
        if self.phase in TERMINAL:
            self._kill_all(grace=0)  # nothing should run by now; stragglers of the process groups go

    def _waiting_all(self, reason: str, message: str) -> None:
        for c in self.inits + self.mains:
            if c.proc is None and not c.done and "waiting" in c.state:
                c.state = {"waiting": {"reason": reason, "message": message}}

    def _drive(self, c: Container) -> None:
        now = time.monotonic()
        if c.proc is None:
            if c.done or now < c.restart_at or now < self._next_wait:
                return
            self._start(c)
            return
        if c.kill_at is not None and now >= c.kill_at:
            killpg(c.proc.pid, signal.SIGKILL)
            c.kill_at = now + 3600
        rc = c.proc.poll()
        if rc is None:
            self._probe_all(c)
            return
        self._exited(c, rc)

    def _start(self, c: Container) -> None:
        image = image_for(c.image)
        assert image is not None  # checked in _setup
        try:
            env = self._env(c, image)
        except NotYet as e:
            c.state = {"waiting": {"reason": "ContainerCreating", "message": str(e)}}
            self._next_wait = time.monotonic() + 0.5
            return
        except PodFails as e:  # fail fast: a test waiting for Running would otherwise only time out
            self._fail(e, [c])
            return
        c.env = env
        spec = c.spec
        command, args = spec.get("command"), spec.get("args")
        if command:
            argv = list(command) + list(args or [])
        else:
            argv = list(image.entrypoint) + list(args if args else image.cmd)
        # paths first, then $(VAR): env values are rewritten already and must not be rewritten twice
        argv = [expand(self._rewrite_paths(c, a), env) for a in argv]
        cwd = self.work_dir
        if spec.get("workingDir"):
            cwd = Path(self._rewrite_paths(c, spec["workingDir"]))
        if c.runs:
            c.restart_count += 1
        c.runs += 1
        logfile = self.dir / f"{c.name}.log"
        exe = which(argv[0], env) if argv else None
        with open(logfile, "a") as out:
            out.write(f"===== {now_iso()} {self.key} container {c.name} start #{c.runs}: {argv}\n")
            out.flush()
            if not argv or exe is None or not cwd.is_dir():
                why = (
                    "no command and the image has no ENTRYPOINT"
                    if not argv
                    else f"executable {argv[0]!r} not found on PATH {env['PATH']}"
                    if exe is None
                    else f"working directory {cwd} does not exist"
                )
                out.write(f"===== StartError: {why}\n")
                self.log.warning("%s: container %s cannot start: %s", self.key, c.name, why)
                c.started_mono = time.monotonic()
                c.state = {"running": {"startedAt": now_iso()}}
                self._exited(c, 128, reason="StartError", message=why)
                return
            if self.kl.fork_ecrec and Path(exe) == VENV / "bin" / "ecrec":
                c.proc = self.kl.forked(argv[1:], env, logfile, c.name, cwd)
            else:
                c.proc = spawn([exe, *argv[1:]], env, cwd, out)
        c.started_mono = time.monotonic()
        c.state = {"running": {"startedAt": now_iso()}}
        c.ready = False
        c.kill_at = None
        c.probes = {}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if spec.get(kind) and not c.init:
                p = spec[kind]
                c.probes[kind] = ProbeState(p, c.started_mono + p.get("initialDelaySeconds", 0))
        c.started = "startupProbe" not in c.probes
        self.log.info("%s: container %s started, pid %d: %s", self.key, c.name, c.proc.pid, argv)

    def _exited(self, c: Container, rc: int, reason: str | None = None, message: str | None = None) -> None:
        if c.proc is not None:
            killpg(c.proc.pid, signal.SIGKILL)  # what the process left behind in its group
        code, sig = (128 - rc, -rc) if rc < 0 else (rc, None)
        term: dict[str, Any] = {
            "exitCode": code,
            "reason": reason or ("Completed" if code == 0 else "Error"),
            "startedAt": c.state.get("running", {}).get("startedAt", now_iso()),
            "finishedAt": now_iso(),
            "containerID": self._cid(c),
        }
        if sig:
            term["signal"] = sig
        if message:
            term["message"] = message
        self.log.info("%s: container %s exited %d (%s)", self.key, c.name, code, term["reason"])
        ran = time.monotonic() - c.started_mono
        c.proc, c.ready, c.started, c.exit_code, c.kill_at = None, False, False, code, None
        restart = (
            (self.policy != "Never" and code != 0)
            if c.init
            else (self.policy == "Always" or (self.policy == "OnFailure" and code != 0))
        )
        if not restart:
            c.done = True
            c.state = {"terminated": term}
            return
        c.quick_exits = c.quick_exits + 1 if ran < BACKOFF_RESET_AFTER else 1
        delay = min(BACKOFF_MAX, BACKOFF_START * 2 ** (c.quick_exits - 1))
        c.restart_at = time.monotonic() + delay
        c.last_state = {"terminated": term}
        c.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={c.name} pod={self.pod_name}",
            }
        }

"""Probes: readiness, liveness and startup, each httpGet (on the pod IP), tcpSocket or exec.

Each with its delays, periods, timeouts and thresholds; no readiness probe = ready once running. A failed
startup or liveness probe kills the container (SIGTERM, SIGKILL after the grace period: termination.py), and
restartPolicy decides what follows (lifecycle.py). Probes go on while a pod is paused (pauses.py).

`PodProbes` is a mixin of `PodWorker` (see pod.py); it uses `_kill_container` (termination.py).
"""

from __future__ import annotations

import http.client
import ipaddress
import signal
import socket
import ssl
import subprocess
import time

from .images import which
from .pod import Container, PodBase, ProbeState
from .processes import killpg, spawn


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PodProbes(PodBase):
    """The probes of a pod's running containers (a mixin of PodWorker)."""

    def _probe_all(self, c: Container) -> None:
        now = time.monotonic()
        if c.kill_at is not None:
            return  # being killed
        if not c.started:
            st = c.probes["startupProbe"]
            if now >= st.next_at:
                ok = self._probe_once(c, st)
                if ok is True:
                    c.started = True
                    now = time.monotonic()
                    for kind in ("readinessProbe", "livenessProbe"):
                        if kind in c.probes:
                            c.probes[kind].next_at = max(c.probes[kind].next_at, now)
                elif ok is False:
                    self._kill_container(c, "startup probe failed")
            if not c.started:
                return
        rp = c.probes.get("readinessProbe")
        if rp is None:
            c.ready = True
        elif now >= rp.next_at:
            ok = self._probe_once(c, rp)
            if ok is not None:
                c.ready = ok
        lp = c.probes.get("livenessProbe")
        if lp is not None and now >= lp.next_at and self._probe_once(c, lp) is False:
            self._kill_container(c, "liveness probe failed")

    def _probe_once(self, c: Container, st: ProbeState) -> bool | None:
        """Runs the probe; returns True/False once a threshold is crossed, else None (no verdict yet)."""
        spec = st.spec
        st.next_at = time.monotonic() + spec.get("periodSeconds", 10)
        ok = self._probe(c, spec)
        if ok:
            st.successes, st.failures = st.successes + 1, 0
            return True if st.successes >= spec.get("successThreshold", 1) else None
        st.failures, st.successes = st.failures + 1, 0
        return False if st.failures >= spec.get("failureThreshold", 3) else None

    def _probe(self, c: Container, spec: dict) -> bool:
        timeout = spec.get("timeoutSeconds", 1)
        try:
            if "exec" in spec:
                cmd = spec["exec"].get("command") or []
                exe = which(cmd[0], c.env) if cmd else None
                if exe is None:
                    return False
                with spawn([exe, *cmd[1:]], c.env, self.work_dir, subprocess.DEVNULL) as p:
                    try:
                        return p.wait(timeout) == 0
                    except subprocess.TimeoutExpired:
                        killpg(p.pid, signal.SIGKILL)
                        p.wait()
                        return False
            if "httpGet" in spec:
                h = spec["httpGet"]
                host, port = h.get("host") or self.ip, self._port(c, h["port"])
                if not is_loopback(host):
                    self.log.warning(
                        "%s: probe host %s is not a loopback address: failing it", self.key, host
                    )
                    return False
                if h.get("scheme", "HTTP").upper() == "HTTPS":
                    ctx = ssl.create_default_context()
                    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # as the kubelet: no checks
                    conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                        host, port, timeout=timeout, context=ctx
                    )
                else:
                    conn = http.client.HTTPConnection(host, port, timeout=timeout)
                try:
                    headers = {x["name"]: x["value"] for x in h.get("httpHeaders") or []}
                    conn.request("GET", h.get("path") or "/", headers=headers)
                    return 200 <= conn.getresponse().status < 400
                finally:
                    conn.close()
            if "tcpSocket" in spec:
                t = spec["tcpSocket"]
                host = t.get("host") or self.ip
                if not is_loopback(host):
                    return False
                with socket.create_connection((host, self._port(c, t["port"])), timeout=timeout):
                    return True
        except (OSError, http.client.HTTPException):
            return False
        return False

    @staticmethod
    def _port(c: Container, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for cp in c.spec.get("ports") or []:
            if cp.get("name") == port:
                return int(cp["containerPort"])
        raise OSError(f"no port named {port}")

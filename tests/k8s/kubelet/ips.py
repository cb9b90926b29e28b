"""Pod IPs: each pod gets its own loopback IP 127.0.x.y as status.podIP.

Never 127.0.0.0/24, nor the Service ranges 127.0.7.0/24-127.0.10.0/24 of the test control planes; Linux routes all of 127/8 to `lo`,
so a process binds its pod IP without any setup. The processes must bind their pod IP (env from
`status.podIP`), not 0.0.0.0: they share one network namespace. `hostNetwork` pods get 127.0.0.1 (not from
here).

`IPAllocator._lock` guards its cursor and the set of IPs in use; nothing is called with it held.
"""

from __future__ import annotations

import random
import threading


class IPAllocator:
    """Pod IPs 127.0.x.y (x in 1..254 except 7 to 10, y in 1..254), handed out round-robin from a random start,
    so that two kubelets on one machine (two test sessions) rarely meet and a freed IP is not reused at once."""

    # 127.0.0.0/24 is the host's own; 127.0.10.0/24, .9, .8 and .7 are Service IPs (the main control plane's,
    # the Helm tests', hack/k8s-up's under tests/k8s/test_hack_k8s_up.py, the multinode fixture's): a pod there
    # could take the address and port a kubelet's Service proxy listens on
    XS = [x for x in range(1, 255) if x not in (7, 8, 9, 10)]

    def __init__(self, seed: int | None = None):
        self._n = len(self.XS) * 254
        self._cursor = random.Random(seed).randrange(self._n)
        self._used: set[str] = set()
        self._lock = threading.Lock()

    def _ip(self, i: int) -> str:
        return f"127.0.{self.XS[i // 254]}.{i % 254 + 1}"

    def allocate(self, prefer: str | None = None) -> str:
        with self._lock:
            if prefer and prefer not in self._used and self.valid(prefer):
                self._used.add(prefer)
                return prefer
            for k in range(self._n):
                i = (self._cursor + k) % self._n
                ip = self._ip(i)
                if ip not in self._used:
                    self._cursor = i + 1
                    self._used.add(ip)
                    return ip
        raise RuntimeError("no free pod IP")

    def release(self, ip: str | None) -> None:
        with self._lock:
            self._used.discard(ip)

    @classmethod
    def valid(cls, ip: str) -> bool:
        parts = ip.split(".")
        return (
            len(parts) == 4
            and parts[:2] == ["127", "0"]
            and all(p.isdigit() for p in parts)
            and int(parts[2]) in cls.XS
            and 1 <= int(parts[3]) <= 254
        )


IPS = IPAllocator()  # shared by the kubelets of one process: two of them never hand out the same IP

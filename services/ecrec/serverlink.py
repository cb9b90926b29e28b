"""A parameter server process's side of the coordinator: its copy of the cluster map, its registration and
heartbeats, and a warm spare's wait for a shard.

- `ClusterView`: this process's copy of the cluster map, refreshed from the heartbeat answers (and fetched
  when a request names an epoch this copy has not seen yet). `lock` guards `snapshot` (replaced whole, never
  mutated); `_refresh_lock` serialises fetches of the map (at most one per 50 ms) and is taken before `lock`,
  never with it held. No call to the coordinator is made with `lock` held.
- `CoordinatorLink`: registration (refusals asked again until a deadline) and the heartbeat loop, which exits
  the process once the coordinator no longer lists it as its shard's.
- `wait_as_spare`: a warm spare's registration and long-poll heartbeats until it is assigned a failed shard.

Every call goes through `ecrec.coordinator.client.CoordinatorClient`; the retrying and the patience are here.
Nothing here imports the servicer (`ecrec.server`), which uses these.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import httpx

from ecrec.coordinator.client import CoordinatorClient, Refused
from ecrec.coordinator.contract import Heartbeat, RegisterServer, SpareIn

log = logging.getLogger("ecrec.server")  # the server process's log, as before these calls had a module


class ClusterView:
    """This process's copy of the cluster map (addresses and states by shard id)."""

    def __init__(self, coordinator: str = "", snapshot: dict | None = None, token: str | None = None):
        self.lock = threading.Lock()
        self.snapshot = snapshot or {"epoch": 0, "shards": []}
        # None: no coordinator (a standalone server, a benchmark's in-process servicer)
        self.coordinator = CoordinatorClient(coordinator, token=token, timeout=5.0) if coordinator else None
        self._refresh_lock = threading.Lock()
        self._refreshed_at = 0.0

    @property
    def epoch(self) -> int:
        return int(self.snapshot["epoch"])

    def update(self, snapshot: dict) -> bool:
        with self.lock:
            if int(snapshot["epoch"]) >= self.epoch:
                self.snapshot = snapshot
                return True
            return False

    def refresh(self) -> None:
        if self.coordinator is not None:
            self.update(self.coordinator.cluster())

    def confirm(self, epoch: int) -> bool:
        """Is `epoch` published by the coordinator? Fetches the map if this view is behind, at most once per
        50 ms however many requests ask (one fetch answers them all; a flood of made-up epochs costs the
        coordinator 20 requests a second at most)."""
        if epoch <= self.epoch:
            return True
        with self._refresh_lock:
            if epoch <= self.epoch:
                return True
            if self.coordinator is None or time.monotonic() - self._refreshed_at < 0.05:
                return False
            self._refreshed_at = time.monotonic()
            with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
                self.refresh()
            return epoch <= self.epoch

    def shard(self, s: int) -> dict:
        with self.lock:
            shards = self.snapshot["shards"]
            return shards[s] if 0 <= s < len(shards) else {"state": "pending", "address": ""}

    def address(self, s: int) -> str:
        return self.shard(s)["address"]

    def is_failed(self, s: int) -> bool:
        return self.shard(s)["state"] == "failed"

    def confirm_failed(self, s: int, reporter: str) -> bool:
        """Ask the coordinator to confirm (probe) a peer we could not reach; True if it is failed."""
        if self.coordinator is None:
            return True
        try:
            self.update(self.coordinator.report_failure(s, reporter, timeout=10.0)["cluster"])
        except httpx.HTTPError:
            time.sleep(0.2)
        return self.is_failed(s)


class CoordinatorLink:
    """Registration and heartbeats of one server; exits the process if the coordinator disowns it."""

    def __init__(
        self,
        url: str,
        shard: int,
        address: str,
        metrics_url: str,
        interval: float,
        instance: str,
        token: str | None = None,
    ):
        self.shard, self.address, self.metrics_url = shard, address, metrics_url
        self.interval, self.instance = interval, instance
        self.incarnation = 0  # as the coordinator counted it at registration: what a rejoin claims
        self.coordinator = CoordinatorClient(url, token=token, timeout=5.0)

    def register(self, replacement: bool, deadline_s: float = 60.0) -> dict:
        end = time.monotonic() + deadline_s
        while True:
            try:
                body = self.coordinator.register_server(
                    RegisterServer(
                        shard=self.shard,
                        address=self.address,
                        instance=self.instance,
                        metricsUrl=self.metrics_url,
                        replacement=replacement,
                        cpuSeconds=time.process_time(),
                    )
                )
                self.incarnation = int(body["cluster"]["shards"][self.shard].get("incarnation", 0))
                return body
            except Refused as e:
                # Refused: the process this one replaces may still answer for a moment (a pod being
                # terminated); ask again until the deadline, then give up and say why.
                if time.monotonic() > end:
                    raise RuntimeError(f"registration refused: {e.detail}") from e
                log.warning("registration refused, asking again: %s", e.detail)
                time.sleep(1.0)
            except httpx.HTTPError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.2)

    def heartbeat_forever(
        self, servicer, stop: threading.Event, expire_now: threading.Event | None = None
    ) -> None:
        """Heartbeats until `stop`; each answer brings the map and the worker processes known to be gone, and
        `expire_now` is set when one of those is new (what it staged here is settled at once). `servicer` is
        the process's `ecrec.server.ParameterServicer` (its store, view and metrics)."""
        store = servicer.store
        while not stop.wait(self.interval):
            try:
                body = self.coordinator.server_heartbeat(
                    Heartbeat(
                        shard=self.shard,
                        address=self.address,
                        instance=self.instance,
                        epoch=store.epoch,
                        recovered=store.replacement and store.recovery_done(),
                        rowsRecovered=store.stats["rows_recovered"],
                        # so that a coordinator replacing a dead one can admit this process (a rejoin)
                        incarnation=self.incarnation,
                        metricsUrl=self.metrics_url,
                        cpuSeconds=time.process_time(),
                        forwardsHeld=store.forwards_held(),
                    )
                )
            except httpx.HTTPError as e:
                log.warning("heartbeat failed: %s", e)
                continue
            if not body["ok"]:
                log.error("the coordinator no longer lists this process as shard %d; exiting", self.shard)
                stop.set()
                os.kill(os.getpid(), signal.SIGTERM)
                return
            servicer.view.update(body["cluster"])
            store.hold_forwards(bool(body.get("rollingBack")))
            store.epoch = max(store.epoch, int(body["epoch"]))
            servicer.metrics.of(servicer.metrics.epoch).set(store.epoch)
            try:
                fenced = store.fence_workers(body.get("workersGone") or {})
            except (AttributeError, TypeError, ValueError) as e:  # a malformed list must not stop heartbeats
                log.warning("heartbeat: ignoring workersGone %r: %s", body.get("workersGone"), e)
                fenced = False
            if fenced and expire_now is not None:
                expire_now.set()


def wait_as_spare(
    url: str,
    instance: str,
    interval: float,
    token: str | None,
    stop: threading.Event,
    serving: threading.Event,
) -> int | None:
    """A warm spare (servers.spares, ecrec.core.spares): register without a shard and heartbeat until the
    coordinator assigns one; returns it, or None when the job finished (or this process was told to stop).
    Everything slow about starting a server (the interpreter, imports, the job) is done before this. Once
    assigned, a thread goes on heartbeating as the spare until `serving` is set (registered as the shard): a
    takeover that takes longer than the failure timeout must not look like a dead spare."""
    # Heartbeats are long polls of `interval` each: the coordinator answers at once when it assigns a shard.
    coordinator = CoordinatorClient(url, token=token, timeout=5.0 + interval)
    ask, last_log = coordinator.register_spare, 0.0

    def keep_alive() -> None:
        while not serving.wait(interval) and not stop.is_set():
            try:
                coordinator.spare_heartbeat(SpareIn(instance=instance))
            except httpx.HTTPError:
                pass
        coordinator.close()

    while not stop.is_set():
        sent = time.monotonic()
        try:
            body = ask(SpareIn(instance=instance, cpuSeconds=time.process_time(), wait=interval))
        except httpx.HTTPError as e:  # no coordinator now (a successor being started): keep asking
            if time.monotonic() - last_log > 5.0:
                log.warning("spare: the coordinator did not answer: %s", e)
                last_log = time.monotonic()
            stop.wait(interval)
            continue
        if body.get("finished"):
            break
        if body.get("assigned") is not None:
            threading.Thread(target=keep_alive, daemon=True, name="spare-keepalive").start()
            return int(body["assigned"])
        if body.get("registered"):
            ask = coordinator.spare_heartbeat  # it waited for an assignment already: ask again at once
            if time.monotonic() - sent < interval / 4:  # (unless it did not wait: never spin)
                stop.wait(interval / 4)
        else:  # a coordinator that does not know this spare (it replaced the one it registered with): again
            ask = coordinator.register_spare
            stop.wait(interval)
    coordinator.close()
    return None

"""The checkpoint driver: the coordinator's adapter around `CheckpointCycle` (ecrec.core.checkpointing), for
the checkpoint strategies. It feeds the cycle what the coordinator learns and carries out its acts —
`Checkpoint` and `Restore` calls to the servers, the manifest — on a thread of its own, one act at a time and
never under the coordinator's lock (a checkpoint can take long).

It talks to the coordinator only through `CheckpointHost`: the servers' addresses, which shards are down, the
job's events, a restore done, a rollback, the job's failure. Lock discipline: `lock` is the coordinator's; it
guards the cycle and the driver's counters. The inputs (`feed`, `take_over`, `stats`) are called with it held;
the acts' thread takes it around each call to the cycle or the host, never across an RPC or a file write.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Protocol

import grpc

from ecrec import auth
from ecrec.core.checkpointing import Act, CheckpointCycle, Committed, cpr_interval
from ecrec.core.cluster import ClusterMap, ShardState
from ecrec.spec import Job

log = logging.getLogger("ecrec.coordinator")
RPC_TIMEOUT = 600.0  # a shard of a large model takes a while to write or read
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)


class CheckpointHost(Protocol):
    """What the checkpoint driver needs of the coordinator. `addresses` takes the lock itself; the others
    are called with it held."""

    clock: Callable[[], float]

    def addresses(self, shards: tuple[int, ...]) -> dict[int, str]:
        """shard -> the address of its registered process."""
        ...

    def shards_down(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shards failed or recovering, and of those the ones whose replacement registered."""
        ...

    def event(self, kind: str, at: float, **detail) -> None: ...

    def before_restore(self) -> None:
        """Called (without the lock) right before the servers are asked to load a checkpoint."""
        ...

    def restore_done(self, shards: tuple[int, ...], rows: dict[int, int], now: float) -> None:
        """`shards` loaded the checkpoint (`rows` rows each): the replacements among them are up."""
        ...

    def rolled_back(self, resume: dict[int, tuple[int, int]]) -> None:
        """Every rank goes back to (step, samples) of the restored checkpoint."""
        ...

    def fail(self, reason: str) -> None:
        """The job cannot go on, for `reason` (unless it failed for another already)."""
        ...


class CheckpointDriver:
    def __init__(
        self, host: CheckpointHost, job: Job, generation: int, token: str | None, lock: threading.RLock
    ):
        from ecrec.ft.files import ManifestStore

        self.host, self.lock, self.token = host, lock, token
        self.generation = generation
        spec = job.spec
        ft = spec.fault_tolerance
        _where, settings = ft.checkpoints()
        # strategy ecrec's fallback: full checkpoints, used only when parity cannot rebuild what is lost
        fallback = ft.strategy == "ecrec"
        strategy = "checkpoint" if fallback else ft.strategy
        steps = getattr(settings, "interval_steps", None)
        seconds = settings.interval_seconds
        if strategy == "cpr" and settings.target_pls and settings.mtbf_seconds:
            seconds = cpr_interval(settings.target_pls, spec.servers.replicas, settings.mtbf_seconds)
        t = spec.training
        self.cycle = CheckpointCycle(
            strategy,
            spec.workers.replicas,
            spec.servers.replicas,
            interval_seconds=None if steps else seconds,
            interval_steps=steps,
            total_samples=t.steps * t.batch_size * spec.workers.replicas,
            incremental=getattr(settings, "incremental", True),
            hot_interval=settings.hot_row_fraction * seconds
            if strategy == "cpr" and settings.hot_rows != "none" and not steps
            else None,
            fallback=fallback,
        )
        self.store = ManifestStore.for_job(job)
        self.num_rows = sum(spec.model_config_resolved().table_sizes)
        if generation == 1:
            self.store.clear()  # this run starts from nothing; a successor starts from what is there (take_over)
        # One daemon thread runs the acts in order: a call to a hung server must never keep the coordinator
        # process from exiting (a ThreadPoolExecutor's threads are joined at exit).
        self._acts: queue.Queue[Act | None] = queue.Queue()
        threading.Thread(target=self._loop, name="checkpoint", daemon=True).start()
        self._written: dict[int, list[dict]] = {}
        self.last_pause_seconds: float | None = None
        # totals since the start, for /metrics: checkpoints committed by kind, bytes written, training paused
        self.committed = {"full": 0, "increment": 0, "hot": 0}
        self.bytes_written = 0
        self.paused_seconds = 0.0
        self._pause_began: float | None = None

    # -- inputs: called with the coordinator's lock held ---------------------------------------------------
    def feed(self, acts: list[Act]) -> None:
        for act in acts:
            if act.kind == "write" and not act.hot and self._pause_began is None:
                self._pause_began = time.monotonic()
            self._acts.put(act)

    def take_over(self, seed: dict) -> None:
        """A successor coordinator: carry on from the newest committed checkpoint in the store, the shards'
        states as the cluster map was seeded, and the totals of the dead coordinator's last status
        (docs/protocol.md, "Checkpoint strategies")."""
        store = self.store
        last = last_hot = None
        ids = store.committed()
        if ids:
            doc = store.manifest(ids[-1])
            if doc.get("hot"):
                last_hot, doc = ids[-1], store.manifest(int(doc["base"]))
            progress = {int(p["rank"]): (int(p["step"]), int(p["samples"])) for p in doc["progress"]}
            last = Committed(int(doc["checkpoint"]), progress, bool(doc["final"]), doc.get("base"))
        prior = seed.get("checkpointing") or {}
        self.committed.update(prior.get("committed") or {})
        self.bytes_written = int(prior.get("bytesWritten") or 0)
        self.paused_seconds = float(prior.get("pausedSeconds") or 0.0)
        cycle = self.cycle
        cycle.rollbacks = int(prior.get("rollbacks") or 0)
        cycle.steps_redone = int(prior.get("stepsRedone") or 0)
        cycle.pls = float(prior.get("portionOfLostSamples") or 0.0)
        now = self.host.clock()
        failed, registered = self.host.shards_down()
        # the fallback rolls back again only if its predecessor was (its workers may be stopped, waiting)
        rolling_back = prior.get("phase") in ("stopping", "restoring")
        acts = cycle.taken_over(
            last,
            last_hot,
            self.generation,
            now,
            failed=failed,
            registered=registered,
            rolling_back=rolling_back,
        )
        self.host.event(
            "checkpoints_taken_over",
            now,
            checkpoint=last_hot or (last.checkpoint if last else 0),
            rollback=cycle.rollback if cycle.rolls_back else None,
        )
        self.feed(acts)

    @property
    def restores(self) -> bool:
        """Does the cycle bring a registered replacement back (a checkpoint strategy; the ecrec fallback only
        while it rolls back), rather than an ECRec rebuild?"""
        return not self.cycle.fallback or self.cycle.rolling_back

    def beyond_parity(self, cluster: ClusterMap, r: int) -> None:
        """The ecrec fallback, with the lock held: more than r shards lost at once, which parity cannot rebuild:
        every rank rolls back to the last checkpoint (the rebuilds under way stop: RecoveryHost.rolling_back;
        the replacements registered meanwhile load the checkpoint too)."""
        lost = cluster.lost()
        if self.cycle.rolling_back or len(lost) <= r:
            return
        registered = tuple(s for s in lost if cluster.shards[s].state is ShardState.RECOVERING)
        log.warning(
            "%d servers lost at once (shards %s), more than r=%d: rolling back to the last checkpoint",
            len(lost),
            lost,
            r,
        )
        self.host.event("fallback_rollback", self.host.clock(), shards=list(lost))
        self.feed(self.cycle.beyond_parity(tuple(lost), registered))

    def stats(self) -> dict:
        """For /v1/status (and so `ecrec local`'s report): what the strategy has cost and lost so far."""
        c = self.cycle
        return {
            "strategy": c.strategy,
            "intervalSeconds": c.interval_seconds,
            "intervalSteps": c.interval_steps,
            "phase": c.phase.value,
            "lastCheckpoint": c.last.checkpoint if c.last else None,
            "lastPauseSeconds": self.last_pause_seconds,
            "rollbacks": c.rollbacks,
            "stepsRedone": c.steps_redone,
            "portionOfLostSamples": round(c.pls, 6),
            "committed": dict(self.committed),
            "bytesWritten": self.bytes_written,
            "pausedSeconds": round(self.paused_seconds, 3),
        }

    def close(self) -> None:
        self._acts.put(None)

    def _loop(self) -> None:
        while (act := self._acts.get()) is not None:
            self._run(act)

    # -- acts: on the driver's thread -----------------------------------------------------------------------
    def _run(self, act: Act) -> None:
        try:
            {"write": self._write, "commit": self._commit, "restore": self._restore}[act.kind](act)
        except Exception:  # noqa: BLE001 — a bug here must not kill the thread that runs every later act
            log.exception("checkpoint act %s failed", act)

    def _stubs(self, shards: tuple[int, ...]):
        from ecrec.proto import ecrec_pb2_grpc as pb_grpc

        addresses = self.host.addresses(shards)
        channels = {s: auth.channel(a, self.token) for s, a in addresses.items()}
        return channels, {s: pb_grpc.ParameterServerStub(ch) for s, ch in channels.items()}

    def _call_all(self, shards: tuple[int, ...], method: str, request) -> dict[int, object]:
        """`method(request)` on every shard at once: shard -> response, or the RpcError it raised."""
        channels, stubs = self._stubs(shards)
        try:
            futs = {
                s: getattr(stub, method).future(request, timeout=RPC_TIMEOUT) for s, stub in stubs.items()
            }
            out: dict[int, object] = {}
            for s, fut in futs.items():
                try:
                    out[s] = fut.result()
                except grpc.RpcError as e:
                    out[s] = e
            return out
        finally:
            for ch in channels.values():
                ch.close()

    def _write(self, act: Act) -> None:
        from ecrec.proto import ecrec_pb2 as pb

        t0 = time.monotonic()
        req = pb.CheckpointRequest(
            checkpoint=act.checkpoint, final=act.final, baseline=act.baseline, base=act.base or 0, hot=act.hot
        )
        answers = self._call_all(act.shards, "Checkpoint", req)
        if self.cycle.decoupled:  # the servers have copied their state: training resumes, the write goes on
            ok = self._ok(act, answers, "copy")
            with self.lock:
                self._event("checkpoint_snapshot", act, ok, t0)
                self.feed(self.cycle.snapshotted(act.checkpoint, ok, self.host.clock()))
                self._pause_ended()
            if not ok:
                return
            req = pb.CheckpointRequest(checkpoint=act.checkpoint, await_written=True)
            answers = self._call_all(act.shards, "Checkpoint", req)
        ok = self._ok(act, answers, "write")
        self._written[act.checkpoint] = [
            {"shard": s, "file": r.file, "sha256": r.sha256, "bytes": r.bytes, "rows": r.rows}
            for s, r in sorted(answers.items())
            if not isinstance(r, grpc.RpcError)
        ]
        rows = sum(f["rows"] for f in self._written[act.checkpoint])
        with self.lock:
            self._event("checkpoint_written", act, ok, t0)
            fraction = rows / max(1, self.num_rows)
            self.feed(self.cycle.written(act.checkpoint, ok, self.host.clock(), fraction=fraction))
            if not ok and not act.hot:
                self._pause_ended()

    @staticmethod
    def _ok(act: Act, answers: dict, what: str) -> bool:
        bad = {s: e for s, e in answers.items() if isinstance(e, grpc.RpcError)}
        for s, e in bad.items():
            log.warning(
                "checkpoint %d: server %d did not %s its shard: %s", act.checkpoint, s, what, e.details()
            )
        return not bad

    def _event(self, kind: str, act: Act, ok: bool, t0: float) -> None:
        seconds = round(time.monotonic() - t0, 3)
        self.host.event(kind, self.host.clock(), checkpoint=act.checkpoint, ok=ok, seconds=seconds)

    def _commit(self, act: Act) -> None:
        from ecrec.ft.files import CheckpointError

        files = self._written.pop(act.checkpoint)
        progress = [{"rank": r, "step": s, "samples": n} for r, s, n in act.progress]
        try:
            self.store.commit(act.checkpoint, progress, files, final=act.final, base=act.base, hot=act.hot)
        except (CheckpointError, OSError) as e:
            log.error("checkpoint %d: the manifest was not written: %s", act.checkpoint, e)
            with self.lock:
                self.host.event("checkpoint_failed", self.host.clock(), checkpoint=act.checkpoint)
                self.feed(self.cycle.commit_failed(act.checkpoint))
            return
        with self.lock:
            # checknrun: the pause ended with the copy; cpr's hot-row saves do not pause at all
            seconds = None if act.hot else self._pause_ended() or self.last_pause_seconds
            kind = "hot" if act.hot else "full" if act.base is None else "increment"
            self.committed[kind] += 1
            self.bytes_written += sum(f["bytes"] for f in files)
            self.host.event(
                "checkpoint_committed",
                self.host.clock(),
                checkpoint=act.checkpoint,
                final=act.final,
                pause_seconds=seconds,
                baseline=act.baseline,
                hot=act.hot,
                bytes=sum(f["bytes"] for f in files),
            )
        self.store.prune()

    def _pause_ended(self) -> float | None:
        if self._pause_began is None:
            return None
        self.last_pause_seconds = round(time.monotonic() - self._pause_began, 3)
        self.paused_seconds += self.last_pause_seconds
        self._pause_began = None
        return self.last_pause_seconds

    def _restore(self, act: Act) -> None:
        from ecrec.proto import ecrec_pb2 as pb

        host = self.host
        host.before_restore()
        answers = self._call_all(act.shards, "Restore", pb.RestoreRequest(checkpoint=act.checkpoint or 0))
        bad = {s: e for s, e in answers.items() if isinstance(e, grpc.RpcError)}
        with self.lock:
            now = host.clock()
            if bad and all(e.code() in UNREACHABLE for e in bad.values()):
                # A server died meanwhile: its failure, once detected, starts another rollback (or, for cpr,
                # another restore once its replacement registers). Nothing to fail here.
                log.warning("restore of checkpoint %s: servers %s unreachable", act.checkpoint, sorted(bad))
                return
            if bad:
                why = "; ".join(f"server {s}: {e.details()}" for s, e in sorted(bad.items()))
                host.fail(f"restoring checkpoint {act.checkpoint or 'initial'}: {why}")
                self.feed(self.cycle.restored(act.shards, False, now))
                return
            rows = {s: int(r.rows) for s, r in answers.items()}
            host.event("checkpoint_restored", now, checkpoint=act.checkpoint or 0, shards=list(act.shards))
            host.restore_done(act.shards, rows, now)
            self.feed(self.cycle.restored(act.shards, True, now))
            if self.cycle.resume is not None and (self.cycle.rolls_back or self.cycle.fallback):
                host.rolled_back(self.cycle.resume)

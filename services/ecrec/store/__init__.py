"""The state of one parameter server and the protocol steps on it, with the network injected.

`ShardStore` is the object a server process serves (ecrec.server) and tests drive directly (tests/netsim.py).
It holds the server's tensors — its data row records and their versions, the parity records it keeps for
other servers' stripes, its dense chunks — and runs every protocol step of docs/protocol.md on them. Each
role's state is its own object without I/O (core/txn.py, core/dense.py, core/acting.py, core/stripes.py);
the steps are cut by role, one module each, over one shared state and one lock (ecrec.store.state, whose
docstring gives the lock discipline every part follows):

- `state`: start-up (the seed's records and parity, or an empty replacement), the lock, waiting, validation
- `records`: reads of the shard's rows and dense chunks; updates without 2PC
- `participant`: the data server's side of the 2PC (stage, commit, abort, outcome, wait-die, expiry)
- `deltas`: the parity server's side (deltas staged and decided, settling what nobody decided)
- `logged`: both sides under commit: deltaLog (applied at stage, deltas logged until delivered)
- `recovery`: decoding (degraded reads, acting-home writes) and the rebuild of a replacement
- `twoparity`: r = 2, both parity records of a failed shard's rows (aligned, skipped, forwarded)
- `checkpoints`: snapshots for the checkpoint strategies, and their restore
- `peers`: what a server needs from the others (`Peers`); anything remote goes through it, so the same
  code runs over gRPC in a server process and over direct calls in deterministic in-process tests.
"""

from __future__ import annotations

from ecrec.core.stripes import ReadResult
from ecrec.store.checkpoints import Checkpoints
from ecrec.store.deltas import ParityDeltas
from ecrec.store.logged import LoggedUpdates
from ecrec.store.participant import Participant, Staged
from ecrec.store.peers import NoPeers, PeerFailed, Peers
from ecrec.store.records import Records
from ecrec.store.recovery import Recovery
from ecrec.store.state import CALLER, MAX_WAITING, Busy, Caller, Cancelled, NotOwner
from ecrec.store.twoparity import TwoParity

__all__ = [
    "CALLER",
    "MAX_WAITING",
    "Busy",
    "Caller",
    "Cancelled",
    "NoPeers",
    "NotOwner",
    "PeerFailed",
    "Peers",
    "ReadResult",
    "ShardStore",
    "Staged",
]


class ShardStore(Records, Participant, LoggedUpdates, ParityDeltas, Recovery, TwoParity, Checkpoints):
    """One server's tables and protocol state. Thread-safe (ecrec.store.state: one lock)."""

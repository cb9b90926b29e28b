"""A parity server's version-ordered apply of xor deltas, in numpy on the CPU: `ParityParticipant`'s path where
the C one (core/heldrows.py) is not built. The torch path in core/txn.py is the reference, and tests/test_txn.py
checks all of them agree.

Why a second implementation: under the delta log a parity server applies every delivered batch here, and
with several workers on hot rows a large share of batches arrive ahead of a predecessor and are held. The
reference retries *every* held batch whenever a held row's predecessor lands, each retry a dozen torch ops
(~5-10 µs of dispatch each at a batch's few hundred rows): on a live server with 4 workers that was a quarter
of the server's Python time (py-spy --gil; docs/benchmarks.md). Here each op is ~1 µs, and a retry touches
only the held batches that share a (record, member) key with what was just applied, repeated until nothing
more applies.

Same results as the reference: the records' bits and `pver` (xor commutes, and a row applies exactly when
it is next in its version order, whichever order the batches are tried in), the same answer (was every row
of the batch reflected?), and the same held rows (as a set; the batches may be cut differently). `_held_keys`
keeps its contract: True wherever something is held (it may stay True where nothing is any more).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# ecrec.core.txn's classes, which call in here (an import back would be a cycle)
DeltaBatch = Any
ParityParticipant = Any


def _subset(b: DeltaBatch, mask: np.ndarray) -> DeltaBatch:
    """The rows of `b` selected by `mask` (gathers by position: a boolean index is torch's slow path, and
    `dataclasses.replace` costs more than the gathers)."""
    rows = np.flatnonzero(mask)
    return type(b)(
        parity_server=b.parity_server,
        txn=b.txn,
        src=b.src,
        index=torch.from_numpy(b.index.numpy()[rows]),
        slot=torch.from_numpy(b.slot.numpy()[rows]),
        delta=b.delta.index_select(0, torch.from_numpy(rows)),
        version=torch.from_numpy(b.version.numpy()[rows]),
        incarnation=b.incarnation,
        keys=None if b.keys is None else b.keys[rows],
    )


def _apply_rows(pp: ParityParticipant, b: DeltaBatch, key: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """xor the batch's `rows` (a mask; None: all) into their records and take them to their versions; returns
    the keys applied. Rows of one batch are unique, so one gather and one scatter suffice."""
    bits = pp.parity.numpy().view(np.int32)
    index, delta, version = b.index.numpy(), b.delta.numpy().view(np.int32), b.version.numpy()
    if rows is not None:
        index, delta, version, key = index[rows], delta[rows], version[rows], key[rows]
    bits[index] = bits[index] ^ delta
    pp.pver.numpy().reshape(-1)[key] = version
    return key


def apply_in_order(pp: ParityParticipant, b: DeltaBatch) -> bool:
    """`ParityParticipant._apply_in_order` for the xor code on the CPU: apply the rows that are next, hold
    those further ahead, skip those already reflected; True if none is held."""
    flat = pp.pver.numpy().reshape(-1)
    key = b.member_keys(pp.placement.k)
    step = b.version.numpy() - flat[key]  # 1: next; > 1: ahead of a predecessor; < 1: reflected
    now = step == 1
    done = True
    if now.all():
        applied = _apply_rows(pp, b, key, None)
    else:
        ahead = step > 1
        if ahead.any():
            pp.held.append(_subset(b, ahead))
            pp._held_keys.numpy()[key[ahead]] = True
            done = False
        if not now.any():
            return done
        applied = _apply_rows(pp, b, key, now)
    if pp.held and pp._held_keys.numpy()[applied].any():
        _release_held(pp, applied)
    return done


def _release_held(pp: ParityParticipant, applied: np.ndarray) -> None:
    """Rows just applied (`applied` keys) may be the predecessors held rows wait for: retry the held batches
    that share a key with them, and again with what those applied, until nothing more applies."""
    flat = pp.pver.numpy().reshape(-1)
    touched = np.zeros(flat.size, dtype=bool)
    changed = False
    while applied.size and pp.held:
        touched[applied] = True
        retry, keep = [], []
        for h in pp.held:
            hk = h.member_keys(pp.placement.k)
            (retry if touched[hk].any() else keep).append((h, hk))
        touched[applied] = False
        if not retry:
            break
        pp.held = [h for h, _k in keep]
        now_applied = []
        for h, hk in retry:  # in held order: one may be the predecessor of the next
            step = h.version.numpy() - flat[hk]
            now, ahead = step == 1, step > 1
            if now.any():
                now_applied.append(_apply_rows(pp, h, hk, None if now.all() else now))
                changed = True
            if ahead.all():
                pp.held.append(h)
            elif ahead.any():
                pp.held.append(_subset(h, ahead))
        applied = np.concatenate(now_applied) if now_applied else applied[:0]
    if changed:  # marks of rows no longer held are cleared where it is cheap: after a release
        pp.mark_held()

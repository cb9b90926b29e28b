"""What a failed data server's deltas at a parity server prove or leave behind (`ParityParticipant`'s staged and
held deltas of that server), without I/O: whether a later delta proves a commit its server can no longer confirm,
and which held rows nothing can complete any more. Called under the store's lock, on failure paths only.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from ecrec.core.txn import ParityParticipant, select_rows


def proves_commit(pp: ParityParticipant, txn: str, src: int, exclude: Collection[str] = ()) -> bool:
    """Do deltas here prove that data server `src` committed the undecided part (txn, src)? They do if
    one of its rows has a delta from `src` at a higher version, staged or held: a data server stages a
    row only after its previous part on the row is decided, and only a commit advances the version.
    Used when `src` can no longer answer (it died): dropping a committed delta under a later one would
    let the later one apply onto a record that lacks its predecessor — a garbage decode under xor.
    `exclude`: txns whose deltas are not `src`'s own lineage (this server's degraded writes for `src`)."""
    mine = pp.staged.get((txn, src))
    if not mine:
        return False
    later = [b for (t, s), bs in pp.staged.items() if s == src and t != txn and t not in exclude for b in bs]
    later += [b for b in pp.held if b.src == src and b.txn not in exclude]
    if not later:
        return False
    keys = torch.cat([pp.key_of(b) for b in mine])
    vers = torch.cat([b.version for b in mine])
    order = torch.argsort(keys)
    keys, vers = keys[order], vers[order]
    okeys = torch.cat([pp.key_of(b) for b in later])
    overs = torch.cat([b.version for b in later])
    pos = torch.searchsorted(keys, okeys).clamp(max=keys.numel() - 1)
    same = keys[pos] == okeys
    return bool((same & (overs > vers[pos])).any())


def drop_orphans(pp: ParityParticipant) -> int:
    """Drop held rows that nothing can complete: no staged delta of their server fills the gap between
    the record's version and theirs. Under two-phase commit a predecessor is staged here before its data
    server commits it, so a gap no staged delta fills was resolved as aborted — decided without its data
    server, which had died (`proves_commit` keeps that from happening where a later delta proves the
    commit; this is for a later delta that arrived after the drop, staged because a replacement had registered
    by then). The record then stays at the last version it holds, a consistent cut. Returns the rows
    dropped."""
    if not pp.holding():
        return 0
    staged = [b for bs in pp.staged.values() for b in bs]
    kept, dropped = [], 0
    for h in pp.held:
        cur = pp.pver[h.index, h.slot]
        fill = torch.zeros(h.index.numel(), dtype=torch.bool)
        for b in staged:
            if b.src != h.src:
                continue
            hit = (pp.key_of(h)[:, None] == pp.key_of(b)[None, :]) & (
                (b.version[None, :] > cur[:, None]) & (b.version[None, :] < h.version[:, None])
            )
            fill |= hit.any(dim=1)
        dropped += int((~fill).sum())
        if bool(fill.any()):
            kept.append(select_rows(h, fill))
    pp.held = kept
    pp.mark_held()
    return dropped

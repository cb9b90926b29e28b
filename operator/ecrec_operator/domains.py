"""Failure domains: which shards' servers share a domain (`servers.failureDomain`, a node label) once they are
scheduled, and the job condition FailureDomainsAtRisk that says so.

A stripe survives r lost records (faultTolerance.ecrec.r), so a domain holding more than r of the job's
servers is one whose loss (a node, a zone) loses shards parity cannot rebuild. The decision is a pure function
(`at_risk`) of server -> node and node -> labels; the labels come from nodes.py's `NodeCache`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ecrec.podlabels import pod_identity

from .nodes import NodeCache

CONDITION = "FailureDomainsAtRisk"


@dataclass(frozen=True)
class Placement:
    """Where the job's shards are, by failure domain."""

    at_risk: dict[str, tuple[int, ...]]  # domain -> its shards, for the domains with more than r
    unlabelled: tuple[str, ...] = ()  # nodes without the domain label (their servers are in no known domain)

    def message(self, key: str, r: int) -> str:
        unknown = f"; nodes without {key}: {', '.join(self.unlabelled)}" if self.unlabelled else ""
        if not self.at_risk:
            return f"no {key} holds more than {r} server(s){unknown}"
        parts = [f"{d} holds servers {', '.join(map(str, s))}" for d, s in sorted(self.at_risk.items())]
        return f"more than r={r} server(s) share a failure domain ({key}): " + "; ".join(parts) + unknown


def at_risk(
    server_nodes: Mapping[int, str], node_labels: Mapping[str, Mapping[str, str]], key: str, r: int
) -> Placement:
    """The domains (values of node label `key`) that hold more than `r` of the shards in `server_nodes`
    (shard -> node name). A node not in `node_labels`, or without the label, is in no known domain."""
    by_domain: dict[str, list[int]] = {}
    unlabelled: set[str] = set()
    for shard, node in sorted(server_nodes.items()):
        domain = (node_labels.get(node) or {}).get(key)
        if domain is None:
            unlabelled.add(node)
            continue
        by_domain.setdefault(domain, []).append(shard)
    risky = {d: tuple(s) for d, s in by_domain.items() if len(s) > r}
    return Placement(risky, tuple(sorted(unlabelled)))


def server_nodes(pods: Iterable[dict]) -> dict[int, str]:
    """shard -> the node of its newest live, scheduled server pod (from the operator's pod index entries)."""
    best: dict[int, tuple[int, str]] = {}
    for p in pods:
        meta = p.get("metadata") or {}
        ident = pod_identity(meta.get("labels"))
        node = (p.get("spec") or {}).get("nodeName")
        phase = (p.get("status") or {}).get("phase")
        if ident is None or ident[0] != "server" or not node or meta.get("deletionTimestamp"):
            continue
        if phase not in ("Pending", "Running"):
            continue
        _, shard, incarnation = ident
        if shard not in best or incarnation > best[shard][0]:
            best[shard] = (incarnation, node)
    return {shard: node for shard, (_, node) in best.items()}


def evaluate(pods: Iterable[dict], num_servers: int, nodes: NodeCache, key: str, r: int) -> Placement | None:
    """The placement to report, or None while there is nothing to say yet: no shard shares a domain with more
    than r others so far and not every shard's server is scheduled (False would claim too early)."""
    where = server_nodes(pods)
    placement = at_risk(where, nodes.labels(where.values()), key, r)
    if placement.at_risk or len(where) >= num_servers:
        return placement
    return None

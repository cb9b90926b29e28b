"""The labels that name a job's pods on Kubernetes, and reading them back.

One definition for the operator (which sets them), `ecrec chaos` (which picks targets by them) and the tests.
"""

from __future__ import annotations

from collections.abc import Mapping

from ecrec.core.roles import PROCESS_ROLES

LABEL_JOB = "ecrec.dev/job"
LABEL_ROLE = "ecrec.dev/role"
LABEL_SHARD = "ecrec.dev/shard"
LABEL_RANK = "ecrec.dev/rank"
LABEL_INCARNATION = "ecrec.dev/incarnation"
LABEL_SPARE = "ecrec.dev/spare"  # a warm spare's index; once it takes over a shard it is relabelled a server

ROLES = PROCESS_ROLES  # a pod's role label: a role, or spare
INDEX_LABELS = {"server": LABEL_SHARD, "worker": LABEL_RANK, "spare": LABEL_SPARE}


def pod_identity(labels: Mapping[str, str] | None) -> tuple[str, int, int] | None:
    """(role, index, incarnation) of one of a job's pods from its labels — index is the shard id of a server,
    the rank of a worker, a spare's index, 0 for the coordinator — or None when the labels do not name one of
    its processes."""
    lab = labels or {}
    role = lab.get(LABEL_ROLE)
    if role not in ROLES:
        return None
    try:
        index = 0 if role == "coordinator" else int(lab[INDEX_LABELS[role]])
        incarnation = int(lab.get(LABEL_INCARNATION, "1"))
    except (KeyError, ValueError):
        return None
    return role, index, incarnation


def spare_index(labels: Mapping[str, str] | None) -> int | None:
    """A server pod that was started as a warm spare keeps its spare label through the relabelling: that
    spare's index (the reconciler numbers new spares past it), else None."""
    lab = labels or {}
    try:
        return int(lab[LABEL_SPARE]) if lab.get(LABEL_ROLE) == "server" and LABEL_SPARE in lab else None
    except ValueError:
        return None

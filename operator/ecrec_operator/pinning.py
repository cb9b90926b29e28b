"""A started job runs by the spec it started with (pure: no API calls).

Every pod of a job reads the job's spec from its own environment, rendered when the pod is created. Were the
operator to render replacement pods from an edited spec, one job would run processes that disagree about
its shape: a replacement server placed by another `k` or `servers.replicas` than its peers would serve the
wrong rows and corrupt parity. So before its first pod the operator pins the spec (normalized, defaults
filled in) into the job's annotation `ecrec.dev/spec`, and renders, checks and reports by the pinned spec
from then on. Only `runPolicy` is taken from the live spec, as Kubernetes Jobs let a running job's deadline,
back-off limit and TTL be changed. Any other change is not applied and is reported (the status condition
SpecChangeIgnored and an event); to run another spec, create another job. A job already running when an
operator without pinning was replaced by this one has no pin yet: its spec as first seen is pinned then.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ecrec.spec import Job, SpecError, job_from_spec

ANNOTATION = "ecrec.dev/spec"
MUTABLE = ("runPolicy",)  # top-level spec sections a started job takes from the live spec


@dataclasses.dataclass(frozen=True)
class Resolved:
    job: Job  # what the operator renders, checks and reports by
    ignored: tuple[str, ...]  # dotted paths where the live spec differs from the pinned one, not applied
    invalid: str | None  # why the live spec does not parse (nothing of it applied)

    def message(self) -> str:
        """The SpecChangeIgnored condition's message; empty when nothing was ignored."""
        if self.invalid is not None:
            return f"the edited spec is invalid ({self.invalid}); the job runs by the spec it started with"
        if self.ignored:
            return (
                "a started job's spec cannot change (only runPolicy can); not applied: "
                + ", ".join(self.ignored)
                + ". Create another job to run another spec"
            )
        return ""


def pin(job: Job) -> str:
    """The annotation's value: the normalized spec, so that a field later written out at its default value
    is no change."""
    return json.dumps(job.spec.to_dict(), sort_keys=True, separators=(",", ":"))


def resolve(name: str, live: dict, pinned: str) -> Resolved:
    """The job a started job runs by: the pinned spec, with the live spec's runPolicy when the live spec is
    valid."""
    base = json.loads(pinned)
    try:
        now = job_from_spec(name, live).spec.to_dict()
    except SpecError as e:
        return Resolved(job_from_spec(name, base), (), str(e))
    merged = {**base, **{key: now[key] for key in MUTABLE if key in now}}
    ignored = tuple(p for p in differences(base, now) if p.split(".", 1)[0] not in MUTABLE)
    return Resolved(job_from_spec(name, merged), ignored, None)


def differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two JSON values differ (lists compare whole)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(a.keys() | b.keys()):
            out += differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]

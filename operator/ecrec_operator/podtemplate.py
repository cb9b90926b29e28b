"""A role's pod template (`spec.<role>.template`) and the servers' failure-domain spread, merged into the pod
`render.pod` made (pure: dicts in, dicts out).

The operator's own settings always stand: its labels and annotations win over the template's (the spec
refuses template keys that would collide, so this is belt and braces), its env, volumes and mounts come
first. The role's `nodeSelector`/`tolerations` and the template's are merged (the spec refuses a key the two
set differently, so there is no precedence to learn); the template's labels win over the operator config's
`jobPods.labels` (the job is more specific than the cluster).
"""

from __future__ import annotations

from typing import Any

from ecrec.podlabels import LABEL_JOB, LABEL_ROLE
from ecrec.spec.sections import ServersSpec
from ecrec.spec.template import PodTemplate

SPREAD_ROLES = ("server", "spare")  # a spare becomes a server: it is placed as one


def server_spread(job: str, servers: ServersSpec) -> dict:
    """The topologySpreadConstraint every server and spare pod gets: maxSkew 1 over `servers.failureDomain`,
    counting the job's server and spare pods."""
    out: dict[str, Any] = {
        "maxSkew": 1,
        "topologyKey": servers.failure_domain,
        "whenUnsatisfiable": servers.failure_domain_policy,
        "labelSelector": {
            "matchLabels": {LABEL_JOB: job},
            "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": list(SPREAD_ROLES)}],
        },
    }
    if servers.failure_domain_policy == "DoNotSchedule":
        # A NotReady node (tainted) whose servers are gone would otherwise count as an empty domain and hold
        # every replacement Pending; Kubernetes >= 1.26 honours this, older API servers drop the field.
        out["nodeTaintsPolicy"] = "Honor"
    return out


def merge(pod: dict, template: PodTemplate, spread: dict | None = None) -> dict:
    """`pod` (render.pod's, changed in place and returned) with `template` and the `spread` constraint added."""
    meta, spec = pod["metadata"], pod["spec"]
    container = spec["containers"][0]
    t = template.spec
    # Labels are merged by render.pod (above the config's jobPods.labels, beneath the operator's own).
    meta["annotations"] = {**template.metadata.annotations, **meta.get("annotations", {})}
    if t.node_selector:
        spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **t.node_selector}
    tolerations = list(spec.get("tolerations", []))
    for tol in t.tolerations:
        d = tol.model_dump(by_alias=True, exclude_none=True)
        if d not in tolerations:
            tolerations.append(d)
    if tolerations:
        spec["tolerations"] = tolerations
    if t.affinity is not None and (affinity := t.affinity.model_dump(by_alias=True, exclude_none=True)):
        spec["affinity"] = affinity
    if t.priority_class_name:
        spec["priorityClassName"] = t.priority_class_name
    spreads = ([spread] if spread else []) + [
        c.model_dump(by_alias=True, exclude_none=True) for c in t.topology_spread_constraints
    ]
    if spreads:
        spec["topologySpreadConstraints"] = spreads
    spec["volumes"] = [
        *spec.get("volumes", []),
        *(v.model_dump(by_alias=True, exclude_none=True) for v in t.volumes),
    ]
    extra = template.container()
    container["env"] = [
        *container["env"],
        *(e.model_dump(by_alias=True, exclude_none=True) for e in extra.env),
    ]
    container["volumeMounts"] = [
        *container.get("volumeMounts", []),
        *(m.model_dump(by_alias=True, exclude_none=True) for m in extra.volume_mounts),
    ]
    return pod

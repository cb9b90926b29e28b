"""runPolicy.suspend (as a Kubernetes Job's `suspend`, which Kueue sets and clears): a suspended job has no
pods, a resumed one starts over.

Suspending deletes the job's pods and writes the Suspended status (`status.suspended_status`). Resuming waits
until the suspended pods are gone (a new pod of the same name would be refused while one is Terminating),
then clears the pinned spec (`pinning`: nothing runs by it any more, so the spec as it is at the resume,
e.g. with the nodeSelector Kueue set on admission, is pinned next) and the last run's status; the next pass
starts the job from step 0. No strategy restores a checkpoint at start, so a resumed job trains again from
the beginning whatever its strategy.
"""

from __future__ import annotations

import kopf
from kubernetes.client.rest import ApiException

from . import pinning, render
from .status import resumed_status, suspended_status


@kopf.index(render.GROUP, render.VERSION, render.PLURAL)
def suspended_jobs(namespace, name, spec, status, **_):
    """(namespace, job) -> whether its pods' deletions are the suspend's (no failures to report): while
    runPolicy.suspend is set, and while a cleared suspend waits for the pods to go (phase still Suspended). From
    the jobs themselves, so an operator that restarted mid-suspend knows it too."""
    suspend = bool(((spec or {}).get("runPolicy") or {}).get("suspend"))
    return {(namespace, name): suspend or (status or {}).get("phase") == "Suspended"}


def is_suspended(index, namespace: str, job: str) -> bool:
    """`index`: the `suspended_jobs` index (kopf passes it to every handler by that name)."""
    return any(index.get((namespace, job), ()))


def suspend(core, namespace: str, name: str, pods: list[dict], status: dict, body, patch, now) -> None:
    """One pass over a suspended job: its pods deleted, its status Suspended (an event when it becomes so)."""
    for p in pods:
        if p["metadata"].get("deletionTimestamp"):
            continue
        try:
            core.delete_namespaced_pod(p["metadata"]["name"], namespace)
        except ApiException as e:
            if e.status != 404:
                raise
    if status.get("phase") != "Suspended":
        kopf.info(body, reason="ECRecJobSuspended", message=f"runPolicy.suspend: deleting {len(pods)} pod(s)")
        for key, value in suspended_status(status, now).items():
            patch.status[key] = value


def resume(custom, namespace: str, name: str, pods: list[dict], status: dict, body, patch, now) -> None:
    """One pass over a job whose suspend was cleared while it is Suspended: nothing until its pods are gone;
    then the pin and the last run's status are cleared (the next pass starts it)."""
    if pods:
        return
    if (body.get("metadata", {}).get("annotations") or {}).get(pinning.ANNOTATION) is not None:
        meta = {"annotations": {pinning.ANNOTATION: None}}
        custom.patch_namespaced_custom_object(
            render.GROUP, render.VERSION, namespace, render.PLURAL, name, {"metadata": meta}
        )
    for key, value in resumed_status(status, now).items():
        patch.status[key] = value
    kopf.info(body, reason="ECRecJobResumed", message="runPolicy.suspend cleared: starting the job over")

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

import threading

import kopf
from kubernetes.client.rest import ApiException

from . import pinning, render
from .status import resumed_status, suspended_status

_suspended: set[tuple[str, str]] = set()  # (namespace, job): its server pods' deletions are no failures
_lock = threading.Lock()


def is_suspended(namespace: str, job: str) -> bool:
    with _lock:
        return (namespace, job) in _suspended


def suspend(core, namespace: str, name: str, pods: list[dict], status: dict, body, patch, now) -> None:
    """One pass over a suspended job: its pods deleted, its status Suspended (an event when it becomes so)."""
    with _lock:
        _suspended.add((namespace, name))
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
    with _lock:
        _suspended.discard((namespace, name))
    kopf.info(body, reason="ECRecJobResumed", message="runPolicy.suspend cleared: starting the job over")

"""The test kubelet's node loss (tests/k8s/kubelet/outages.py) without a cluster: which node annotations ask for
a machine death, and the status a pod lost with it is given when the machine is back."""

from __future__ import annotations

import pytest

from ecrec.chaos import NODE_DOWN_ID, NODE_DOWN_SECONDS
from tests.k8s.kubelet.outages import NODE_LOST, down_request, lost_status


@pytest.mark.parametrize(
    "annotations, expected",
    [
        ({NODE_DOWN_SECONDS: "25", NODE_DOWN_ID: "lost-1"}, (25.0, "lost-1")),
        ({NODE_DOWN_SECONDS: "0.5", NODE_DOWN_ID: "x"}, (0.5, "x")),
        ({NODE_DOWN_SECONDS: "25"}, None),  # no id: nothing new to tell apart
        ({NODE_DOWN_SECONDS: "25", NODE_DOWN_ID: ""}, None),
        ({NODE_DOWN_ID: "lost-1"}, None),
        ({NODE_DOWN_SECONDS: "soon", NODE_DOWN_ID: "lost-1"}, None),
        ({NODE_DOWN_SECONDS: "0", NODE_DOWN_ID: "lost-1"}, None),
        ({NODE_DOWN_SECONDS: "-3", NODE_DOWN_ID: "lost-1"}, None),
        ({NODE_DOWN_SECONDS: "inf", NODE_DOWN_ID: "lost-1"}, None),
        ({NODE_DOWN_SECONDS: "nan", NODE_DOWN_ID: "lost-1"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_down_request_needs_an_id_and_positive_finite_seconds(annotations, expected):
    assert down_request(annotations) == expected


def test_a_lost_pod_ends_failed_with_its_running_containers_terminated():
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "status": {
            "phase": "Running",
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": "T0"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "T0"},
                {"type": "ContainersReady", "status": "False", "lastTransitionTime": "T1", "message": "m"},
            ],
            "containerStatuses": [
                {
                    "name": "main",
                    "ready": True,
                    "started": True,
                    "containerID": "ecrec-local://u-main-1",
                    "state": {"running": {"startedAt": "T0"}},
                },
                {"name": "done", "ready": False, "state": {"terminated": {"exitCode": 0}}},
            ],
            "initContainerStatuses": [{"name": "init", "state": {"terminated": {"exitCode": 0}}}],
        },
    }
    got = lost_status(pod, "ecrec-local-1", now="T2")
    assert got["phase"] == "Failed" and got["reason"] == NODE_LOST == "NodeLost"
    assert "ecrec-local-1" in got["message"]
    main, done = got["containerStatuses"]
    assert main["state"] == {
        "terminated": {
            "exitCode": 137,
            "reason": "ContainerStatusUnknown",
            "message": "the process died with node ecrec-local-1's machine",
            "startedAt": "T0",
            "finishedAt": "T2",
            "containerID": "ecrec-local://u-main-1",
        }
    }
    assert not main["ready"] and not main["started"]
    assert done == pod["status"]["containerStatuses"][1]  # already terminated: as it was
    assert got["initContainerStatuses"] == pod["status"]["initContainerStatuses"]
    conds = {c["type"]: c for c in got["conditions"]}
    assert conds["Initialized"] == pod["status"]["conditions"][0]
    assert conds["Ready"] == {
        "type": "Ready",
        "status": "False",
        "reason": "PodCompleted",
        "lastTransitionTime": "T2",
    }
    # False already: its transition time stays
    ready = conds["ContainersReady"]
    assert ready["lastTransitionTime"] == "T1" and "message" not in ready
    assert pod["status"]["phase"] == "Running"  # the input is left alone


def test_a_pod_without_status_still_gets_one():
    got = lost_status({"metadata": {}}, "n")
    assert got["phase"] == "Failed" and got["containerStatuses"] == [] and "initContainerStatuses" not in got

"""`ecrec chaos`: inject pod and node faults into a running ECRecJob, one at a time, and measure how it recovers.

Chaos Mesh's vocabulary: **pod-kill** deletes a pod (grace period 0 by default, as Chaos Mesh does);
**pod-failure** leaves the pod in place but makes its process unresponsive for `--duration` seconds;
**node-loss** (`--node NAME|random`) loses a whole node, as when its machine dies (nodes.py). The job has
to notice a paused server through its coordinator (heartbeats stop, probes time out): the pod's phase stays
Running. Each fault waits until the job is healthy again (phase Running, every shard up, no recovery open, one
running pod per shard and rank) and `--interval` seconds more; then the next one. What is printed is a table of
the faults with the time from each fault to training continuing and to full recovery.

How pod-failure is injected (`--injector`):
- `chaos-mesh`: a Chaos Mesh `PodChaos` (chaos-mesh.org/v1alpha1, action pod-failure, the target pod, the
  duration), deleted again once the fault is over;
- `annotation`: the pod annotations `chaos.ecrec.dev/pause-seconds` and `chaos.ecrec.dev/pause-id` (a new id per
  fault), which the test kubelet (tests/k8s/kubelet/) honours in place of Chaos Mesh's daemon: SIGSTOP of the
  pod's processes, SIGCONT after the duration. Its node says so with the label `chaos.ecrec.dev/pause-annotation`;
- `auto` (default): chaos-mesh where the API server serves PodChaos, else annotation where the target's node
  carries that label, else an error saying what is missing.

Times: server faults are measured with the coordinator's own timestamps (`status.recoveries`: detectedAt,
continuedAt = the first training step after the detection, completedAt = every lost row rebuilt), relative to
the moment this command injected the fault (its clock; the coordinator's clock is assumed to agree). Worker
faults have no recovery record: training continues when the rank runs again (a replacement pod is Running, or
the pause is over), and it has recovered once, after that, the job's step (the slowest rank's) has advanced and
the job is healthy.

The decisions (which pod or node, which injector, what a status snapshot says about a fault, the table) are
pure functions of plain JSON dicts: faults.py and nodes.py (tests/test_chaos.py, tests/test_chaos_nodes.py);
driver.py does the I/O, through cluster.py's `Cluster` (the `kubernetes` client).
"""

from __future__ import annotations

from .driver import Options, print_table, run
from .faults import (
    ACTIONS,
    ANY_ROLES,
    COLUMNS,
    NODE_DOWN_ID,
    NODE_DOWN_LABEL,
    NODE_DOWN_SECONDS,
    PAUSE_ID,
    PAUSE_NODE_LABEL,
    PAUSE_SECONDS,
    ChaosError,
    Fault,
    PodView,
    candidates,
    choose_injector,
    choose_target,
    fault_dict,
    new_fault,
    observe,
    parse_time,
    pause_patch,
    pod_chaos,
    roles_for,
    table_rows,
    unhealthy,
    view,
    views,
)

__all__ = [
    "ACTIONS",
    "ANY_ROLES",
    "COLUMNS",
    "NODE_DOWN_ID",
    "NODE_DOWN_LABEL",
    "NODE_DOWN_SECONDS",
    "PAUSE_ID",
    "PAUSE_NODE_LABEL",
    "PAUSE_SECONDS",
    "ChaosError",
    "Fault",
    "Options",
    "PodView",
    "candidates",
    "choose_injector",
    "choose_target",
    "fault_dict",
    "new_fault",
    "observe",
    "parse_time",
    "pause_patch",
    "pod_chaos",
    "print_table",
    "roles_for",
    "run",
    "table_rows",
    "unhealthy",
    "view",
    "views",
]

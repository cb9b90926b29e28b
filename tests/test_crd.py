"""The committed CRD (charts/ecrec/crds/ecrecjobs.yaml) against the pydantic models, the status schema the
operator writes, the Kubernetes-only spec fields and examples/k8s-small.yaml (which `ecrec local` accepts)."""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml

from ecrec import cli
from ecrec.spec import (
    CONDITION_TYPES,
    KUBERNETES_ONLY_FIELDS,
    PHASES,
    PRINTER_COLUMNS,
    ROLE_POD_FIELDS,
    JobStatus,
    SpecError,
    crd_manifest,
    crd_yaml,
    job_from_dict,
    load_job,
    parse_quantity,
    spec_openapi_schema,
    status_openapi_schema,
)
from tests.test_spec import _nodes, _validate

ROOT = Path(__file__).resolve().parents[1]
CRD_FILE = ROOT / "charts" / "ecrec" / "crds" / "ecrecjobs.yaml"
K8S_SMALL = ROOT / "examples" / "k8s-small.yaml"
LOCAL_SMALL = ROOT / "examples" / "local-small.yaml"
TINY = {"model": {"preset": "tiny"}}


# -- the committed file -------------------------------------------------------------------------------------


def test_committed_crd_is_what_the_model_generates() -> None:
    assert CRD_FILE.exists(), "charts/ecrec/crds/ecrecjobs.yaml is missing: run `make crd`"
    # Byte for byte, so that a reviewer sees every schema change in the diff of the committed file.
    assert CRD_FILE.read_text() == crd_yaml(), (
        "charts/ecrec/crds/ecrecjobs.yaml differs from the CRD generated from services/ecrec/spec/: "
        "run `make crd` and commit the result"
    )
    assert yaml.safe_load(CRD_FILE.read_text()) == crd_manifest()


def test_ecrec_crd_prints_the_committed_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["crd"])
    assert info.value.code == 0
    assert capsys.readouterr().out == crd_yaml()


def test_crd_yaml_has_no_anchors_and_no_cel() -> None:
    text = crd_yaml()
    assert "&id" not in text and "*id" not in text  # kubectl and helm read them, people do not
    # The 1.20 API server of the test environment silently drops CEL rules: nothing may rely on them.
    assert "x-kubernetes-validations" not in text


# -- printer columns and status -----------------------------------------------------------------------------


def _schema_at(root: dict[str, Any], json_path: str) -> dict[str, Any]:
    node = root
    for part in json_path.lstrip(".").split("."):
        assert "properties" in node and part in node["properties"], f"{json_path}: no field {part!r}"
        node = node["properties"][part]
    return node


def test_printer_columns_point_at_status_fields_of_their_type() -> None:
    [version] = crd_manifest()["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]
    assert version["additionalPrinterColumns"] == PRINTER_COLUMNS
    names = [c["name"] for c in PRINTER_COLUMNS if not c.get("priority")]
    assert names == ["Phase", "Step", "Samples/s", "Servers", "Recoveries", "Replacements", "Age"]
    for col in PRINTER_COLUMNS:
        if col["jsonPath"] == ".metadata.creationTimestamp":
            assert col["type"] == "date"
            continue
        node = _schema_at(root, col["jsonPath"])
        assert node["type"] == col["type"], col
        assert col["description"]


def test_status_schema_has_every_documented_field_and_no_defaults() -> None:
    status = status_openapi_schema()
    props = status["properties"]
    assert props["phase"]["enum"] == list(PHASES) == [
        "Pending", "Running", "Degraded", "Recovering", "Checking", "Succeeded", "Failed", "Suspended",
    ]  # fmt: skip
    cond = props["conditions"]
    assert (cond["x-kubernetes-list-type"], cond["x-kubernetes-list-map-keys"]) == ("map", ["type"])
    assert set(cond["items"]["properties"]) == {
        "type", "status", "reason", "message", "lastUpdateTime", "lastTransitionTime",
    }  # fmt: skip
    assert cond["items"]["required"] == ["type", "status"]
    assert cond["items"]["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert cond["items"]["properties"]["lastTransitionTime"]["format"] == "date-time"
    for name in ("startTime", "completionTime"):
        assert (props[name]["type"], props[name]["format"]) == ("string", "date-time")
    assert {"step", "totalSteps", "stepText", "samplesPerSecond", "serversText", "recoveryCount"} <= set(
        props
    )
    servers = props["servers"]["properties"]
    assert set(servers) == {"up", "total", "shards"}
    assert set(servers["shards"]["items"]["properties"]) == {"shard", "state", "incarnation", "pod"}
    assert set(props["replicaStatuses"]["properties"]) == {"server", "spare", "worker", "coordinator"}
    assert set(props["replicaStatuses"]["properties"]["worker"]["properties"]) == {
        "active",
        "succeeded",
        "failed",
    }
    assert set(props["recoveries"]["items"]["properties"]) >= {
        "shard", "killedAt", "detectedAt", "continuedAt", "completedAt", "rowsRecovered", "state",
    }  # fmt: skip
    assert props["replacements"]["type"] == "integer"
    assert set(props["eval"]["properties"]) == {"auc", "logloss", "reference"}
    assert set(props["parityCheck"]["properties"]) >= {"stripes", "mismatches"}
    assert props["kopf"]["x-kubernetes-preserve-unknown-fields"] is True
    assert "x-kubernetes-preserve-unknown-fields" not in status  # everything else is pruned if unknown
    for path, node in _nodes(status, "status"):
        assert "default" not in node, f"{path}: status is what the operator observed, it has no defaults"
        assert node.get("description") or path.endswith(("[]", "{}")), f"{path} has no description"


def test_status_shard_states_are_the_cluster_maps() -> None:
    from ecrec.core.cluster import ShardState

    shards = status_openapi_schema()["properties"]["servers"]["properties"]["shards"]
    assert shards["items"]["properties"]["state"]["enum"] == [s.value for s in ShardState]


def test_status_model_fills_the_column_texts_and_is_a_merge_patch() -> None:
    t = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    status = JobStatus.model_validate(
        {
            "phase": "Degraded",
            "step": 120,
            "totalSteps": 300,
            "samplesPerSecond": 5120.5,
            "servers": {
                "up": 4,
                "total": 5,
                "shards": [
                    {"shard": 0, "state": "up", "incarnation": 1, "pod": "j-server-0"},
                    {"shard": 2, "state": "failed", "incarnation": 1, "pod": "j-server-2"},
                ],
            },
            "recoveries": [{"shard": 2, "state": "detected", "killedAt": t, "detectedAt": t}],
            "conditions": [
                {"type": "Degraded", "status": "True", "reason": "ShardFailed", "lastTransitionTime": t}
            ],
            "replicaStatuses": {"server": {"active": 4, "failed": 1}},
            "eval": {"auc": 0.71, "logloss": 0.52},
            "parityCheck": {"stripes": 1000, "mismatches": 0},
            "kopf": {"progress": {"create_job": {"retries": 0}}},
        }
    )
    assert (status.step_text, status.servers_text, status.recovery_count) == ("120/300", "4/5", 1)
    d = status.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["stepText"] == "120/300" and d["eval"] == {"auc": 0.71, "logloss": 0.52}
    assert d["recoveries"][0]["killedAt"] == "2026-01-02T03:04:05Z"  # RFC 3339, as Kubernetes wants it
    assert "completionTime" not in d and "reason" not in d  # unset fields stay out of a merge patch
    assert _validate(d, status_openapi_schema(), "status") == []
    assert JobStatus.model_validate(d) == status
    # Only what changed: a valid patch on its own.
    assert JobStatus(samples_per_second=10.0).to_dict() == {"samplesPerSecond": 10.0}


@pytest.mark.parametrize(
    "bad",
    [
        {"phase": "Exploded"},
        {"phse": "Running"},
        {"conditions": [{"type": "Running", "status": "yes"}]},
        {"eval": {"auc": 1.5}},
        {"servers": {"shards": [{"shard": -1}]}},
    ],
)
def test_status_model_refuses_what_the_api_server_would(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        JobStatus.model_validate(bad)


def test_condition_types_cover_the_phases_that_are_conditions() -> None:
    assert set(PHASES) - {"Pending"} <= set(CONDITION_TYPES)


# -- Kubernetes-only spec fields ------------------------------------------------------------------------------


def test_every_role_has_the_pod_fields() -> None:
    props = spec_openapi_schema()["properties"]
    for role in ("servers", "workers", "coordinator"):
        fields = props[role]["properties"]
        assert set(ROLE_POD_FIELDS) <= set(fields), role
        assert fields["image"]["default"] == "ecrec:latest"
        assert fields["imagePullPolicy"]["enum"] == ["Always", "IfNotPresent", "Never"]
        assert "default" not in fields["imagePullPolicy"]  # unset = Kubernetes' own rule for :latest
        assert fields["nodeSelector"]["additionalProperties"] == {"type": "string"}
        tol = fields["tolerations"]["items"]["properties"]
        assert tol["operator"] == {
            "description": tol["operator"]["description"],
            "type": "string",
            "enum": ["Exists", "Equal"],
            "default": "Equal",
        }
        assert tol["effect"]["enum"] == ["NoSchedule", "PreferNoSchedule", "NoExecute"]
        quantity = fields["resources"]["properties"]["requests"]["additionalProperties"]
        assert quantity["x-kubernetes-int-or-string"] is True and quantity["pattern"].startswith("^")
        assert fields["serviceAccountName"]["pattern"]
        for name in ROLE_POD_FIELDS:
            assert fields[name]["description"].startswith("Kubernetes only"), (role, name)


def test_run_policy_follows_kubeflow() -> None:
    rp = spec_openapi_schema()["properties"]["runPolicy"]
    assert rp["default"] == {} and rp["description"].startswith("Kubernetes only")
    p = rp["properties"]
    assert (p["cleanPodPolicy"]["enum"], p["cleanPodPolicy"]["default"]) == (
        ["None", "Running", "All"],
        "Running",
    )
    assert (p["ttlSecondsAfterFinished"]["minimum"], p["activeDeadlineSeconds"]["minimum"]) == (0, 1)
    assert p["backoffLimit"]["minimum"] == 0
    for name in ("ttlSecondsAfterFinished", "activeDeadlineSeconds", "backoffLimit"):
        assert "default" not in p[name] and p[name]["nullable"] is True  # unset = no limit, as in Kubeflow
    s = job_from_dict(TINY).spec.run_policy
    assert (s.clean_pod_policy, s.ttl_seconds_after_finished, s.active_deadline_seconds, s.backoff_limit) == (
        "Running", None, None, None,
    )  # fmt: skip


def test_explain_text_for_the_ecrec_strategy_is_useful() -> None:
    ecrec = spec_openapi_schema()["properties"]["faultTolerance"]["properties"]["ecrec"]
    assert "erasure-coded" in ecrec["description"] and "servers.replicas >= k + r" in ecrec["description"]
    for name, node in ecrec["properties"].items():
        assert len(node["description"]) >= 40, f"faultTolerance.ecrec.{name}: say more in its description"


@pytest.mark.parametrize(
    "text, value",
    [
        ("500m", Decimal("0.5")),
        ("2", Decimal(2)),
        (2, Decimal(2)),
        (1.5, Decimal("1.5")),
        ("1Gi", Decimal(2**30)),
        ("512Mi", Decimal(512 * 2**20)),
        ("1.5G", Decimal(1_500_000_000)),
        ("1e3", Decimal(1000)),
        ("100k", Decimal(100_000)),
        ("250u", Decimal("0.000250")),
    ],
)
def test_parse_quantity(text: Any, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "2 GB", "1gi", "1GiB", "m", "1.2.3", "1e", "--1", True])
def test_parse_quantity_refuses_what_kubernetes_refuses(text: Any) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


def _problems(spec: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as info:
        job_from_dict({**TINY, **spec})
    return list(info.value.problems)


def test_bad_quantities_are_refused_naming_the_field() -> None:
    [line] = _problems({"servers": {"resources": {"requests": {"memory": "2 GB"}}}})
    assert line.startswith("spec.servers.resources.requests.memory: Value error, '2 GB' is not a Kubernetes")


def test_request_above_limit_and_negative_quantities_are_refused() -> None:
    res = {"requests": {"cpu": "2", "memory": "-1Gi"}, "limits": {"cpu": "1500m"}}
    assert _problems({"workers": {"resources": res}}) == [
        "spec.workers.resources.requests.memory: must not be negative, got -1Gi",
        "spec.workers.resources.requests.cpu: 2 exceeds the limit 1500m",
    ]
    job_from_dict({**TINY, "workers": {"resources": {"requests": {"cpu": "1500m"}, "limits": {"cpu": 2}}}})


def test_tolerations_are_checked_as_kubernetes_does() -> None:
    tolerations = [
        {"operator": "Exists"},  # tolerates everything: fine
        {"key": "a", "operator": "Exists", "value": "b"},
        {"value": "b"},
        {"key": "a", "value": "b", "effect": "NoSchedule", "tolerationSeconds": 10},
        {"key": "a", "operator": "Near"},
    ]
    lines = _problems({"coordinator": {"tolerations": tolerations}})
    assert lines == [
        "spec.coordinator.tolerations[4].operator: Input should be 'Exists' or 'Equal'",
    ]
    lines = _problems({"coordinator": {"tolerations": tolerations[:4]}})
    assert lines == [
        "spec.coordinator.tolerations[1].value: must be empty when operator is Exists",
        "spec.coordinator.tolerations[2].key: required when operator is Equal (operator Exists without a key "
        "tolerates all)",
        "spec.coordinator.tolerations[3].tolerationSeconds: only valid with effect NoExecute",
    ]


def test_typo_inside_a_toleration_is_named_with_a_suggestion() -> None:
    [line] = _problems({"servers": {"tolerations": [{"key": "a", "efect": "NoSchedule"}]}})
    assert (
        line == "spec.servers.tolerations[0].efect: Extra inputs are not permitted (did you mean 'effect'?)"
    )


def test_bad_service_account_name_and_run_policy_are_refused() -> None:
    lines = _problems(
        {
            "servers": {"serviceAccountName": "Not_A_Name"},
            "runPolicy": {"cleanPodPolicy": "Some", "backoffLimit": -1},
        }
    )
    assert [line.split(":")[0] for line in lines] == [
        "spec.servers.serviceAccountName",
        "spec.runPolicy.cleanPodPolicy",
        "spec.runPolicy.backoffLimit",
    ]


def test_kubernetes_only_fields_are_listed_and_reset() -> None:
    assert "runPolicy" in KUBERNETES_ONLY_FIELDS and "workers.nodeSelector" in KUBERNETES_ONLY_FIELDS
    spec = load_job(K8S_SMALL).spec
    plain = spec.without_kubernetes_fields()
    assert plain.servers.tolerations == [] and plain.workers.resources.requests == {}
    assert plain.run_policy.backoff_limit is None and plain.coordinator.image_pull_policy is None
    assert plain.training == spec.training and plain.fault_tolerance == spec.fault_tolerance


# -- examples/k8s-small.yaml ----------------------------------------------------------------------------------


def test_k8s_small_is_local_small_plus_kubernetes_fields_and_a_warm_spare() -> None:
    k8s, local = load_job(K8S_SMALL), load_job(LOCAL_SMALL)
    assert k8s.name == "k8s-small"
    assert k8s.spec.servers.spares == 1 and local.spec.servers.spares == 0
    plain = k8s.spec.without_kubernetes_fields()
    assert plain.model_copy(update={"servers": plain.servers.model_copy(update={"spares": 0})}) == local.spec
    s = k8s.spec
    for role in (s.servers, s.workers, s.coordinator):
        assert role.image_pull_policy == "IfNotPresent" and role.resources.requests
    assert s.servers.tolerations[0].effect == "NoSchedule" and s.servers.node_selector
    assert (s.run_policy.active_deadline_seconds, s.run_policy.backoff_limit) == (3600, 10)
    assert s.run_policy.clean_pod_policy == "Running"  # left to its default in the file


def test_ecrec_validate_accepts_k8s_small(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["validate", str(K8S_SMALL)])
    assert info.value.code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["name"] == "k8s-small"
    assert out["spec"]["runPolicy"]["ttlSecondsAfterFinished"] == 86400
    assert out["spec"]["servers"]["tolerations"][0]["key"] == "ecrec.dev/dedicated"


def test_ecrec_local_loads_k8s_small_as_local_small() -> None:
    # What `ecrec local` does with the file before it starts anything: the job context every process derives
    # from it, and the JSON it hands those processes. The Kubernetes fields change nothing there.
    ctx = cli._job(argparse.Namespace(job=str(K8S_SMALL), set=None))
    ref = cli._job(argparse.Namespace(job=str(LOCAL_SMALL), set=None))
    assert (ctx.num_servers, ctx.ecrec, ctx.dim, ctx.record_width) == (
        ref.num_servers, ref.ecrec, ref.dim, ref.record_width,
    )  # fmt: skip
    assert ctx.model == ref.model and ctx.placement == ref.placement
    assert ctx.dense_bounds == ref.dense_bounds
    child = type(ctx).from_json(ctx.to_json())
    assert child.spec == ctx.spec and child.spec.servers.tolerations == ctx.spec.servers.tolerations


def test_k8s_small_validates_against_the_crd_schema() -> None:
    doc = yaml.safe_load(K8S_SMALL.read_text())
    assert _validate(doc["spec"], spec_openapi_schema()) == []
    assert _validate(load_job(K8S_SMALL).to_manifest()["spec"], spec_openapi_schema()) == []

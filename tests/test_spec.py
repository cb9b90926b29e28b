"""The ECRecJob spec: examples, defaults, presets, validation messages, overrides, round trips and the CRD."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from ecrec.spec import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_TABLE_CAP,
    PRESETS,
    Job,
    JobSpec,
    SpecError,
    apply_overrides,
    crd_manifest,
    job_from_dict,
    load_job,
    spec_openapi_schema,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
TINY = {"model": {"preset": "tiny"}}


def manifest(spec: dict[str, Any], name: str = "t") -> dict[str, Any]:
    return {"apiVersion": "ecrec.dev/v1alpha1", "kind": "ECRecJob", "metadata": {"name": name}, "spec": spec}


def problems(doc: dict[str, Any], overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(SpecError) as info:
        job_from_dict(doc, overrides)
    return str(info.value).splitlines()


# -- examples and defaults ----------------------------------------------------------------------------------


def test_both_examples_exist_and_load() -> None:
    assert {p.name for p in EXAMPLES} >= {"local-small.yaml", "criteo-kaggle.yaml"}
    for path in EXAMPLES:
        job = load_job(path)
        assert job.name == path.stem


def test_local_small_example_is_the_demo_job() -> None:
    s = load_job(ROOT / "examples/local-small.yaml").spec
    assert s.model.preset == "small" and len(s.model.table_sizes) == 8
    assert (s.servers.replicas, s.workers.replicas) == (5, 2)
    # The demo trains with ECRec k=4 on 5 servers (issue 4).
    assert s.fault_tolerance.strategy == "ecrec" and s.fault_tolerance.ecrec.k == 4
    assert (s.training.batch_size, s.training.steps, s.training.optimizer) == (512, 300, "adagrad")


def test_criteo_example_is_ecrec_k4_on_five_servers() -> None:
    s = load_job(ROOT / "examples/criteo-kaggle.yaml").spec
    assert (s.model.preset, s.model.scale, len(s.model.table_sizes)) == ("criteo-kaggle", 1, 26)
    assert (s.servers.replicas, s.workers.replicas) == (5, 4)
    assert s.fault_tolerance.strategy == "ecrec" and s.fault_tolerance.ecrec.k == 4
    assert s.servers.resources.requests == {"cpu": "1", "memory": "2Gi"}  # `cpu: 1` read as a quantity


def test_defaults_fill_every_section() -> None:
    job = job_from_dict(TINY)
    s = job.spec
    assert job.name == "ecrec-job"
    assert (s.model.scale, s.model.num_dense_features) == (1, 13)
    assert (s.data.source, s.data.paths, s.data.zipf_exponent, s.data.eval_samples) == (
        "synthetic",
        [],
        1.05,
        8192,
    )
    t = s.training
    assert (t.steps, t.batch_size, t.optimizer, t.learning_rate) == (200, 256, "adagrad", 0.05)
    assert (t.momentum, t.beta1, t.beta2, t.eps, t.weight_decay, t.seed, t.deterministic) == (
        0.9, 0.9, 0.999, None, 0.0, 0, False,
    )  # fmt: skip
    assert (s.servers.replicas, s.servers.threads, s.servers.image) == (3, 1, "ecrec:latest")
    assert (s.workers.replicas, s.workers.threads, s.workers.device) == (1, 0, "auto")
    assert s.servers.resources.requests == {} and s.workers.resources.limits == {}
    assert (s.coordinator.heartbeat_interval_seconds, s.coordinator.failure_timeout_seconds) == (0.5, 3.0)
    ft = s.fault_tolerance
    assert ft.strategy == "none"
    assert (ft.ecrec.k, ft.ecrec.r, ft.ecrec.code, ft.ecrec.two_phase_commit) == (4, 1, "xor", True)
    assert (ft.ecrec.replicate_dense, ft.ecrec.lock_group_rows) == (True, 65536)
    assert (ft.checkpoint.interval_seconds, ft.checkpoint.interval_steps) == (30.0, None)
    assert (ft.checkpoint.path, ft.checkpoint.keep) == ("checkpoints", 2)
    assert (ft.checknrun.quantize_bits, ft.checknrun.incremental) == (8, True)
    assert (ft.cpr.hot_rows, ft.cpr.hot_row_fraction, ft.cpr.ssu_period) == ("none", 0.125, 2)


def test_explicit_model_without_preset_uses_default_dims() -> None:
    s = job_from_dict({"model": {"tableSizes": [10, 20], "bottomMlp": [32, 16], "topMlp": [8, 1]}}).spec
    assert (s.model.embedding_dim, s.model.num_dense_features, s.model.table_sizes) == (16, 13, [10, 20])


# -- presets ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_fills_unset_model_fields(preset: str) -> None:
    m = job_from_dict({"model": {"preset": preset}}).spec.model
    want = PRESETS[preset]
    assert m.table_sizes == want["tableSizes"] and m.embedding_dim == want["embeddingDim"]
    assert m.bottom_mlp == want["bottomMlp"] and m.top_mlp == want["topMlp"]
    assert m.bottom_mlp[-1] == m.embedding_dim


def test_small_preset_spans_1k_to_50k_rows() -> None:
    sizes = PRESETS["small"]["tableSizes"]
    assert len(sizes) == 8 and min(sizes) >= 1000 and max(sizes) <= 50_000


def test_criteo_preset_caps_the_kaggle_cardinalities() -> None:
    sizes = job_from_dict({"model": {"preset": "criteo-kaggle"}}).spec.model.table_sizes
    assert sizes == [min(n, CRITEO_TABLE_CAP) for n in CRITEO_KAGGLE_CARDINALITIES]
    assert len(sizes) == 26 and max(sizes) == 100_000 and sizes[0] == 1460 and sizes[2] == 100_000


def test_explicit_fields_win_over_the_preset() -> None:
    m = job_from_dict({"model": {"preset": "tiny", "tableSizes": [7, 9], "topMlp": [4, 1]}}).spec.model
    assert (m.table_sizes, m.top_mlp) == ([7, 9], [4, 1])
    assert (m.embedding_dim, m.bottom_mlp) == (8, [16, 8])  # the rest still comes from the preset


def test_explicit_embedding_dim_carries_into_the_presets_bottom_mlp() -> None:
    m = job_from_dict({"model": {"preset": "small", "embeddingDim": 32}}).spec.model
    assert (m.embedding_dim, m.bottom_mlp) == (32, [64, 32])
    # ... but an explicit bottomMlp is the user's and is checked, not rewritten.
    lines = problems({"model": {"preset": "small", "embeddingDim": 32, "bottomMlp": [64, 16]}})
    assert lines == ["spec.model.bottomMlp: last width 16 must equal embeddingDim 32"]
    # ... and a bad embeddingDim is reported once, not again through the derived bottomMlp.
    assert problems({"model": {"preset": "small", "embeddingDim": 0}}) == [
        "spec.model.embeddingDim: Input should be greater than or equal to 1"
    ]


@pytest.mark.parametrize("scale", [1, 2, 4, 8])
def test_scale_multiplies_every_table_size(scale: int) -> None:
    m = job_from_dict({"model": {"preset": "tiny", "scale": scale}}).spec.model
    assert m.table_sizes == PRESETS["tiny"]["tableSizes"]  # stored unscaled, so a round trip is stable
    assert m.scaled_table_sizes == tuple(n * scale for n in PRESETS["tiny"]["tableSizes"])


def test_model_config_resolved_applies_preset_and_scale() -> None:
    model = pytest.importorskip("ecrec.model")
    cfg = job_from_dict(
        {"model": {"preset": "tiny", "scale": 2, "numDenseFeatures": 5}}
    ).spec.model_config_resolved()
    assert isinstance(cfg, model.ModelConfig)
    assert (cfg.num_dense, cfg.dim) == (5, 8)
    assert cfg.table_sizes == (2000, 1000, 4000, 1600)
    assert (cfg.bottom_mlp, cfg.top_mlp) == ((16, 8), (16, 1))


# -- validation messages ------------------------------------------------------------------------------------

CROSS_FIELD_CASES = {
    "bottom_mlp_last_is_embedding_dim": (
        {"model": {"tableSizes": [5], "embeddingDim": 8, "bottomMlp": [16, 4], "topMlp": [1]}},
        "spec.model.bottomMlp: last width 4 must equal embeddingDim 8",
    ),
    "top_mlp_last_is_one": (
        {"model": {"preset": "tiny", "topMlp": [16, 2]}},
        "spec.model.topMlp: last width 2 must be 1",
    ),
    "ecrec_needs_k_plus_r_servers": (
        {**TINY, "servers": {"replicas": 4}, "faultTolerance": {"strategy": "ecrec", "ecrec": {"k": 4}}},
        "spec.servers.replicas: strategy ecrec needs at least k + r = 5 servers, got 4",
    ),
    "r3_has_no_code": (
        {
            **TINY,
            "servers": {"replicas": 8},
            "faultTolerance": {"strategy": "ecrec", "ecrec": {"k": 4, "r": 3}},
        },
        "spec.faultTolerance.ecrec.r: r is 1 (P) or 2 (P and Q, as in RAID-6), got 3",
    ),
    "sum_code_has_no_r2": (
        {
            **TINY,
            "servers": {"replicas": 8},
            "faultTolerance": {"strategy": "ecrec", "ecrec": {"k": 4, "r": 2, "code": "sum"}},
        },
        "spec.faultTolerance.ecrec.r: code 'sum' has no r = 2 form",
    ),
    "deterministic_needs_one_worker": (
        {**TINY, "training": {"deterministic": True}, "workers": {"replicas": 2}},
        "spec.workers.replicas: deterministic training needs exactly 1 worker, got 2",
    ),
    "criteo_needs_paths": (
        {**TINY, "data": {"source": "criteo"}},
        "spec.data.paths: source criteo needs at least one Criteo-format TSV file",
    ),
    "no_preset_needs_table_sizes": (
        {"model": {"bottomMlp": [16], "topMlp": [1]}},
        "spec.model.tableSizes: required when model.preset is not set",
    ),
    "failure_timeout_exceeds_heartbeat": (
        {**TINY, "coordinator": {"heartbeatIntervalSeconds": 2, "failureTimeoutSeconds": 1}},
        "spec.coordinator.failureTimeoutSeconds: must be greater than heartbeatIntervalSeconds",
    ),
}
# The smallest change to each bad spec that makes it valid: proves each rule is what rejected it.
CROSS_FIELD_FIXES = {
    "bottom_mlp_last_is_embedding_dim": "model.bottomMlp=[16, 8]",
    "top_mlp_last_is_one": "model.topMlp=[16, 1]",
    "ecrec_needs_k_plus_r_servers": "servers.replicas=5",
    "r3_has_no_code": "faultTolerance.ecrec.r=2",  # (r = 2 with P and Q is accepted)
    "sum_code_has_no_r2": "faultTolerance.ecrec.r=1",
    "deterministic_needs_one_worker": "workers.replicas=1",
    "criteo_needs_paths": "data.paths=[day_0.tsv]",
    "no_preset_needs_table_sizes": "model.tableSizes=[3]",
    "failure_timeout_exceeds_heartbeat": "coordinator.failureTimeoutSeconds=3",
}


@pytest.mark.parametrize("case", sorted(CROSS_FIELD_CASES))
def test_cross_field_rule_rejects_naming_the_field(case: str) -> None:
    doc, expected = CROSS_FIELD_CASES[case]
    lines = problems(doc)
    assert len(lines) == 1 and lines[0].startswith(expected), lines
    job_from_dict(doc, [CROSS_FIELD_FIXES[case]])  # and the fixed spec passes


def test_every_problem_is_listed_one_per_line() -> None:
    doc = {
        "model": {"tableSizes": [5], "bottomMlp": [3], "topMlp": [2]},
        "training": {"deterministic": True},
        "workers": {"replicas": 3},
    }
    lines = problems(doc)
    assert [line.split(":")[0] for line in lines] == [
        "spec.model.bottomMlp",
        "spec.model.topMlp",
        "spec.workers.replicas",
    ]
    assert problems(manifest(doc)) == lines  # same message through a full manifest


def test_typo_in_a_section_name_is_rejected_naming_it() -> None:
    lines = problems({**TINY, "trainig": {"steps": 5}})
    assert lines == ["spec.trainig: Extra inputs are not permitted (did you mean 'training'?)"]


def test_typo_in_a_nested_field_is_rejected_naming_it() -> None:
    lines = problems({**TINY, "faultTolerance": {"ecrec": {"lockGroupRow": 10}}})
    assert lines == [
        "spec.faultTolerance.ecrec.lockGroupRow: Extra inputs are not permitted (did you mean 'lockGroupRows'?)"
    ]


def test_negative_batch_size_names_its_path() -> None:
    lines = problems({**TINY, "training": {"batchSize": -4}})
    assert lines == ["spec.training.batchSize: Input should be greater than or equal to 1"]


def test_field_errors_use_camel_case_paths_and_list_indexes() -> None:
    lines = problems(
        {
            "model": {"tableSizes": [10, 0, 3], "bottomMlp": [16], "topMlp": [1]},
            "training": {"optimizer": "lamb", "learningRate": 0},
            "faultTolerance": {"cpr": {"hotRowFraction": 1.5}, "checknrun": {"quantizeBits": 3}},
        }
    )
    paths = [line.split(":")[0] for line in lines]
    assert paths == [
        "spec.model.tableSizes[1]",
        "spec.training.optimizer",
        "spec.training.learningRate",
        "spec.faultTolerance.checknrun.quantizeBits",
        "spec.faultTolerance.cpr.hotRowFraction",
    ]


def test_missing_model_section_is_reported() -> None:
    assert problems({}) == ["spec.model: Field required"]


@pytest.mark.parametrize(
    ("field", "value"),
    [("apiVersion", "ecrec.dev/v1"), ("kind", "TFJob"), ("apiVersion", None)],
)
def test_wrong_api_version_or_kind_is_rejected(field: str, value: Any) -> None:
    doc = manifest(TINY)
    doc[field] = value
    lines = problems(doc)
    assert len(lines) == 1 and lines[0].startswith(f"{field}: must be ")


def test_manifest_name_and_bare_spec_name() -> None:
    assert job_from_dict(manifest(TINY, name="demo")).name == "demo"
    no_meta = {k: v for k, v in manifest(TINY).items() if k != "metadata"}
    assert job_from_dict(no_meta).name == "ecrec-job"
    assert job_from_dict(TINY).name == "ecrec-job"
    assert job_from_dict(manifest(TINY)).spec == job_from_dict(TINY).spec


def test_quantities_may_be_numbers_or_strings() -> None:
    s = job_from_dict({**TINY, "servers": {"resources": {"requests": {"cpu": 2, "memory": "1Gi"}}}}).spec
    assert s.servers.resources.requests == {"cpu": "2", "memory": "1Gi"}


# -- overrides ----------------------------------------------------------------------------------------------


def test_override_values_are_parsed_as_yaml() -> None:
    doc = apply_overrides(
        TINY,
        [
            "training.steps=10",
            "training.deterministic=true",
            "model.tableSizes=[1, 2]",
            "training.optimizer=adam",
            "training.learningRate=0.001",
        ],
    )
    assert doc["training"] == {"steps": 10, "deterministic": True, "optimizer": "adam", "learningRate": 0.001}
    assert doc["model"] == {"preset": "tiny", "tableSizes": [1, 2]}


def test_exponent_learning_rate_override_validates() -> None:
    # YAML 1.1 reads "1e-3" as a string; the float field still accepts it.
    assert job_from_dict(TINY, ["training.learningRate=1e-3"]).spec.training.learning_rate == 0.001


def test_override_creates_intermediate_mappings_and_accepts_spec_prefix() -> None:
    doc = apply_overrides(TINY, ["spec.faultTolerance.ecrec.k=3", "faultTolerance.strategy=ecrec"])
    assert doc["faultTolerance"] == {"ecrec": {"k": 3}, "strategy": "ecrec"}


def test_override_leaves_its_input_untouched() -> None:
    original = {"model": {"preset": "tiny"}, "training": {"steps": 5}}
    before = copy.deepcopy(original)
    out = apply_overrides(original, ["training.steps=9", "model.scale=2"])
    assert original == before and out["training"]["steps"] == 9


def test_later_override_wins_and_value_may_contain_equals() -> None:
    doc = apply_overrides({}, ["servers.image=a", "servers.image=repo/x:tag=1"])
    assert doc["servers"]["image"] == "repo/x:tag=1"


@pytest.mark.parametrize("bad", ["training.steps", "=5", "training..steps=5"])
def test_malformed_override_is_a_spec_error(bad: str) -> None:
    with pytest.raises(SpecError, match="override"):
        apply_overrides(TINY, [bad])


def test_override_through_a_scalar_is_a_spec_error_naming_the_path() -> None:
    with pytest.raises(SpecError, match=r"spec\.training\.steps"):
        apply_overrides({"training": {"steps": 5}}, ["training.steps.max=3"])


def test_override_of_an_unknown_field_is_rejected_naming_it() -> None:
    lines = problems(TINY, ("training.stepz=50",))
    assert lines == ["spec.training.stepz: Extra inputs are not permitted (did you mean 'steps'?)"]


def test_overrides_apply_to_a_manifests_spec() -> None:
    job = job_from_dict(manifest(TINY), ["training.steps=50", "spec.workers.replicas=3"])
    assert (job.spec.training.steps, job.spec.workers.replicas) == (50, 3)
    assert problems(manifest(TINY), ("training.batchSize=-1",)) == [
        "spec.training.batchSize: Input should be greater than or equal to 1"
    ]


# -- loading files ------------------------------------------------------------------------------------------


def test_load_job_applies_overrides(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest(TINY, name="from-file")))
    job = load_job(path, ["training.steps=7"])
    assert (job.name, job.spec.training.steps) == ("from-file", 7)


def test_load_job_picks_the_ecrecjob_among_several_documents(tmp_path: Path) -> None:
    path = tmp_path / "all.yaml"
    other = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}}
    path.write_text(yaml.safe_dump_all([other, manifest(TINY, name="picked")]))
    assert load_job(path).name == "picked"


def test_missing_file_is_a_spec_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(SpecError, match="nope.yaml"):
        load_job(path)


def test_bad_yaml_is_a_spec_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("spec:\n  model: [unclosed\n")
    with pytest.raises(SpecError, match=r"broken\.yaml(.|\n)*invalid YAML"):
        load_job(path)


def test_invalid_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(manifest({**TINY, "training": {"batchSize": 0}})))
    with pytest.raises(SpecError) as info:
        load_job(path)
    assert "bad.yaml" in str(info.value)
    assert info.value.problems == ("spec.training.batchSize: Input should be greater than or equal to 1",)


# -- round trips --------------------------------------------------------------------------------------------

RICH_SPEC = {
    "model": {"preset": "small", "scale": 4, "embeddingDim": 32},
    "data": {"source": "criteo", "paths": ["a.tsv", "b.tsv"], "zipfExponent": 1.2},
    "training": {"optimizer": "adam", "eps": 1e-7, "weightDecay": 0.01, "deterministic": True, "seed": 3},
    "servers": {"replicas": 6, "resources": {"limits": {"memory": "3Gi", "cpu": 1.5}}},
    "faultTolerance": {"strategy": "ecrec", "ecrec": {"k": 5, "code": "sum", "twoPhaseCommit": False}},
}


@pytest.mark.parametrize("source", ["rich", *[p.name for p in EXAMPLES]])
def test_to_dict_round_trips_through_job_from_dict(source: str) -> None:
    job = job_from_dict(RICH_SPEC) if source == "rich" else load_job(ROOT / "examples" / source)
    d = job.spec.to_dict()
    assert json.loads(json.dumps(d)) == d  # JSON-safe
    assert d["faultTolerance"]["checknrun"]["quantizeBits"] == 8  # defaults included, camelCase
    back = job_from_dict(manifest(d, name=job.name))
    assert back == job and back.spec.to_dict() == d
    assert job_from_dict(job.to_manifest()) == job


def test_round_trip_keeps_scale_applied_once() -> None:
    spec = job_from_dict(RICH_SPEC).spec
    again = job_from_dict(spec.to_dict()).spec
    assert again.model.scaled_table_sizes == spec.model.scaled_table_sizes
    assert again.model.scaled_table_sizes[2] == 4 * 50_000


# -- CRD ----------------------------------------------------------------------------------------------------


def _nodes(schema: dict[str, Any], path: str = "spec"):
    """(path, node) of every schema node; list items are `path[]`, map values `path{}`."""
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    for key, mark in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(schema.get(key), dict):
            yield from _nodes(schema[key], f"{path}{mark}")


def _model_fields(cls: type[BaseModel], path: str = "spec") -> set[str]:
    """Every field path of a model, in `_nodes`' notation (a list of sections: `path[].field`)."""
    out = set()
    for name, field in cls.model_fields.items():
        p = f"{path}.{field.alias or name}"
        out.add(p)
        sub = field.annotation
        if get_origin(sub) is list:
            sub, p = get_args(sub)[0], f"{p}[]"
        elif get_origin(sub) is not None:
            sub = next((a for a in get_args(sub) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out |= _model_fields(sub, p)
    return out


def _validate(value: Any, schema: dict[str, Any], path: str = "spec") -> list[str]:
    """A small OpenAPI v3 (Kubernetes flavour) validator: enough to check examples and defaults."""
    if value is None:
        return [] if schema.get("nullable") else [f"{path}: null"]
    if schema.get("x-kubernetes-int-or-string"):
        return (
            [] if isinstance(value, int | str) and not isinstance(value, bool) else [f"{path}: int-or-string"]
        )
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    kinds = {
        "object": dict,
        "array": list,
        "string": str,
        "boolean": bool,
        "integer": int,
        "number": int | float,
    }
    t = schema["type"]
    if not isinstance(value, kinds[t]) or (t in ("integer", "number") and isinstance(value, bool)):
        return [f"{path}: not {t}"]
    errs = []
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: not in enum")
    if "minimum" in schema:
        lo = schema["minimum"]
        if value < lo or (schema.get("exclusiveMinimum") and value == lo):
            errs.append(f"{path}: below minimum")
    if "maximum" in schema:
        hi = schema["maximum"]
        if value > hi or (schema.get("exclusiveMaximum") and value == hi):
            errs.append(f"{path}: above maximum")
    if t == "array":
        if len(value) < schema.get("minItems", 0):
            errs.append(f"{path}: too few items")
        for i, item in enumerate(value):
            errs += _validate(item, schema["items"], f"{path}[{i}]")
    if t == "object":
        props = schema.get("properties", {})
        errs += [f"{path}.{r}: required" for r in schema.get("required", []) if r not in value]
        for k, v in value.items():
            sub = props.get(k, schema.get("additionalProperties"))
            errs += [f"{path}.{k}: unknown"] if sub is None else _validate(v, sub, f"{path}.{k}")
    return errs


def test_crd_names_and_version() -> None:
    crd = crd_manifest()
    assert (crd["apiVersion"], crd["kind"]) == ("apiextensions.k8s.io/v1", "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "ecrecjobs.ecrec.dev"
    s = crd["spec"]
    assert (s["group"], s["scope"]) == ("ecrec.dev", "Namespaced")
    assert s["names"] == {
        "plural": "ecrecjobs",
        "singular": "ecrecjob",
        "kind": "ECRecJob",
        "listKind": "ECRecJobList",
        "shortNames": ["ecj"],
        "categories": ["ecrec"],
    }
    [v] = s["versions"]
    assert (v["name"], v["served"], v["storage"], v["subresources"]) == (
        "v1alpha1",
        True,
        True,
        {"status": {}},
    )
    cols = {c["name"]: c["jsonPath"] for c in v["additionalPrinterColumns"] if not c.get("priority")}
    assert cols == {
        "Phase": ".status.phase",
        "Step": ".status.stepText",
        "Samples/s": ".status.samplesPerSecond",
        "Servers": ".status.serversText",
        "Recoveries": ".status.recoveryCount",
        "Replacements": ".status.replacements",
        "Age": ".metadata.creationTimestamp",
    }
    root = v["schema"]["openAPIV3Schema"]
    status = root["properties"]["status"]
    assert status["type"] == "object" and "x-kubernetes-preserve-unknown-fields" not in status
    assert status["properties"]["kopf"] == {
        "description": "kopf's own bookkeeping (handler progress); kept as written",
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
    }
    yaml.safe_dump(crd)  # plain data, serializable for `ecrec crd`


def test_crd_schema_is_structural() -> None:
    text = json.dumps(crd_manifest())
    for banned in ('"$ref"', '"anyOf"', '"oneOf"', '"allOf"', '"title"', '"$defs"'):
        assert banned not in text
    for path, node in _nodes(spec_openapi_schema()):
        exempt = node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")
        assert exempt or "type" in node, f"{path} has no type"
        if "properties" in node:
            assert node["type"] == "object" and "additionalProperties" not in node, path
        for flag in ("exclusiveMinimum", "exclusiveMaximum"):
            assert isinstance(node.get(flag, True), bool), f"{path}.{flag} must be a boolean in OpenAPI v3.0"


def test_crd_schema_covers_every_model_field() -> None:
    schema = spec_openapi_schema()
    in_schema = {p for p, node in _nodes(schema) if not p.endswith(("{}", "[]")) and p != "spec"}
    in_schema = {p for p in in_schema if "{}" not in p}  # inside resources' quantity maps
    assert in_schema == _model_fields(JobSpec)


def test_crd_schema_keeps_constraints_and_descriptions() -> None:
    props = spec_openapi_schema()["properties"]
    t = props["training"]["properties"]
    assert t["optimizer"]["enum"] == ["sgd", "momentum", "adagrad", "rowwise_adagrad", "adam"]
    assert (t["batchSize"]["minimum"], t["batchSize"]["default"]) == (1, 256)
    assert (t["learningRate"]["minimum"], t["learningRate"]["exclusiveMinimum"]) == (0, True)
    assert (t["momentum"]["maximum"], t["momentum"]["exclusiveMaximum"]) == (1, True)
    assert t["eps"]["type"] == "number" and t["eps"]["nullable"] is True
    presets = ["tiny", "small", "criteo-kaggle", "movielens100k"]
    assert props["model"]["properties"]["preset"]["enum"] == presets
    assert props["faultTolerance"]["properties"]["checknrun"]["properties"]["quantizeBits"]["enum"] == [
        4,
        8,
        16,
        32,
    ]
    assert props["model"]["properties"]["tableSizes"]["items"] == {"type": "integer", "minimum": 1}
    assert all(node.get("description") for p, node in _nodes(props["training"]) if p != "spec")
    assert spec_openapi_schema()["required"] == ["model"]


def test_crd_defaults_match_the_model_and_leave_preset_fields_alone() -> None:
    schema = spec_openapi_schema()
    model = schema["properties"]["model"]["properties"]
    # A CRD default would be filled in by the apiserver and then override the preset.
    for alias in ("embeddingDim", "numDenseFeatures", "tableSizes", "bottomMlp", "topMlp"):
        assert "default" not in model[alias]
    defaults = job_from_dict(TINY).spec.to_dict()
    seen = 0
    for path, node in _nodes(schema):
        if "default" not in node or node["default"] == {} or "[]" in path:
            continue  # defaults inside list items (tolerations[].operator) are checked in test_crd.py
        value = defaults
        for part in path.split(".")[1:]:
            if value is None:  # inside an optional section absent by default (ecrec.fallback): its own
                break
            value = value[part]
        else:
            assert node["default"] == value, path
        assert _validate(node["default"], node, path) == []
        seen += 1
    assert seen > 30


def test_examples_and_round_trips_validate_against_the_crd_schema() -> None:
    schema = spec_openapi_schema()
    docs = [load_job(p).to_manifest()["spec"] for p in EXAMPLES]
    # Each example's ECRecJob as written (an example may hold other documents, e.g. its PersistentVolumeClaim).
    docs += [
        d["spec"]
        for p in EXAMPLES
        for d in yaml.safe_load_all(p.read_text())
        if d and d.get("kind") == "ECRecJob"
    ]
    docs += [job_from_dict(RICH_SPEC).to_manifest()["spec"], job_from_dict(TINY).to_manifest()["spec"]]
    for doc in docs:
        assert _validate(doc, schema) == []
    bad = job_from_dict(TINY).to_manifest()["spec"]
    bad["training"]["learningRate"] = 0
    bad["workers"]["device"] = "tpu"
    assert _validate(bad, schema) == [
        "spec.training.learningRate: below minimum",
        "spec.workers.device: not in enum",
    ]


def test_job_is_frozen() -> None:
    job = job_from_dict(TINY)
    assert isinstance(job, Job)
    with pytest.raises(AttributeError):
        job.name = "x"  # type: ignore[misc]


def test_checkpoints_are_a_checkpoint_strategys_section_or_ecrecs_fallback() -> None:
    def ft(doc: dict):
        return job_from_dict({**TINY, "servers": {"replicas": 5}, "faultTolerance": doc}).spec.fault_tolerance

    assert ft({"strategy": "none"}).checkpoints() is None
    assert ft({"strategy": "ecrec"}).checkpoints() is None
    where, settings = ft({"strategy": "cpr", "cpr": {"intervalSeconds": 5}}).checkpoints()
    assert where == "faultTolerance.cpr" and settings.interval_seconds == 5
    where, settings = ft({"strategy": "ecrec", "ecrec": {"fallback": {"intervalSteps": 100}}}).checkpoints()
    assert where == "faultTolerance.ecrec.fallback" and settings.interval_steps == 100 and settings.keep == 2
    with pytest.raises(SpecError, match="fallback"):
        ft({"strategy": "ecrec", "ecrec": {"fallback": {"quantizeBits": 8}}})  # checkpoint's settings only

"""The ECRecJob CustomResourceDefinition, generated from the pydantic models (`JobSpec`, `JobStatus`).

pydantic's JSON Schema becomes Kubernetes' structural OpenAPI v3 (refs inlined, Optional as nullable, a
stable key order); `crd_yaml` is what `make crd` (`ecrec crd`) commits as charts/ecrec/crds/ecrecjobs.yaml,
and tests/test_crd.py fails while the two disagree.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from ecrec.spec.job import JobSpec
from ecrec.spec.resource import CATEGORIES, CRD_NAME, GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from ecrec.spec.status import JobStatus

# Fields a preset may fill: a CRD default would make the apiserver set them explicitly, overriding the preset.
_PRESET_FILLED = ("embeddingDim", "numDenseFeatures", "tableSizes", "bottomMlp", "topMlp")
_KEEP = {
    "type", "properties", "items", "additionalProperties", "required", "enum", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems", "minLength", "maxLength", "default",
    "description", "nullable", "pattern", "format", "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
}  # fmt: skip


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """JSON Schema (pydantic) -> Kubernetes structural OpenAPI v3: refs inlined, Optional -> nullable."""
    node = dict(node)
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**target, **node}  # the field's own description wins over the class docstring
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
        return _structural(node, defs)
    if "$ref" in node:
        return _structural(node, defs)
    if "anyOf" in node:
        members = [m for m in node.pop("anyOf") if m.get("type") != "null"]
        if len(members) != 1:
            raise ValueError(f"cannot express a union of {len(members)} types in a structural schema")
        node = {**_structural(members[0], defs), **node, "nullable": True}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEEP:
            continue  # title, $defs, additionalProperties: false (pruning does that job) ...
        if key == "properties":
            out[key] = {k: _structural(v, defs) for k, v in value.items()}
        elif key in ("items", "additionalProperties"):
            if isinstance(value, dict):
                out[key] = _structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020-12 has numeric bounds; OpenAPI v3.0 (Kubernetes) has a bound plus a flag.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "default" and value is None:
            continue  # a null default means "unset"; nothing to default
        else:
            out[key] = value
    return _ordered(out)


_KEY_ORDER = ("description", "type", "format", "enum", "pattern", "default")


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    # A stable, readable key order for the committed YAML: what a field is first, its sub-fields last.
    rank = {k: i for i, k in enumerate(_KEY_ORDER)}
    last = ("required", "items", "additionalProperties", "properties")
    return dict(
        sorted(
            node.items(),
            key=lambda kv: (
                kv[0] in last,
                last.index(kv[0]) if kv[0] in last else 0,
                rank.get(kv[0], len(rank)),
                kv[0],
            ),
        )
    )


def spec_openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of `spec`, generated from `JobSpec`."""
    raw = JobSpec.model_json_schema(by_alias=True)
    schema = _structural(raw, raw.get("$defs", {}))
    for alias in _PRESET_FILLED:
        schema["properties"]["model"]["properties"][alias].pop("default", None)
    _default_sections(JobSpec, schema)
    return schema


def _default_sections(cls: type[BaseModel], schema: dict[str, Any]) -> None:
    # `default: {}` on an optional section makes the apiserver fill the defaults inside it too, so
    # `kubectl get -o yaml` shows the effective spec even when the user left the whole section out.
    for name, field in cls.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            alias = field.alias or name
            if not field.is_required():
                schema["properties"][alias] = _ordered({**schema["properties"][alias], "default": {}})
            _default_sections(sub, schema["properties"][alias])


def status_openapi_schema() -> dict[str, Any]:
    """The structural openAPIV3Schema of `status`, generated from `JobStatus`: no defaults (status is what the
    operator observed), `kopf` kept unpruned for kopf's own progress."""
    raw = JobStatus.model_json_schema(by_alias=True)
    schema = _structural(raw, raw.get("$defs", {}))
    _drop_defaults(schema)
    return schema


def _drop_defaults(node: dict[str, Any]) -> None:
    node.pop("default", None)
    for sub in node.get("properties", {}).values():
        _drop_defaults(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _drop_defaults(node[key])


def _column(name: str, type_: str, path: str, description: str, priority: int = 0) -> dict[str, Any]:
    col = {"name": name, "type": type_, "jsonPath": path, "description": description}
    return {**col, "priority": priority} if priority else col


# `kubectl get ecj`; the priority-1 columns only with -o wide. Step and Servers are "n/m" strings the operator
# writes (status.stepText, status.serversText): a printer column cannot compute them.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    _column(
        "Phase",
        "string",
        ".status.phase",
        "Pending, Running, Degraded, Recovering, Checking, Succeeded, Failed or Suspended",
    ),
    _column(
        "Step", "string", ".status.stepText", "Training steps done by the slowest worker / steps per worker"
    ),
    _column("Samples/s", "number", ".status.samplesPerSecond", "Recent training throughput"),
    _column("Servers", "string", ".status.serversText", "Parameter servers up / in all"),
    _column("Recoveries", "integer", ".status.recoveryCount", "Server recoveries started"),
    _column("Replacements", "integer", ".status.replacements", "Pods created to replace lost ones"),
    _column("Age", "date", ".metadata.creationTimestamp", "Time since the job was created"),
    _column("Reason", "string", ".status.reason", "Why the job is in its phase", priority=1),
    _column("AUC", "number", ".status.eval.auc", "AUC on the held-out samples", priority=1),
]


def crd_manifest() -> dict[str, Any]:
    """The ECRecJob CustomResourceDefinition (apiextensions.k8s.io/v1); served by Kubernetes >= 1.16 (no CEL)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": SINGULAR,
                "kind": KIND,
                "listKind": f"{KIND}List",
                "shortNames": list(SHORT_NAMES),
                "categories": list(CATEGORIES),
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": "A fault-tolerant DLRM training job on erasure-coded parameter servers "
                            "(ECRec): the same spec runs as local processes (ecrec local) or as pods through the "
                            "ECRec operator",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec_openapi_schema(),
                                "status": status_openapi_schema(),
                            },
                        }
                    },
                }
            ],
        },
    }


CRD_HEADER = (
    "# The ECRecJob CustomResourceDefinition, generated from services/ecrec/spec/ by `make crd` (`ecrec crd`).\n"
    "# Do not edit: change the pydantic models and run `make crd`; tests/test_crd.py fails while they disagree.\n"
)


class _NoAliasDumper(yaml.SafeDumper):
    # The schema reuses objects (one enum list for three roles' tolerations): write each out in full, no &id001.
    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    """The CRD as the YAML file `make crd` writes to charts/ecrec/crds/ecrecjobs.yaml."""
    body = yaml.dump(crd_manifest(), Dumper=_NoAliasDumper, sort_keys=False, width=110, allow_unicode=True)
    return CRD_HEADER + body

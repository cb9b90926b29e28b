"""The ECRecJob spec: one schema for both launchers, its YAML loader, `--set` overrides and the CRD.

This package owns the `ECRecJob` custom resource (group `ecrec.dev`, version `v1alpha1`): the pydantic models
of its `spec` (camelCase in YAML, snake_case in Python), model presets, cross-field validation, turning a
manifest or bare spec into a `Job`, and generating the CustomResourceDefinition from the same models so that
`ecrec local` and the Kubernetes operator can never disagree about what a job means.

The spec also holds the fields only Kubernetes uses (`KUBERNETES_ONLY_FIELDS`: each role's pod settings and
template, the servers' failure domain and `runPolicy`); `ecrec local` accepts and ignores them. The `status`
the operator writes is modelled here too (`JobStatus`), so the CRD's status schema, its printer columns and the operator share one definition.

Every validation failure is a `SpecError` whose message lists each problem on its own line as
`spec.<camelCase path>: <reason>`.

Modules, each importing only those above it:
  resource     the resource's group, version, kind and names
  presets      model presets and the dataset shapes they encode
  quantities   Kubernetes quantities (500m, 1.5Gi) and the `Quantity` field type
  errors       `SpecError`
  base         `_Section`, the base model of every section (camelCase aliases, unknown keys refused)
  pods         each role's pod settings (Kubernetes only)
  template     each role's pod template and its rules, the operator's own names (Kubernetes only)
  sections     the spec's sections: model, data, training, roles, fault tolerance, run policy
  job          `JobSpec`, the rules across its sections, `Job`
  validation   `parse_spec`: a mapping -> `JobSpec`, or one `SpecError` listing every problem
  load         manifests, bare specs, YAML files and `--set` overrides -> `Job`
  status       `JobStatus`, what the operator writes into `status`
  crd          the CustomResourceDefinition generated from `JobSpec` and `JobStatus`

What the rest of the code imports from `ecrec.spec` is re-exported here (`__all__`); anything else is
imported from its module.
"""

from __future__ import annotations

from ecrec.spec.crd import (
    PRINTER_COLUMNS,
    crd_manifest,
    crd_yaml,
    spec_openapi_schema,
    status_openapi_schema,
)
from ecrec.spec.errors import SpecError
from ecrec.spec.job import KUBERNETES_ONLY_FIELDS, Job, JobSpec
from ecrec.spec.load import apply_overrides, job_from_dict, job_from_spec, load_job, section_at
from ecrec.spec.pods import ROLE_POD_FIELDS
from ecrec.spec.presets import (
    CRITEO_KAGGLE_CARDINALITIES,
    CRITEO_TABLE_CAP,
    MOVIELENS100K_NUM_DENSE,
    MOVIELENS100K_TABLE_SIZES,
    PRESETS,
)
from ecrec.spec.quantities import parse_quantity
from ecrec.spec.sections import ServersSpec
from ecrec.spec.status import CONDITION_TYPES, PHASES, CheckpointingStatus, JobStatus

__all__ = [
    "CONDITION_TYPES",
    "CRITEO_KAGGLE_CARDINALITIES",
    "CRITEO_TABLE_CAP",
    "KUBERNETES_ONLY_FIELDS",
    "MOVIELENS100K_NUM_DENSE",
    "MOVIELENS100K_TABLE_SIZES",
    "PHASES",
    "PRESETS",
    "PRINTER_COLUMNS",
    "ROLE_POD_FIELDS",
    "CheckpointingStatus",
    "Job",
    "JobSpec",
    "JobStatus",
    "ServersSpec",
    "SpecError",
    "apply_overrides",
    "crd_manifest",
    "crd_yaml",
    "job_from_dict",
    "job_from_spec",
    "load_job",
    "section_at",
    "parse_quantity",
    "spec_openapi_schema",
    "status_openapi_schema",
]

"""Turning documents into a `Job`: a full ECRecJob manifest or a bare spec, from a mapping, a stored resource
or a YAML file, with `--set dotted.path=value` overrides applied to its spec first."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ecrec.spec.errors import SpecError
from ecrec.spec.job import Job
from ecrec.spec.resource import API_VERSION, DEFAULT_JOB_NAME, KIND
from ecrec.spec.validation import _format_loc, parse_spec

_MANIFEST_KEYS = ("apiVersion", "kind", "metadata", "spec")


def job_from_dict(doc: Mapping[str, Any], overrides: Sequence[str] = ()) -> Job:
    """A `Job` from a full ECRecJob manifest or a bare spec mapping, with `--set` overrides applied to spec."""
    if not isinstance(doc, Mapping):
        raise SpecError(f"job: must be a mapping, got {type(doc).__name__}")
    if not any(k in doc for k in _MANIFEST_KEYS):
        return Job(DEFAULT_JOB_NAME, parse_spec(apply_overrides(dict(doc), overrides)))
    problems = []
    if doc.get("apiVersion") != API_VERSION:
        problems.append(f"apiVersion: must be {API_VERSION}, got {doc.get('apiVersion')!r}")
    if doc.get("kind") != KIND:
        problems.append(f"kind: must be {KIND}, got {doc.get('kind')!r}")
    metadata = doc.get("metadata") or {}
    name = metadata.get("name", DEFAULT_JOB_NAME) if isinstance(metadata, Mapping) else None
    if not isinstance(name, str) or not name:
        problems.append("metadata.name: must be a non-empty string")
    if "spec" not in doc:
        problems.append("spec: Field required")
    if problems:
        raise SpecError(problems)
    spec_doc = doc["spec"]
    if not isinstance(spec_doc, Mapping):
        raise SpecError(f"spec: must be a mapping, got {type(spec_doc).__name__}")
    return Job(name, parse_spec(apply_overrides(dict(spec_doc), overrides)))


def job_from_spec(name: str, spec: Mapping[str, Any]) -> Job:
    """The job of a stored ECRecJob, from its `metadata.name` and `spec` (as the API server, a pod's env or the
    coordinator's /v1/job hold them)."""
    return job_from_dict({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec})


def section_at(spec_doc: dict[str, Any], path: str) -> dict[str, Any]:
    """The mapping at dotted `path` of a spec document (camelCase), created where missing."""
    node = spec_doc
    for part in path.split("."):
        node = node.setdefault(part, {})
    return node


def apply_overrides(spec_doc: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `spec_doc` with each `dotted.path=value` set; values are parsed as YAML ("10" -> 10)."""
    out = copy.deepcopy(dict(spec_doc))
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SpecError(f"override {item!r}: expected dotted.path=value, e.g. training.steps=50")
        parts = key.split(".")
        if parts[0] == "spec" and len(parts) > 1:
            parts = parts[1:]
        if any(not p for p in parts):
            raise SpecError(f"override {item!r}: empty path segment in {key!r}")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise SpecError(f"override {item!r}: value is not valid YAML ({e})") from None
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                path = _format_loc(parts[: i + 1])
                raise SpecError(
                    f"{path}: cannot set {key!r}, {path} is a {type(child).__name__}, not a mapping"
                )
            node = child
        node[parts[-1]] = value
    return out


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> Job:
    """A `Job` from a YAML file holding an ECRecJob manifest (possibly among other documents) or a bare spec."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"cannot read job file: {e.strerror or e}", source=str(p)) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise SpecError(f"invalid YAML: {e}", source=str(p)) from None
    if len(docs) > 1:
        docs = [d for d in docs if isinstance(d, Mapping) and d.get("kind") == KIND]
    if len(docs) != 1:
        raise SpecError(f"expected exactly one {KIND} document, found {len(docs)}", source=str(p))
    try:
        return job_from_dict(docs[0], overrides)
    except SpecError as e:
        raise SpecError(e.problems, source=str(p)) from None

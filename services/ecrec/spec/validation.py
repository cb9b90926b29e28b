"""Validating a spec mapping: `parse_spec` turns it into a `JobSpec` or one `SpecError` listing every problem.

pydantic's errors become `spec.<camelCase path>: <reason>` lines, an unknown key with the closest known one
("did you mean ...?"); the cross-field rules' lines (`_CrossFieldProblems`) are passed through as they are.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from ecrec.spec.errors import SpecError, _CrossFieldProblems
from ecrec.spec.job import JobSpec


def _format_loc(loc: Sequence[int | str]) -> str:
    path = "spec"
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _section_at(loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model class whose fields live at `loc` (camelCase path below spec), for typo suggestions."""
    cls: type[BaseModel] = JobSpec
    for part in loc:
        if isinstance(part, int):
            continue  # an index into a list of sections (tolerations): its items are `cls` already
        field = next((f for n, f in cls.model_fields.items() if part in (n, f.alias)), None)
        if field is None:
            return None
        ann = field.annotation
        candidates = get_args(ann) if get_origin(ann) is not None else (ann,)
        nxt = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        cls = nxt
    return cls


def _problem_lines(err: ValidationError) -> list[str]:
    lines: list[str] = []
    for e in err.errors():
        cause = e.get("ctx", {}).get("error")
        if isinstance(cause, _CrossFieldProblems):
            lines.extend(cause.lines)
            continue
        line = f"{_format_loc(e['loc'])}: {e['msg']}"
        if e["type"] == "extra_forbidden" and e["loc"] and isinstance(e["loc"][-1], str):
            cls = _section_at(e["loc"][:-1])
            if cls is not None:
                known = [f.alias or n for n, f in cls.model_fields.items()]
                close = difflib.get_close_matches(e["loc"][-1], known, n=1)
                if close:
                    line += f" (did you mean '{close[0]}'?)"
        lines.append(line)
    return lines


def parse_spec(spec_doc: Any) -> JobSpec:
    """Validate a spec mapping (camelCase keys); every problem is reported in one SpecError."""
    if not isinstance(spec_doc, Mapping):
        raise SpecError(f"spec: must be a mapping, got {type(spec_doc).__name__}")
    try:
        return JobSpec.model_validate(dict(spec_doc))
    except ValidationError as e:
        raise SpecError(_problem_lines(e)) from None

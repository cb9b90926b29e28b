"""The base of every spec and status section: camelCase aliases in YAML and JSON, snake_case in Python, and
unknown fields refused (so a typo is an error, with a suggestion, not a silently ignored key)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class _Section(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

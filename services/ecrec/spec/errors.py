"""The spec's error type: `SpecError`, one `spec.<camelCase path>: <reason>` line per problem.

`_CrossFieldProblems` carries the already qualified lines of the cross-field rules (`ecrec.spec.job`) through
pydantic's validation, so that `ecrec.spec.validation` can list them as they are.
"""

from __future__ import annotations

from collections.abc import Sequence


class SpecError(ValueError):
    """An invalid job: `problems` holds one `spec.<path>: <reason>` line per problem."""

    def __init__(self, problems: Sequence[str] | str, source: str | None = None) -> None:
        self.problems: tuple[str, ...] = (problems,) if isinstance(problems, str) else tuple(problems)
        self.source = source
        lines = "\n".join(self.problems)
        super().__init__(f"{source}:\n{lines}" if source else lines)


class _CrossFieldProblems(ValueError):
    """Raised inside validation; carries fully qualified lines so SpecError can list them as they are."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        super().__init__("\n".join(lines))

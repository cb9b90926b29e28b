"""Kubernetes resource quantities ("500m", "1.5Gi", 2): their grammar, their value and the `Quantity` field type.

The pattern is the one controller-gen writes into CRDs, so the API server and `ecrec validate` agree on what a
quantity is; `parse_quantity` gives its value for comparisons (a request must not exceed its limit).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, WithJsonSchema

# The grammar of a Kubernetes resource.Quantity (k8s.io/apimachinery), as controller-gen writes it into CRDs.
QUANTITY_PATTERN = r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
_QUANTITY_SUFFIXES: dict[str, Decimal] = {
    **{s: Decimal(1024) ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: Decimal(10) ** e for s, e in (("n", -9), ("u", -6), ("m", -3), ("", 0), ("k", 3), ("M", 6))},
    **{s: Decimal(10) ** e for s, e in (("G", 9), ("T", 12), ("P", 15), ("E", 18))},
}
_QUANTITY_PARTS = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(.*)")


def parse_quantity(value: str | int | float) -> Decimal:
    """The value of a Kubernetes quantity: "500m" -> 0.5, "1Gi" -> 1073741824, "1e3" -> 1000.

    Raises ValueError for anything the API server would refuse (e.g. "2 GB", "1gi", "").
    """
    text = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not re.fullmatch(QUANTITY_PATTERN, text):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 500m, 2, 1.5Gi, 512Mi)")
    number, suffix = _QUANTITY_PARTS.fullmatch(text).groups()  # type: ignore[union-attr]
    try:
        if suffix[:1] in ("e", "E") and len(suffix) > 1:
            return Decimal(number) * Decimal(10) ** Decimal(suffix[1:])
        return Decimal(number) * _QUANTITY_SUFFIXES[suffix]
    except (InvalidOperation, KeyError, OverflowError):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (e.g. 500m, 2, 1.5Gi, 512Mi)") from None


def _quantity_to_str(v: Any) -> Any:
    # YAML users write `cpu: 2`; Kubernetes accepts int-or-string quantities, so do we.
    if isinstance(v, int | float) and not isinstance(v, bool):
        return str(v)
    return v


def _check_quantity(v: str) -> str:
    parse_quantity(v)
    return v


Quantity = Annotated[
    str,
    BeforeValidator(_quantity_to_str),
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
            "description": "Kubernetes quantity, e.g. 500m, 2, 1.5Gi, 512Mi",
        }
    ),
]

"""The core's error for a request it refuses: one type, so that the adapters (servicers, the store) can turn
every refusal into INVALID_ARGUMENT however deep in the core it was raised. No imports: any module may use it.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that is malformed or asks for something this server does not hold."""

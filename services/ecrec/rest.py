"""HTTP clients: of the coordinator's REST API, and of the processes' /metrics.

Every HTTP client of the project is made here. `httpx.Client()` loads the certifi trust store into a new TLS
context each time it is made — 55–95 ms of CPU on the 2-core test machine, for plain-http URLs too, which
never use it — and `httpx.get()` makes a client per call. A warm spare made two while taking over a failed
shard, on the recovery's critical path: ~0.2 s of it on the job's saturated cores. Here the context is made
once per process and shared (an `ssl.SSLContext` serves any number of connections), verifying as httpx's
default does.
"""

from __future__ import annotations

import functools
import ssl
from typing import Any

import httpx

from ecrec import auth


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The process's one TLS context (httpx's default: certifi's trust store, certificates verified)."""
    return httpx.create_ssl_context()


def client(*, timeout: float, token: str | None = None) -> httpx.Client:
    """A client carrying the job token (when there is one) in every request."""
    return httpx.Client(timeout=timeout, headers=auth.headers(token), verify=tls_context())


def get(url: str, *, timeout: float, token: str | None = None, **kw: Any) -> httpx.Response:
    """One GET, for callers that make one now and then (a client kept open is cheaper for a stream of them)."""
    with client(timeout=timeout, token=token) as c:
        return c.get(url, **kw)


def post(url: str, *, timeout: float, token: str | None = None, **kw: Any) -> httpx.Response:
    with client(timeout=timeout, token=token) as c:
        return c.post(url, **kw)

"""The job token: only callers holding it may change a job (docs/operations.md, "Security").

Every job has one random token. `ecrec local` makes it; on Kubernetes the operator keeps it in a Secret owned
by the ECRecJob (`<job>-token`) and hands it to the job's pods as the env variable `ECREC_JOB_TOKEN`. With a
token set, a parameter server answers no gRPC call without it (UNAUTHENTICATED) and the coordinator accepts
no mutating REST request without it (401); reads that change nothing (status, cluster map, /metrics,
/healthz) stay open for probes, dashboards and scrapers. Without a token (a server or coordinator started by
hand or by a unit test) nothing is checked.

The token travels as `authorization: Bearer <token>`, in HTTP headers and gRPC metadata alike; it is compared
in constant time. It keeps stray and foreign processes from changing a job; it is no substitute for TLS on an
untrusted network.
"""

from __future__ import annotations

import hmac
import os
import secrets

import grpc

ENV = "ECREC_JOB_TOKEN"
HEADER = "authorization"


def from_env() -> str | None:
    return os.environ.get(ENV) or None


def new_token() -> str:
    return secrets.token_urlsafe(32)


def headers(token: str | None) -> dict[str, str]:
    return {HEADER: f"Bearer {token}"} if token else {}


def valid(token: str | None, presented: str | None) -> bool:
    """Does `presented` (an authorization header's value) carry `token`? Always, when there is no token."""
    if not token:
        return True
    return presented is not None and hmac.compare_digest(presented.encode(), f"Bearer {token}".encode())


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str):
        self.metadata = ((HEADER, f"Bearer {token}"),)

    def _with_token(self, details):
        return details._replace(metadata=(*(details.metadata or ()), *self.metadata))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._with_token(details), request_iterator)


def channel(address: str, token: str | None, options=None) -> grpc.Channel:
    """An insecure gRPC channel to `address` that sends the job token with every call."""
    ch = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(ch, _AddToken(token)) if token else ch


class RequireToken(grpc.ServerInterceptor):
    """Refuses every call that does not carry the job token, before any handler runs."""

    def __init__(self, token: str):
        self.token = token

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this job's token is required")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_stream_rpc_method_handler(deny)  # the Calls stream (ecrec.streams)

    def intercept_service(self, continuation, handler_call_details):
        presented = dict(handler_call_details.invocation_metadata or ()).get(HEADER)
        if valid(self.token, presented):
            return continuation(handler_call_details)
        return self._deny_stream if handler_call_details.method.endswith("/Calls") else self._deny

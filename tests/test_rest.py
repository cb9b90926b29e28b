"""ecrec.rest: one TLS context per process, shared by every client; the job token in every request."""

from __future__ import annotations

import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from ecrec import rest


class _Echo(BaseHTTPRequestHandler):
    """Answers every GET and POST with the authorization header it got."""

    def _answer(self):
        n = int(self.headers.get("content-length") or 0)
        self.rfile.read(n)
        body = (self.headers.get("authorization") or "-").encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def echo():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_clients_share_one_tls_context(monkeypatch, echo):
    made = []
    real = httpx.create_ssl_context

    def counting(*a, **kw):
        made.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(httpx, "create_ssl_context", counting)
    rest.tls_context.cache_clear()
    try:
        clients = [rest.client(timeout=5.0, token="t") for _ in range(3)]
        assert rest.get(f"{echo}/x", timeout=5.0).status_code == 200
        assert rest.post(f"{echo}/y", timeout=5.0, json={}).status_code == 200
        for c in clients:
            assert c.get(f"{echo}/z").status_code == 200
            c.close()
        assert len(made) == 1
    finally:
        rest.tls_context.cache_clear()


def test_the_shared_context_still_verifies_certificates():
    ctx = rest.tls_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def test_the_job_token_travels_only_when_there_is_one(echo):
    assert rest.get(f"{echo}/a", timeout=5.0, token="s3cret").text == "Bearer s3cret"
    assert rest.post(f"{echo}/b", timeout=5.0, token="s3cret", json={"x": 1}).text == "Bearer s3cret"
    assert rest.get(f"{echo}/c", timeout=5.0).text == "-"
    with rest.client(timeout=5.0, token="k") as c:
        assert c.get(f"{echo}/d").text == "Bearer k"

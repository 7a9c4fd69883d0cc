"""An HTTP proxy in front of the S3 endpoint (moto's server) that can misbehave like a real object store.

`error_rate`: that share of requests is answered `503 SlowDown` (S3's throttling answer) instead of being
forwarded; `down()`: the endpoint vanishes (the port refuses connections) until `up()`. Everything else is
forwarded to the real endpoint unchanged, request by request.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection", "upgrade"}
_SLOW_DOWN = b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"


class ChaosProxy:
    def __init__(self, upstream: str, seed: int = 11):
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.error_rate = 0.0
        self.errors_served = 0
        self.forwarded = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._conns: set[socket.socket] = set()
        self.port = 0
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _fail_this_one(self) -> bool:
        with self._lock:
            fail = self._rng.random() < self.error_rate
            if fail:
                self.errors_served += 1
            else:
                self.forwarded += 1
            return fail

    def up(self) -> None:
        if self._server is not None:
            return
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def setup(self):
                super().setup()
                proxy._conns.add(self.connection)

            def finish(self):
                proxy._conns.discard(self.connection)
                super().finish()

            def _relay(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy._fail_this_one():
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(_SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP_HEADERS:
                            self.send_header(k, v)
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _relay

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        threading.Thread(target=server.serve_forever, name="s3-chaos-proxy", daemon=True).start()

    def down(self) -> None:
        """The endpoint vanishes: the listening socket closes, so new connections are refused."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        for conn in list(self._conns):  # kept-alive connections die with it
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.down()

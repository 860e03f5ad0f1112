"""A fault-injecting HTTP proxy in front of an S3 endpoint, for tests.

Every request is forwarded to the upstream endpoint; the responses of GETs
whose path matches ``target`` get faults with the configured probabilities:

* ``flip``: one byte of the body flipped (length and headers unchanged);
* ``truncate``: the announced length, but the connection closed mid-body;
* ``short``: a consistent ``206`` with fewer bytes than asked for;
* ``past_end``: ``400 InvalidRange`` as some servers answer a range past the end;
* ``error``: ``503 SlowDown``;
* ``reset``: the connection closed without a response.

With ``drops`` set, the first ``drops`` attempts of every matching GET (one botocore
call, told apart by its ``amz-sdk-invocation-id`` header) get no answer, the connection
closed, as from an endpoint that is restarting; ``attempts`` counts the attempts seen per
call.

Setting ``stall`` makes every matching GET (or request of ``stall_methods``) wait,
unanswered, until the proxy closes (an endpoint that accepts requests and never answers
them).

``counts`` records how many faults of each kind were injected. Faults are drawn
from a seeded generator, so a run is repeatable up to thread interleaving.
"""

from __future__ import annotations

import collections
import http.client
import http.server
import random
import re
import threading
import urllib.parse
from typing import Any

__all__ = ["FAULTS", "FaultProxy"]

FAULTS = ("flip", "truncate", "short", "past_end", "error", "reset")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class FaultProxy:
    """Forward HTTP to ``upstream``, injecting faults into matching GET responses.

    Args:
        upstream: base URL of the real endpoint (``http://host:port``).
        rates: probability of each fault (keys from ``FAULTS``) per matching GET.
        target: regular expression a request path must match to get faults.
        seed: seed of the fault generator.
        first: faults given, in order, to the first matching GETs before any are drawn,
            so a test can rely on them happening whatever the number of requests.
        stall_methods: the HTTP methods of the matching requests that ``stall`` holds.
        batch_delete: ``False`` answers ``DeleteObjects`` with ``501 NotImplemented``,
            as some S3-compatible stores do.
        drops: attempts of every matching GET closed unanswered before one is forwarded.
    """

    def __init__(
        self,
        upstream: str,
        rates: dict[str, float] | None = None,
        target: str = r"/c-[0-9a-f]+-\d+$",
        seed: int = 0,
        batch_delete: bool = True,
        first: tuple[str, ...] = (),
        stall_methods: tuple[str, ...] = ("GET",),
        drops: int = 0,
    ) -> None:
        unknown = sorted(set(first) - set(FAULTS))
        if unknown:
            raise ValueError(f"unknown faults in first: {unknown}")
        self._first = list(first)
        self.batch_delete = batch_delete
        self.stall_methods = frozenset(stall_methods)
        parsed = urllib.parse.urlsplit(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self.rates = dict(rates or {})
        self.target = re.compile(target)
        self.counts: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self.drops = drops
        self.attempts: collections.Counter[str] = collections.Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.stall = threading.Event()
        self._closing = threading.Event()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                proxy._forward(self)

            do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 256  # many parallel connects

        self.server = Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self.server.shutdown()
        self.server.server_close()

    def _draw(self) -> str | None:
        with self._lock:
            if self._first:
                name = self._first.pop(0)
                self.counts[name] += 1
                return name
            roll = self._rng.random()
            for name in FAULTS:
                rate = self.rates.get(name, 0.0)
                if roll < rate:
                    self.counts[name] += 1
                    return name
                roll -= rate
        return None

    @staticmethod
    def _error(handler: http.server.BaseHTTPRequestHandler, code: int, name: str) -> None:
        text = (
            f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{name}</Code>'
            f"<Message>injected</Message></Error>"
        ).encode()
        handler.send_response(code)
        handler.send_header("Content-Type", "application/xml")
        handler.send_header("Content-Length", str(len(text)))
        handler.end_headers()
        handler.wfile.write(text)

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else None
        query = urllib.parse.urlsplit(handler.path).query
        if not self.batch_delete and handler.command == "POST" and "delete" in query.split("&"):
            with self._lock:
                self.counts["not_implemented"] += 1
            self._error(handler, 501, "NotImplemented")
            return
        path = urllib.parse.urlsplit(handler.path).path
        if self.drops and handler.command == "GET" and self.target.search(path):
            call = str(handler.headers.get("amz-sdk-invocation-id"))
            with self._lock:
                self.attempts[call] += 1
                seen = self.attempts[call]
            if seen <= self.drops:
                handler.close_connection = True
                return
        if (
            self.stall.is_set()
            and handler.command in self.stall_methods
            and self.target.search(path)
        ):
            with self._lock:
                self.counts["stall"] += 1
            self._closing.wait(600)
            handler.close_connection = True
            return
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP}
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            conn.request(handler.command, handler.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            status, out_headers = (
                resp.status,
                [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP],
            )
        finally:
            conn.close()
        with self._lock:
            self.requests[handler.command] += 1
        fault = None
        if handler.command == "GET" and status in (200, 206) and data and self.target.search(path):
            fault = self._draw()
        if fault == "reset":
            handler.close_connection = True
            return
        if fault == "error":
            self._error(handler, 503, "SlowDown")
            return
        if fault == "past_end":  # 400, as some S3-compatible servers answer
            self._error(handler, 400, "InvalidRange")
            return
        if fault == "flip":
            pos = self._rng.randrange(len(data))
            data = data[:pos] + bytes([data[pos] ^ (1 << self._rng.randrange(8))]) + data[pos + 1 :]
        if fault == "short" and len(data) > 1:
            keep = max(1, len(data) // 2)
            data = data[:keep]
            out_headers = [(k, v) for k, v in out_headers if k.lower() != "content-range"]
            match = _RANGE.match(str(resp.getheader("Content-Range") or ""))
            first = int(match.group(1)) if match else 0
            total = int(match.group(3)) if match else len(data)
            out_headers.append(("Content-Range", f"bytes {first}-{first + keep - 1}/{total}"))
            status = 206
        handler.send_response(status)
        if handler.command == "HEAD":  # the upstream's headers, length included
            for k, v in out_headers:
                handler.send_header(k, v)
            handler.end_headers()
            return
        for k, v in out_headers:
            if k.lower() != "content-length":
                handler.send_header(k, v)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if fault == "truncate" and len(data) > 1:
            handler.wfile.write(data[: len(data) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            return
        handler.wfile.write(data)

"""Real servers on loopback for the remote-data tests: an HTTP file server (Range requests,
ETag, Last-Modified, request counts and fault switches; it can be stopped and started again on
its port) and moto's S3 server."""
from __future__ import annotations

import email.utils
import hashlib
import os
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class _Quiet(ThreadingHTTPServer):
    """A client that went away (the server was stopped under it) is not an error to print."""

    allow_reuse_address = True
    daemon_threads = True

    def handle_error(self, request, client_address):
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, OSError)):
            super().handle_error(request, client_address)


class FileServer:
    """Serves the files under ``root`` at ``http://127.0.0.1:PORT/<relative path>``.

    Attributes (tests set them while it runs):
        fail: ``{name: n}``: the next ``n`` ranged GETs of ``name`` (downloads) answer 503.
        down: names every request for which answers 503.
        truncate: ``{name: n}``: the next ``n`` GETs of ``name`` send half of the body they
            announce, then close the connection.
        corrupt: ``{name: n}``: the next ``n`` GETs of ``name`` flip a byte of the body (the
            ETag stays the file's: damage the ETag cannot show).
        delay: ``{name: seconds}``: GETs of ``name`` wait this long before answering.
        after_get: ``{name: callable}``: called once, after the next GET of ``name`` was sent.
        flaky: ``{name: n}``: the next ``n`` requests of ``name`` (any method) answer 503.
        status: ``{name: code}``: every request for ``name`` answers this HTTP status (404, 500 ...)
            with an empty body.
        html: names (or folder names, without a trailing slash) answered with a 200 HTML page (a
            server's folder listing), whatever the file is.
        ranges: False: Range headers are ignored (200 with the whole file, no ``Accept-Ranges``).
        etag, last_modified: False: the header is not sent (ETag: an MD5 prefix of the content;
            Last-Modified: the file's mtime).
        requests: ``Counter`` of ``(method, name)``; ``bytes_sent``: body bytes of GETs.

    :meth:`stop` closes the port and every open connection (clients get "connection refused");
    :meth:`start` serves again on the same port.
    """

    def __init__(self, root):
        self.root = Path(root)
        self.fail: dict[str, int] = {}
        self.down: set[str] = set()
        self.status: dict[str, int] = {}
        self.flaky: dict[str, int] = {}
        self.html: set[str] = set()
        self.ranges = True
        self.etag = True
        self.last_modified = True
        self._conns: set = set()
        self.truncate: dict[str, int] = {}
        self.corrupt: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        self.after_get: dict = {}
        self.requests: Counter = Counter()
        self.bytes_sent = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):   # quiet
                pass

            def setup(self):
                super().setup()
                with server._lock:
                    server._conns.add(self.connection)

            def finish(self):
                try:
                    super().finish()
                finally:
                    with server._lock:
                        server._conns.discard(self.connection)

            def do_HEAD(self):
                server._serve(self, body=False)

            def do_GET(self):
                server._serve(self, body=True)

        self._handler = Handler
        self.port = 0
        self.httpd = None
        self.start()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Serve (again) on the server's port."""
        if self.httpd is not None:
            return
        self.httpd = _Quiet(("127.0.0.1", self.port), self._handler)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the port and every open connection: requests are refused until :meth:`start`."""
        if self.httpd is None:
            return
        self.httpd.shutdown()
        try:   # worker processes forked meanwhile hold the listening socket too: stop it for all
            self.httpd.socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.httpd.server_close()
        self._thread.join(5)
        self.httpd = None
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def gets(self, name: str) -> int:
        return self.requests[("GET", name)]

    def _take(self, table: dict, name: str) -> bool:
        with self._lock:
            n = table.get(name, 0)
            if n > 0:
                table[name] = n - 1
                return True
            return False

    def _serve(self, h, body: bool) -> None:
        name = h.path.lstrip("/").split("?")[0]
        with self._lock:
            self.requests[(h.command, name)] += 1
        path = self.root / name
        code = self.status.get(name) or (503 if self._take(self.flaky, name) else None)
        if code is not None:
            h.send_response(code)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        if name.rstrip("/") in self.html:
            page = (f"<!DOCTYPE html><html><head><title>Index of /{name}</title></head><body><h1>Index of "
                    f"/{name}</h1><ul><li><a href=\"a.tar\">a.tar</a></li></ul></body></html>").encode()
            h.send_response(200)
            h.send_header("Content-Type", "text/html; charset=utf-8")
            h.send_header("Content-Length", str(len(page)))
            h.end_headers()
            if body:
                h.wfile.write(page)
            return
        if name in self.down or (h.command == "GET" and "Range" in h.headers and self._take(self.fail, name)):
            h.send_response(503)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        if not path.is_file():
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        data = path.read_bytes()
        etag = '"' + hashlib.md5(data).hexdigest()[:16] + '"'
        start, end = 0, len(data)
        rng = h.headers.get("Range") if self.ranges else None
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else max(0, len(data) - int(b))
            end = min(len(data), int(b) + 1) if a and b else len(data)
            h.send_response(206)
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        else:
            h.send_response(200)
        part = data[start:end]
        h.send_header("Content-Length", str(len(part)))
        if self.ranges:
            h.send_header("Accept-Ranges", "bytes")
        if self.etag:
            h.send_header("ETag", etag)
        if self.last_modified:
            h.send_header("Last-Modified", email.utils.formatdate(path.stat().st_mtime, usegmt=True))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if not body:
            return
        if name in self.delay:
            time.sleep(self.delay[name])
        if part and self._take(self.corrupt, name):
            part = bytes([part[0] ^ 0xFF]) + part[1:]
        if self._take(self.truncate, name):
            h.wfile.write(part[:len(part) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        with self._lock:   # counted before it is sent: a client that has the bytes sees them counted
            self.bytes_sent += len(part)
            hook = self.after_get.pop(name, None)
        h.wfile.write(part)
        if hook is not None:
            hook()

    def close(self) -> None:
        self.stop()


class S3Server:
    """moto's S3 server on loopback; ``storage_options`` reach it with s3fs (dummy credentials
    in the environment, set by the fixture)."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.storage_options = {"client_kwargs": {"endpoint_url": self.endpoint}, "use_listings_cache": False}

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def upload_dir(self, local, bucket: str, prefix: str = "") -> str:
        fs = self.filesystem()
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        for p in sorted(Path(local).iterdir()):
            if p.is_file():
                fs.put_file(str(p), f"{bucket}/{prefix}{p.name}")
        return f"s3://{bucket}/{prefix}"

    def close(self) -> None:
        self.server.stop()


def dummy_aws_env(monkeypatch) -> None:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_SESSION_TOKEN": "testing"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

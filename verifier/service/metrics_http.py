"""A Prometheus scrape endpoint that answers ``GET /metrics`` and nothing else (404 elsewhere)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class MetricsServer:
    """Serves ``registry`` at ``http://bind:port/metrics`` from a daemon thread (port 0: a free one)."""

    def __init__(self, bind: str, port: int, registry: CollectorRegistry):
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server hook name
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                return None

        self.httpd = ThreadingHTTPServer((bind, port), Handler)
        self.httpd.daemon_threads = True
        self.bind = bind
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="stree-metrics", daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"{self.bind}:{self.httpd.server_port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

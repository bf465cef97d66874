"""uvicorn serving the OpenAI app on the caller's event loop (beside the gRPC server), over TLS when given a
certificate and key."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Optional

import uvicorn


class HttpServer:
    """``start``/``stop`` coroutines for an ASGI ``app`` on ``bind:port`` (0: a free port).

    ``tls``: ``(cert_chain_pem, private_key_pem)`` bytes: serve HTTPS (the same pair the gRPC server takes).
    """

    def __init__(self, app, bind: str = "127.0.0.1", port: int = 0, tls: Optional[tuple[bytes, bytes]] = None):
        self.config = uvicorn.Config(app, host=bind, port=port, log_level="warning", lifespan="off",
                                     access_log=False, timeout_graceful_shutdown=2)
        self.tls = tls
        self.server = uvicorn.Server(self.config)
        self.bind = bind
        self.port: Optional[int] = None
        self._task: Optional[asyncio.Task] = None

    def _load_config(self) -> None:
        """Load uvicorn's config now; with TLS from PEM files that exist only while it reads them (0600)."""
        if self.tls is None:
            self.config.load()
            return
        with tempfile.TemporaryDirectory(prefix="stree-tls-") as folder:
            cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
            for path, data in ((cert, self.tls[0]), (key, self.tls[1])):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            self.config.ssl_certfile, self.config.ssl_keyfile = str(cert), str(key)
            self.config.load()

    async def start(self, timeout: float = 30.0) -> None:
        self._load_config()
        self._task = asyncio.ensure_future(self.server.serve())
        waited = 0.0
        while not self.server.started:
            if self._task.done():
                self._task.result()  # raises the start-up error
                raise RuntimeError(f"the HTTP server on {self.bind} stopped during start-up")
            await asyncio.sleep(0.02)
            waited += 0.02
            if waited > timeout:
                raise RuntimeError(f"the HTTP server on {self.bind} did not start in {timeout:.0f} s")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"{self.bind}:{self.port}"

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(self._task, 10)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            self.server.force_exit = True
        self._task = None

"""Servers for tests: a real server process on a free loopback port (started, waited for, stopped), and small
in-process JSON endpoints (`JSONHandler` + `loopback`) that play a remote API."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(command: list[str], health_url: str, log_path: Path, *, env: dict | None = None,
                   cwd: Path | None = None, timeout_s: float = 120) -> Iterator[subprocess.Popen]:
    """Run `command` (output to `log_path`) until `health_url` answers 200; raise with the log's tail if the
    process exits or stays unhealthy for `timeout_s`. Terminates (then kills) the process on exit."""
    with log_path.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{command[0]} not healthy after {timeout_s:.0f} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class JSONHandler(BaseHTTPRequestHandler):
    """Base of the in-process test endpoints: quiet, reads a JSON body, writes a JSON reply. `self.server.state`
    is the dict the test shares with the handler."""

    server: ThreadingHTTPServer

    def log_message(self, *args):
        pass

    def read_json(self):
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def reply(self, status: int, payload, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        for key, value in {"Content-Type": "application/json", "Content-Length": str(len(data)),
                           **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)


@contextmanager
def loopback(handler: type[JSONHandler], state: dict) -> Iterator[tuple[str, dict]]:
    """Serve `handler` on a free loopback port with `state` (plus a "lock") in threads; yields (url, state)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.state = {"lock": threading.Lock(), **state}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", server.state
    finally:
        server.shutdown()
        server.server_close()

"""Start a real server process on a free loopback port for a test, wait until it is healthy, stop it after."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server_process(command: list[str], health_url: str, log_path: Path, *, env: dict | None = None,
                   timeout_s: float = 120) -> Iterator[subprocess.Popen]:
    """Run `command` (output to `log_path`) until `health_url` answers 200; raise with the log's tail if the
    process exits or stays unhealthy for `timeout_s`. Terminates (then kills) the process on exit."""
    with log_path.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
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

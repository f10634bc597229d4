"""A real redis-server on a free loopback port, for tests (Debian's redis-server)."""
from __future__ import annotations

import pathlib
import shutil
import socket
import subprocess
import time
from devtools.stack import free_port




class RedisServer:
    def __init__(self, workdir: pathlib.Path, port: int | None = None, args: tuple[str, ...] = ()):
        """args: more redis-server flags (`--timeout 1`, `--maxmemory-policy noeviction`)."""
        self.workdir, self.port, self.args = workdir, port or free_port(), tuple(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not installed: run `make system-deps`")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

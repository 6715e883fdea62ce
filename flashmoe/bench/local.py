"""Local servers for the benchmark tools and the tests: a free loopback port, and a private
``redis-server`` on one."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import redis

START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A ``redis-server`` child on a free loopback port, without persistence (``args``: more of
    its options, e.g. ``--dir``); ``stop`` and ``start`` again keep the port (a restarted
    Redis, empty). Ready once it answers PING."""

    def __init__(self, *args: str) -> None:
        self.binary = shutil.which("redis-server")
        self.port = free_port()
        self.args, self.proc = args, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        if self.binary is None:
            raise RuntimeError("redis-server is not installed (scripts/setup.sh installs it)")
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind",
                                      "127.0.0.1", "--save", "", "--appendonly", "no",
                                      *self.args], stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop(kill=True)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within "
                           f"{START_TIMEOUT_S:g} s")

    def stop(self, kill: bool = False) -> None:
        """Terminate it (``kill``: SIGKILL, a crashed Redis)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(10)
        self.proc = None

    def client(self, password: str | None = None) -> redis.Redis:
        return redis.Redis.from_url(self.url, password=password)

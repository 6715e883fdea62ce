"""A live `flashmoe serve` for tests: the real command in its own process group, on a free
port, ready once ``/health`` answers 200; stopped with SIGTERM (the whole group killed if it
outlives its grace period)."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from flashmoe.bench.local import free_port
from flashmoe.runtime.launch import child_env, cli_command, stop_process

READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 30.0


class Server:
    def __init__(self, store: Path, home: Path, *settings: str, log: Path | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log or home.with_name(home.name + "-serve.log")
        home.mkdir(parents=True, exist_ok=True)
        args = ["serve", str(store), "--home", str(home), "--set", f"serve.port={self.port}",
                "--set", "panel.port=0"]
        for item in settings:
            args += ["--set", item]
        with open(self.log_path, "ab") as log_file:
            self.proc = subprocess.Popen(cli_command(*args), env=child_env(), stdout=log_file,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.3)
        raise RuntimeError(f"serve not ready in {READY_TIMEOUT_S:g} s:\n{self.log()}")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=30) as reply:
            return json.loads(reply.read())

    def stats(self) -> dict:
        return self.get("/stats")

    def stop(self) -> int:
        return stop_process(self.proc, STOP_GRACE_S, kill_group=True)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

"""A live control panel for tests: `flashmoe serve-panel` in its own process on a free port,
over real control sockets (``FakeService``: a ``common.bus.ControlServer`` in the test process
whose stats are a live run's and whose config holds secrets)."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import zmq

from common.bus import ControlServer
from common.config import load_config
from flashmoe.runtime.launch import child_env, cli_command, stop_process

TOKEN = "exposure-test-token-7f3a"
REDIS_PASSWORD = "hunter2-in-the-url"
CLUSTER_PASSWORD = "cluster-password-9c1d"
API_KEY = "serve-api-key-5e2b"
REDIS_URL = f"redis://:{REDIS_PASSWORD}@redis.example:6379/0"
SECRETS = (TOKEN, REDIS_PASSWORD, CLUSTER_PASSWORD, API_KEY)
START_TIMEOUT_S = 60.0


def secret_settings() -> list[str]:
    return [f"cluster.redis_url={REDIS_URL}", f"cluster.password={CLUSTER_PASSWORD}",
            f"serve.api_key={API_KEY}", f"panel.token={TOKEN}"]


# Stats as `flashmoe run` reports them (one stats round of a live run), and a Redis error
# that quotes the URL.
STATS = {
    "cache_manager": {
        "rejected_malformed": 0, "rejected_wrong_version": 0, "rejected_oversized": 0,
        "rejected_unexpected": 0, "rejected_config_mismatch": 0, "n_byte_read": 10584240128,
        "n_checksum_error": 0, "n_io_error": 0, "n_acquire": 4587, "n_prefetch_hint": 0,
        "workers_gone": 0, "requests_cancelled": 0, "predictions": 187, "n_hit": 13112,
        "n_miss": 5236, "n_hit_loading": 64, "n_evict": 6157, "n_load": 6349,
        "n_load_failed": 0, "prefetch_issued": 1177, "prefetch_used": 804,
        "prefetch_wasted": 370, "prefetch_failed": 0, "prefetch_dropped": 0,
        "prefetch_learned": 1179, "prefetch_bytes": 1959883904,
        "prefetch_used_bytes": 1338782208, "prefetch_wasted_bytes": 616106240,
        "n_byte_loaded": 10572050048, "estimates_used": 6157, "resident": 192, "loading": 0,
        "pinned": 4, "prefetch_inflight": 0, "prefetch_pending": 0, "n_slots": 192,
        "capacity": 192, "engine": "uring", "engine_direct": 1, "engine_fixed_buffers": 1,
        "engine_fixed_buffers_reason": "", "engine_fallback_reason": "",
        "engine_inflight": 0, "policy": "flashmoe", "estimate": "fresh",
        "estimate_age_ms": 21.0, "prediction_gaps": 0, "prefetcher_hints": 0,
        "policy_params": '{"hybrid_share": 0.0}', "workers": 1, "state": "running",
        "pid": 22592, "read_p50_us": 2120.143, "read_p99_us": 6266.004839999978,
        "cluster_state": "alone", "cluster_reason": f"cannot reach {REDIS_URL}: refused"},
    "feature_extractor": {
        "events": 191, "batches": 191, "checkpoints": 0, "n_gap": 0, "n_out_of_order": 0,
        "rejected_unexpected": 0, "n_received": 191, "state": "running", "pid": 22552,
        "uptime_s": 21.248, "variance_kept": 0.977199428788488, "cpu_ms_per_event": 0.69,
        "tokens_seen": 23541},
    "predictor": {
        "batches": 191, "predictions": 187, "checkpoints": 0, "n_gap": 0, "n_out_of_order": 0,
        "rejected_unexpected": 0, "rejected_shape": 0, "n_received": 191, "state": "running",
        "pid": 22485, "uptime_s": 29.779, "model": "linear",
        "inference": "fused C, int8 heads", "tokens": 190, "steps": 365, "drifts": 0,
        "cpu_ms_infer": 0.517, "cpu_ms_train": 0.559, "cpu_ms_quantize": 0.447,
        "recall_at_k": 0.6486},
}


class FakeService:
    """A real control socket answering stats and a config that hold the secrets."""

    def __init__(self, endpoint: str, name: str) -> None:
        self.ctx = zmq.Context()
        config = load_config(env={}, overrides=secret_settings())
        self.server = ControlServer(self.ctx, config, endpoint, name,
                                    stats=lambda: dict(STATS[name]),
                                    state=lambda: "running", lock=threading.Lock())

    def close(self) -> None:
        self.server.close()
        self.ctx.term()


class PanelProcess:
    """`flashmoe serve-panel` on a free port, its URL read from ``panel.json``."""

    def __init__(self, root: Path, *settings: str, services: dict[str, str] | None = None
                 ) -> None:
        self.runtime = root / "rt"
        self.info = self.runtime / "panel.json"
        args = ["serve-panel", "--runtime-dir", str(self.runtime), "--port", "0"]
        for name, endpoint in (services or {}).items():
            args += ["--service", f"{name}={endpoint}"]
        for item in settings:
            args += ["--set", item]
        self.log_path = root / "panel.out"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cli_command(*args), env=child_env(), stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.info.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the panel did not start:\n{self.log()}")
            time.sleep(0.1)
        self.port = json.loads(self.info.read_text())["port"]
        self.wait_answering()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_answering(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self.request("GET", "/openapi.json")
                return
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"the panel does not answer:\n{self.log()}")

    def request(self, method: str, path: str, body: dict | None = None,
                headers: dict | None = None, host: str | None = None
                ) -> tuple[int, str, http.client.HTTPMessage]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.putrequest(method, path, skip_host=host is not None)
            if host is not None:
                conn.putheader("Host", host)
            data = json.dumps(body).encode() if body is not None else None
            for name, value in {**(headers or {}),
                                **({"Content-Type": "application/json",
                                    "Content-Length": str(len(data))} if data else {})}.items():
                conn.putheader(name, value)
            conn.endheaders(data)
            reply = conn.getresponse()
            return reply.status, reply.read().decode(errors="replace"), reply.headers
        finally:
            conn.close()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        return stop_process(self.proc, 30, sig)


@contextmanager
def panel_over_services(root: Path, *settings: str) -> Iterator[PanelProcess]:
    """A panel polling a FakeService per service of ``STATS``, once it has their stats."""
    endpoints = {name: f"ipc://{root}/{name}.control" for name in STATS}
    services = [FakeService(endpoint, name) for name, endpoint in endpoints.items()]
    try:
        proc = PanelProcess(root, *settings, services=endpoints)
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while set(json.loads(proc.request("GET", "/api/stats")[1])["services"]) != \
                    set(STATS):
                assert time.monotonic() < deadline, "the panel never polled the services"
                time.sleep(0.2)
            yield proc
        finally:
            proc.stop()
    finally:
        for service in services:
            service.close()

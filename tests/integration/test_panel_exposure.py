"""What a real control panel process shows and to whom (issue 23, "Exposure" and "Clean
exits"): no secret in any read (the config, the stats, the metrics, the health), writes only
with the token, a Host-header allow-list against DNS rebinding, and SIGTERM/SIGINT a clean
exit (status 0, ``panel.json`` removed).

The panel is `flashmoe serve-panel` in its own process, over real HTTP; the service it polls
is a real control socket (``common.bus.ControlServer``) in the test process, whose config and
stats carry the secrets a Redis link would.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common.bus import ControlServer
from common.config import load_config
from flashmoe.runtime.launch import child_env, cli_command

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
        "capacity": 192, "engine": "uring", "engine_direct": 1, "engine_fallback_reason": "",
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
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    root = tmp_path_factory.mktemp("exposure")
    endpoints = {name: f"ipc://{root}/{name}.control" for name in STATS}
    services = [FakeService(endpoint, name) for name, endpoint in endpoints.items()]
    try:
        proc = PanelProcess(root, *secret_settings(),
                            "panel.allowed_hosts=panel.lan, Box.Example.", services=endpoints)
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


@pytest.mark.parametrize("path", ["/api/config", "/api/stats", "/metrics", "/health",
                                  "/openapi.json", "/api/history", "/"])
def test_reads_are_open_and_show_no_secret(panel, path):
    status, text, _ = panel.request("GET", path)
    assert status == 200, text
    for secret in SECRETS:
        assert secret not in text, f"{path} shows a secret"


def test_a_url_with_credentials_is_shown_without_them(panel):
    config = json.loads(panel.request("GET", "/api/config")[1])
    fields = {row["key"]: row for row in config["fields"]}
    assert fields["cluster.redis_url"]["value"] == "redis://***@redis.example:6379/0"
    assert "cluster.password" not in fields and "panel.token" not in fields
    stats = json.loads(panel.request("GET", "/api/stats")[1])
    assert "redis://***@redis.example" in stats["services"]["cache_manager"]["cluster_reason"]


def test_health_answers_without_the_token(panel):
    status, text, _ = panel.request("GET", "/health")
    assert status == 200
    assert json.loads(text)["status"] == "ok"


def test_writes_need_the_token(panel):
    change = {"changes": {"prefetch.threshold": 0.5}}
    status, text, _ = panel.request("PUT", "/api/config", change)
    assert status == 401 and "token" in json.loads(text)["detail"]
    status, _, _ = panel.request("PUT", "/api/config", change,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
    assert status != 401


@pytest.mark.parametrize("host", ["evil.example", "evil.example:80", "127.0.0.1.evil.example",
                                  "localhost.evil.example:1234", "[::2]:80", "panel.lan.evil"])
@pytest.mark.parametrize("path", ["/api/stats", "/api/config", "/metrics", "/", "/health"])
def test_a_foreign_host_is_refused_with_400(panel, host, path):
    status, text, _ = panel.request("GET", path, host=host)
    assert status == 400
    assert "Host" in json.loads(text)["detail"]


def test_a_foreign_host_cannot_write_even_with_the_token(panel):
    status, _, _ = panel.request("PUT", "/api/config", {"changes": {"prefetch.threshold": 0.5}},
                                 headers={"Authorization": f"Bearer {TOKEN}"},
                                 host="evil.example")
    assert status == 400


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST", "panel.lan",
                                  "box.example", "box.example."])
def test_loopback_and_configured_names_are_answered(panel, host):
    status, text, _ = panel.request("GET", "/api/stats", host=f"{host}:{panel.port}")
    assert status == 200, text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_is_a_clean_exit(tmp_path, sig):
    proc = PanelProcess(tmp_path)
    assert proc.stop(sig) == 0, proc.log()
    assert not proc.info.exists(), "panel.json was left behind"
    assert "Traceback" not in proc.log()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_start_up_is_a_clean_exit(tmp_path, sig):
    """The signal lands while the panel builds its server (right after it prints its URL,
    before the service loop runs)."""
    args = ["serve-panel", "--runtime-dir", str(tmp_path / "rt"), "--port", "0"]
    proc = subprocess.Popen(cli_command(*args), env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()
        assert first.startswith("[panel]"), first
        proc.send_signal(sig)
        rest = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, first + rest
    assert not (tmp_path / "rt" / "panel.json").exists()
    assert "Traceback" not in rest


def test_metrics_follow_the_prometheus_conventions(panel):
    """Parsed with prometheus_client's own parser: counters are counters named ``_total``,
    names carry base units only, every family has a written help line, no pid is a value."""
    status, text, headers = panel.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"flashmoe_up", "flashmoe_cache_manager_hits", "flashmoe_cache_manager_read_bytes",
            "flashmoe_predictor_drifts", "flashmoe_panel_stats_rounds"} <= set(families)
    for name, family in families.items():
        assert family.type in ("counter", "gauge"), name
        assert family.documentation.strip(), f"{name} has no help"
        assert not re.fullmatch(r"\w+ stat \w+", family.documentation), name
        assert not re.search(r"_(ms|us|mb|kb|mib|gb|percent|s)(_|$)", name), name
        assert not re.search(r"(^|_)(pid|pids|id)(_|$)", name), name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name in (f"{name}_total", f"{name}_created"), sample.name
            assert math.isfinite(sample.value), sample.name
    hits = families["flashmoe_cache_manager_hits"]
    assert hits.type == "counter" and hits.samples[0].value == 13112
    latency = families["flashmoe_cache_manager_read_latency_p50_seconds"].samples[0]
    assert latency.value == pytest.approx(2120.143e-6)
    rejected = {s.labels["reason"]: s.value
                for s in families["flashmoe_predictor_rejected_messages"].samples}
    assert rejected == {"unexpected": 0, "shape": 0}
    assert 4242 not in [s.value for f in families.values() for s in f.samples]
    assert 22592 not in [s.value for f in families.values() for s in f.samples]

"""What a real control panel process shows and to whom (issue 23, "Exposure" and "Clean
exits"): no secret in any read (the config, the stats, the metrics, the health), writes only
with the token, a Host-header allow-list against DNS rebinding, and SIGTERM/SIGINT a clean
exit (status 0, ``panel.json`` removed).

The panel is `flashmoe serve-panel` in its own process, over real HTTP; the services it polls
are real control sockets in the test process (``tests/support/panel.py``), whose config and
stats carry the secrets a Redis link would.
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flashmoe.runtime.launch import child_env, cli_command
from tests.support.panel import (SECRETS, TOKEN, PanelProcess, panel_over_services,
                                 secret_settings)

@pytest.fixture(scope="module")
def panel(tmp_path_factory):
    with panel_over_services(tmp_path_factory.mktemp("exposure"), *secret_settings(),
                             "panel.allowed_hosts=panel.lan, Box.Example.") as proc:
        yield proc


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

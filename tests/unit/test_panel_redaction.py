"""The panel's scrubbing of secrets (``core.Redactor``, ``secret_values``) and the names,
types and units of its metrics (``core.metric_samples``): pure, no sockets."""

import re

from common.config import allowed_hosts, host_name, load_config
from services.control_panel.core import (METRICS, PANEL_METRICS, RATE_METRICS, REDACTED,
                                         Redactor, metric_samples, redact, secret_values)

URL = "redis://user:s3cret-pass@redis.example:6379/0"


def test_url_credentials_are_scrubbed_anywhere_in_a_text():
    scrub = Redactor()
    assert scrub(URL) == "redis://***@redis.example:6379/0"
    assert scrub(f"cannot reach {URL}: refused") == \
        "cannot reach redis://***@redis.example:6379/0: refused"
    assert scrub("rediss://:pw@h/1 and http://a@b/") == "rediss://***@h/1 and http://***@b/"
    assert scrub("redis://redis.example:6379/0") == "redis://redis.example:6379/0"


def test_a_config_s_secrets_are_its_secret_fields_and_url_passwords(tmp_path):
    password_file = tmp_path / "pw"
    password_file.write_text("from-the-file\nsecond line\n")
    config = load_config(env={}, overrides=[
        f"cluster.redis_url={URL}", "cluster.password=plain-password", "panel.token=tok-123456",
        "serve.api_key=key-abcdef", f"cluster.password_file={password_file}"]).to_dict()
    assert secret_values(config) == {"s3cret-pass", "plain-password", "tok-123456",
                                     "key-abcdef", "from-the-file"}
    shown = redact(config)
    text = repr(shown)
    assert all(s not in text for s in secret_values(config))
    assert shown["cluster"]["redis_url"] == "redis://***@redis.example:6379/0"
    assert "password" not in shown["cluster"] and "token" not in shown["panel"]


def test_known_secrets_are_scrubbed_in_nested_values_and_keys():
    scrub = Redactor({"tok-123456", "ab"})
    assert scrub({"a": ["x tok-123456 y", {"tok-123456": 1}], "b": "ab", "c": "abc", "n": 3}) \
        == {"a": [f"x {REDACTED} y", {REDACTED: 1}], "b": REDACTED, "c": "abc", "n": 3}


def test_allowed_hosts_are_the_loopback_names_the_bind_address_and_the_configured_ones():
    assert allowed_hosts("", "127.0.0.1") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts("", "0.0.0.0") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts("", "::") == {"localhost", "127.0.0.1", "::1"}
    assert allowed_hosts(" Box.Lan. ,10.0.0.5", "192.168.1.5") == \
        {"localhost", "127.0.0.1", "::1", "box.lan", "10.0.0.5", "192.168.1.5"}
    assert allowed_hosts("a, *", "127.0.0.1") is None


def test_host_names_from_host_headers():
    assert host_name("LocalHost:8470") == "localhost"
    assert host_name("[::1]:8470") == "::1"
    assert host_name("[::1]") == "::1"
    assert host_name("box.lan.") == "box.lan"
    assert host_name("127.0.0.1") == "127.0.0.1"


UNIT_SUFFIX = re.compile(r"_(ms|us|mb|kb|mib|gb|percent|pct|s)(_|$)")


def test_every_metric_has_a_base_unit_name_and_a_written_help():
    metrics = [*PANEL_METRICS.values(), *RATE_METRICS.values(),
               *(m for table in METRICS.values() for m in table.values())]
    for metric in metrics:
        assert not UNIT_SUFFIX.search(metric.name), metric.name
        assert not metric.name.endswith("_total"), metric.name  # the exposition adds it
        assert metric.kind in ("counter", "gauge")
        assert metric.help.endswith(".") and len(metric.help.split()) >= 2, metric.name


def test_samples_are_in_base_units_with_pids_and_text_left_out():
    stats = {"n_hit": 5, "read_p50_us": 2000.0, "estimate_age_ms": -1, "pid": 4242,
             "policy": "lru", "engine_direct": True, "rejected_malformed": 2,
             "rejected_unknown_expert": 1, "cpu_ms_train": 0.5, "no_such_stat": 7,
             "uptime_s": 3.0, "read_p99_us": float("nan")}
    samples = {(name, tuple(labels.items())): (metric.kind, value)
               for name, metric, labels, value in metric_samples("cache_manager", stats)}
    assert samples == {
        ("flashmoe_cache_manager_hits", ()): ("counter", 5.0),
        ("flashmoe_cache_manager_read_latency_p50_seconds", ()): ("gauge", 2000.0 * 1e-6),
        ("flashmoe_cache_manager_rejected_messages", (("reason", "malformed"),)):
            ("counter", 2.0),
        ("flashmoe_cache_manager_rejected_messages", (("reason", "unknown_expert"),)):
            ("counter", 1.0),
        ("flashmoe_cache_manager_cpu_seconds_per_token", (("stage", "train"),)):
            ("gauge", 0.5e-3),
        ("flashmoe_cache_manager_uptime_seconds", ()): ("gauge", 3.0)}

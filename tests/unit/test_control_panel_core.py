"""The control panel's pure core (validation, refusals, merging the services' answers, rates)
and the control socket's tuning path (a real ControlServer on an ipc socket)."""

import threading

import pytest
import zmq

from common.bus import (ControlServer, ServiceUnavailable, policies, residency, service_config,
                        tune)
from common.config import describe_fields, load_config
from common.protocol import TuneRep
from services.control_panel.core import (History, Rates, changes_schema, fixed_refusals,
                                         merge_tune_replies, public_fields, redact,
                                         validate_changes)
from services.cache_manager.tuning import live_policies
from services.control_panel.panel import Panel

CONFIG = load_config(env={}, overrides=["panel.token=s3cret"])
POLICY_CHOICES = {"cache.policy": live_policies()}  # what a cache manager answers


def test_fields_and_schema_come_from_the_config_definition_without_the_token():
    rows = public_fields(CONFIG.to_dict())
    keys = [row["key"] for row in rows]
    assert keys == [row["key"] for row in describe_fields() if not row["secret"]]
    assert "panel.token" not in keys and "panel.port" in keys
    depth = next(row for row in rows if row["key"] == "io.queue_depth")
    assert (depth["lo"], depth["hi"], depth["live"], depth["value"]) == (1, 256, False, 8)
    schema = changes_schema(POLICY_CHOICES)
    assert schema["additionalProperties"] is False
    assert schema["properties"]["io.queue_depth"]["maximum"] == 256
    assert "lru" in schema["properties"]["cache.policy"]["enum"]
    assert "belady" not in schema["properties"]["cache.policy"]["enum"]  # needs the future
    assert "token" not in redact(CONFIG.to_dict())["panel"]


@pytest.mark.parametrize("key, value, words", [
    ("io.queue_depth", 100000, ["io.queue_depth", "[1, 256]"]),
    ("prefetch.threshold", 2.0, ["prefetch.threshold", "[0.0, 1.0]"]),
    ("cache.nothing", 1, ["unknown config field cache.nothing"]),
    ("nosection.x", 1, ["unknown config section"]),
    ("cache.policy", "belady", ["cache.policy", "choices"]),
    ("predictor.drift", "maybe", ["not a boolean"]),
])
def test_invalid_changes_name_the_field_and_its_range(key, value, words):
    checked, errors = validate_changes({key: value, "prefetch.window": 2}, POLICY_CHOICES)
    assert checked == {"prefetch.window": 2}
    assert len(errors) == 1 and errors[0]["field"] == key
    for word in words:
        assert word in errors[0]["message"]


def test_changes_that_cannot_happen_live_are_refused_with_the_reason():
    config = CONFIG.to_dict()
    checked, _ = validate_changes({"store.block_size": "128K", "profile": "8gb",
                                   "cache.capacity_experts": 500, "prefetch.window": 9,
                                   "io.queue_depth": 4, "cache.policy": "lru"})
    refused = fixed_refusals(checked, config, arena_slots=192)
    assert set(refused) == {"store.block_size", "profile", "cache.capacity_experts",
                            "prefetch.window", "io.queue_depth"}
    assert "flashmoe convert" in refused["store.block_size"]
    assert "192 slots" in refused["cache.capacity_experts"]
    assert "prefetch.budget = 8" in refused["prefetch.window"]
    assert "restart" in refused["profile"]


def test_merged_replies_need_a_taker_and_no_refusal():
    replies = {"cache_manager": TuneRep(0, True, ["cache.policy"], {}),
               "predictor": TuneRep(0, True, [], {"predictor.ewc_lambda": "busy"}),
               "feature_extractor": TuneRep(0, False, [], {}),
               "gone": "no answer"}
    takers, refused = merge_tune_replies(
        ["cache.policy", "predictor.ewc_lambda", "prefetch.threshold"], replies)
    assert takers["cache.policy"] == ["cache_manager"]
    assert refused == {"predictor.ewc_lambda": "predictor: busy",
                       "prefetch.threshold": "no running service takes prefetch.threshold "
                                             "live (no live tuning yet in: feature_extractor)"}


def test_rates_between_snapshots():
    rates, history = Rates(), History(points=3)
    first = rates.sample({"cache_manager": {"n_hit": 0, "n_miss": 0, "n_hit_loading": 0,
                                            "n_byte_read": 0}}, 10.0)
    assert first["hit_rate"] is None and first["tokens_per_s"] is None
    second = rates.sample({"cache_manager": {"n_hit": 60, "n_miss": 40, "n_hit_loading": 10,
                                             "n_byte_read": 4_000_000, "policy": "lru"},
                           "feature_extractor": {"events": 5, "cpu_ms_per_event": 0.5},
                           "predictor": {"cpu_ms_train": 1.0, "drifts": 2}}, 12.0)
    assert second["hit_rate"] == pytest.approx(0.7)
    assert second["stall_free_rate"] == pytest.approx(0.6)
    assert second["ssd_mb_per_s"] == pytest.approx(2.0)
    assert second["learner_cpu_ms_per_token"] == pytest.approx(1.5)
    assert second["drifts"] == 2 and second["policy"] == "lru"
    # A restarted cache manager (counters back to 0) gives no rate rather than a negative one.
    third = rates.sample({"cache_manager": {"n_hit": 1, "n_miss": 1, "n_hit_loading": 0,
                                            "n_byte_read": 0}}, 13.0)
    assert third["hit_rate"] is None
    for sample in (first, second, third, third):
        history.append(sample)
    series = history.series()
    assert len(series["t"]) == 3 and series["hit_rate"] == [pytest.approx(0.7), None, None]


@pytest.fixture
def control(tmp_path):
    """A ControlServer with a tuning hook that takes prefetch.threshold and refuses
    cache.policy=arc, as a service would."""
    ctx = zmq.Context()
    config = load_config(env={})
    calls = []

    def hook(changes, check):
        calls.append((dict(changes), check))
        applied = [k for k in changes if k in ("prefetch.threshold", "cache.policy")]
        refused = {"cache.policy": "not now"} if changes.get("cache.policy") == "arc" else {}
        return [k for k in applied if k not in refused], refused

    endpoint = f"ipc://{tmp_path}/svc.control.sock"
    server = ControlServer(ctx, config, endpoint, "svc", stats=lambda: {}, state=lambda: "ok",
                           lock=threading.Lock(), tune=hook)
    yield endpoint, config, calls
    server.close()
    ctx.term()


def test_control_server_checks_applies_and_reports_the_config(control):
    endpoint, config, calls = control
    rep = tune(endpoint, {"prefetch.threshold": 0.7}, check=True)
    assert rep.supported and rep.applied == ["prefetch.threshold"]
    assert config.prefetch.threshold == 0.55  # a check changes nothing
    rep = tune(endpoint, {"prefetch.threshold": 0.7, "io.queue_depth": 4,
                          "prefetch.window": 999, "cache.policy": "arc"})
    assert rep.applied == ["prefetch.threshold"]
    assert "not live" in rep.refused["io.queue_depth"]
    assert "out of range" in rep.refused["prefetch.window"]
    assert rep.refused["cache.policy"] == "not now"
    assert calls[-1] == ({"prefetch.threshold": 0.7, "cache.policy": "arc"}, False)
    assert config.prefetch.threshold == 0.7
    assert service_config(endpoint)["prefetch"]["threshold"] == 0.7
    with pytest.raises(ServiceUnavailable, match="does not answer ResidencyReq"):
        residency(endpoint)
    with pytest.raises(ServiceUnavailable, match="does not answer PoliciesReq"):
        policies(endpoint)


def test_with_no_cache_manager_the_panel_says_the_policy_choices_are_unknown(tmp_path):
    panel = Panel(CONFIG, runtime_dir=tmp_path)
    choices, unknown = panel.service_choices()
    assert choices == {} and "no cache manager is running" in unknown["cache.policy"]
    outcome = panel.apply({"cache.policy": "lru"})
    assert outcome.status == 422
    [error] = outcome.body["detail"]
    assert error["field"] == "cache.policy" and "no cache manager" in error["message"]
    assert [row for row in panel.config_view()["fields"]
            if row["key"] == "cache.policy"][0]["choices"] is None


def test_a_service_without_a_hook_says_it_takes_no_live_change(tmp_path):
    ctx = zmq.Context()
    endpoint = f"ipc://{tmp_path}/plain.control.sock"
    server = ControlServer(ctx, load_config(env={}), endpoint, "plain", stats=lambda: {},
                           state=lambda: "ok", lock=threading.Lock())
    try:
        rep = tune(endpoint, {"cache.policy": "lru"})
        assert not rep.supported and rep.applied == [] and rep.refused == {}
    finally:
        server.close()
        ctx.term()

import json

import pytest

from common.config import PROFILES, ConfigError, FlashMoEConfig, describe_fields, load_config, parse_size


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profiles_set_design_table_defaults(profile):
    cfg = load_config(profile=profile, env={})
    table = {"8gb": (32, 128 * 1024, 4), "16gb": (64, 256 * 1024, 8), "32gb": (128, 512 * 1024, 16)}
    assert (cfg.predictor.lstm_hidden, cfg.store.block_size, cfg.prefetch.window) == table[profile]


def test_precedence_profile_file_env_cli(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text('[io]\nqueue_depth = 4\nengine = "pread"\n[cache]\ncapacity_experts = 10\n')
    env = {"FLASHMOE_IO__QUEUE_DEPTH": "16", "FLASHMOE_CACHE__CAPACITY_EXPERTS": "20"}
    cfg = load_config(profile="8gb", file=path, env=env, overrides=["cache.capacity_experts=30"])
    assert cfg.io.engine == "pread"  # file
    assert cfg.io.queue_depth == 16  # env beats file
    assert cfg.cache.capacity_experts == 30  # CLI beats env
    assert cfg.store.block_size == 128 * 1024  # profile


def test_json_config_file_and_sizes(tmp_path):
    path = tmp_path / "f.json"
    path.write_text(json.dumps({"store": {"block_size": "512K"}, "profile": "32gb"}))
    cfg = load_config(file=path, env={})
    assert cfg.profile == "32gb" and cfg.store.block_size == 512 * 1024
    assert parse_size("1G") == 1 << 30 and parse_size("4096") == 4096


@pytest.mark.parametrize("override, words", [
    ("io.queue_depth=0", ["io.queue_depth", "[1, 256]"]),
    ("io.queue_depth=abc", ["io.queue_depth", "abc"]),
    ("io.engine=spdk", ["io.engine", "auto, uring, pread"]),
    ("store.block_size=5000", ["store.block_size", "multiple of 4096"]),
    ("predictor.lstm_hidden=48", ["predictor.lstm_hidden", "32, 64, 128"]),
    ("cache.nope=1", ["unknown config field cache.nope"]),
    ("nosection.x=1", ["unknown config section"]),
    ("io.queue_depth", ["section.field=value"]),
])
def test_invalid_values_name_field_and_range(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(env={}, overrides=[override])
    for word in words:
        assert word in str(info.value)


def test_env_errors_name_the_variable():
    with pytest.raises(ConfigError, match="FLASHMOE_IO__QUEUE_DEPTH"):
        load_config(env={"FLASHMOE_IO__QUEUE_DEPTH": "1000"})
    with pytest.raises(ConfigError, match="FLASHMOE_<SECTION>__<FIELD>"):
        load_config(env={"FLASHMOE_QUEUE_DEPTH": "8"})


def test_bad_profile_and_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="profile"):
        load_config(profile="4gb", env={})
    bad = tmp_path / "bad.toml"
    bad.write_text("[io\n")
    with pytest.raises(ConfigError, match="malformed"):
        load_config(file=bad, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(file=tmp_path / "missing.toml", env={})


def test_digest_changes_with_values_and_roundtrips():
    a = load_config(env={})
    b = load_config(env={}, overrides=["io.queue_depth=9"])
    assert a.digest() != b.digest()
    assert FlashMoEConfig.from_dict(b.to_dict()) == b


def test_every_field_is_documented():
    rows = describe_fields()
    assert rows and all(row["doc"] for row in rows)


def test_policy_params_is_a_table_from_file_env_or_cli(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text('[cache]\npolicy = "s3fifo"\n[cache.policy_params]\nsmall_fraction = 0.2\n')
    assert load_config(file=path, env={}).cache.policy_params == {"small_fraction": 0.2}
    cfg = load_config(env={"FLASHMOE_CACHE__POLICY_PARAMS": '{"a": 1}'},
                      overrides=['cache.policy_params={"b": 2}'])
    assert cfg.cache.policy_params == {"b": 2}
    with pytest.raises(ConfigError, match="cache.policy_params"):
        load_config(env={}, overrides=["cache.policy_params=[1, 2]"])
    with pytest.raises(ConfigError, match="cache.policy_params"):
        load_config(env={}, overrides=["cache.policy_params={not json"])


def test_section_digests_ignore_live_fields_and_name_the_differing_sections():
    from common.config import differing_sections

    base = load_config(env={})
    live = load_config(env={}, overrides=["cache.policy=arc", "prefetch.window=2"])
    assert base.section_digests() == live.section_digests()  # only live fields differ
    fixed = load_config(env={}, overrides=["store.block_size=128K", "io.queue_depth=4"])
    assert differing_sections(base.section_digests(), fixed.section_digests()) == ["store", "io"]
    assert differing_sections(base.section_digests(), fixed.section_digests(),
                              ("cache", "store")) == ["store"]


def test_profiles_set_the_prefetch_budget_and_new_fields_have_bounds():
    assert load_config(profile="8gb", env={}).prefetch.budget == 4
    for override in ("io.read_timeout_s=0", "ipc.heartbeat_timeout_s=0",
                     "ipc.heartbeat_interval_s=1000", "prefetch.budget=-1"):
        with pytest.raises(ConfigError, match="out of range"):
            load_config(env={}, overrides=[override])

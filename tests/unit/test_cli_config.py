"""Choices are checked where config is read: every enumerated field, and the policy name
against the live policy registry (which common/ cannot import: the app hands it over)."""

from __future__ import annotations

import pytest

from common.config import ConfigError, check_value, describe_fields, load_config
from flashmoe.cli.main import main  # its options module registers the policy names
from services.cache_manager.policies import POLICIES


def test_every_enumerated_field_refuses_an_unknown_value_with_the_choices():
    rows = [row for row in describe_fields() if row["choices"]]
    assert {"cache.policy", "cache.scope", "io.engine", "predictor.model"} <= \
        {row["key"] for row in rows}
    for row in rows:
        with pytest.raises(ConfigError) as refused:
            load_config(env={}, overrides=[f"{row['key']}=no-such-choice"])
        assert f"choices: {', '.join(map(str, row['choices']))}" in str(refused.value)


def test_the_policy_is_one_of_the_registry_from_every_source(tmp_path):
    assert next(r for r in describe_fields() if r["key"] == "cache.policy")["choices"] == \
        tuple(sorted(POLICIES))
    for name in POLICIES:
        assert load_config(env={}, overrides=[f"cache.policy={name}"]).cache.policy == name
    path = tmp_path / "c.toml"
    path.write_text('[cache]\npolicy = "foo"\n')
    with pytest.raises(ConfigError, match=r"cache.policy \(from file .*c.toml\) = 'foo'"):
        load_config(file=path, env={})
    with pytest.raises(ConfigError, match="env FLASHMOE_CACHE__POLICY"):
        load_config(env={"FLASHMOE_CACHE__POLICY": "foo"})
    with pytest.raises(ConfigError, match="choices: arc, belady"):
        check_value("cache.policy", "foo", "the control panel")


@pytest.mark.parametrize("setting, says", [
    ("cache.policy=foo", "cache.policy (from --set cache.policy=foo) = 'foo' is not allowed"),
    ('cache.policy_params={"nope": 1}', "lru: unknown parameter(s) nope"),
    ("cache.scope=everything", "choices: global, layer"),
])
def test_config_command_refuses_a_bad_choice(capsys, setting, says):
    """`config --set cache.policy=foo` used to print the config and exit 0."""
    assert main(["config", "--set", setting]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashmoe config: error: ") and says in err[0]

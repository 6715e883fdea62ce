"""`flashmoe doctor`: each check gives a verdict, and a fix where it is not ok."""

from common.config import load_config
from flashmoe.runtime import doctor as doc
from flashmoe.cli import main


def by_name(checks):
    return {c.name: c for c in checks}


def test_a_good_store_passes_and_names_the_engine(tiny_store, capsys):
    checks = by_name(doc.doctor(load_config(env={}), str(tiny_store)))
    assert checks["store"].verdict == doc.OK and checks["O_DIRECT"].verdict == doc.OK
    assert checks["engine"].verdict in (doc.OK, doc.WARN)
    assert main(["doctor", str(tiny_store)]) == 0
    assert "O_DIRECT" in capsys.readouterr().out


def test_a_missing_store_folder_is_said_not_to_exist(tmp_path):
    """`doctor nope` used to suggest re-converting a folder that does not exist."""
    checks = by_name(doc.doctor(load_config(env={}), str(tmp_path / "nothing")))
    assert checks["store"].verdict == doc.FAIL
    assert checks["store"].detail == f"{tmp_path / 'nothing'}: no such folder"
    assert "verify" not in checks["store"].fix and "again" not in checks["store"].fix
    assert checks["O_DIRECT"].verdict == doc.WARN and "not checked" in checks["O_DIRECT"].detail
    assert main(["doctor", str(tmp_path / "nothing")]) == 1


def test_a_folder_that_is_not_a_store_fails_with_the_convert_fix(tmp_path):
    checks = by_name(doc.doctor(load_config(env={}), str(tmp_path)))
    assert checks["store"].verdict == doc.FAIL and "not a store" in checks["store"].detail
    assert "flashmoe convert" in checks["store"].fix
    assert checks["O_DIRECT"].verdict == doc.FAIL and "convert" in checks["O_DIRECT"].fix


def test_an_arena_larger_than_dev_shm_fails():
    check = doc._dev_shm(10 ** 18)
    assert check.verdict == doc.FAIL and "shm_size" in check.fix


def test_pread_chosen_by_config_is_ok():
    config = load_config(env={}, overrides=["io.engine=pread"])
    assert doc._engine(config, doc.Check("io_uring_setup", doc.FAIL, "denied", "x")).verdict \
        == doc.OK
    auto = load_config(env={})
    fallback = doc._engine(auto, doc.Check("io_uring_setup", doc.FAIL, "denied", "allow it"))
    assert fallback.verdict == doc.WARN and "pread" in fallback.detail and fallback.fix

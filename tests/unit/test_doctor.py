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


def test_a_missing_store_fails_with_a_fix(tmp_path):
    checks = by_name(doc.doctor(load_config(env={}), str(tmp_path / "nothing")))
    assert checks["store"].verdict == doc.FAIL and checks["store"].fix
    assert checks["O_DIRECT"].verdict == doc.FAIL and "convert" in checks["O_DIRECT"].fix
    assert main(["doctor", str(tmp_path / "nothing")]) == 1


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

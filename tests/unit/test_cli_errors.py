"""How the `flashmoe` command answers a mistake: one line on stderr and a non-zero exit, never a
traceback unless --debug asks for it. The commands are real (run in this process through
``main``); where no real input can make a command fail in an unexpected way, its function is
replaced by one that raises."""

from __future__ import annotations

import pytest

from flashmoe.cli.main import main
from flashmoe.cli import store as store_commands


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_a_users_mistake_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["verify", str(tmp_path / "nope")]) == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and err[0].startswith("flashmoe verify: error: ")
    assert "no such store folder" in err[0]


def test_a_bad_flag_is_one_line_naming_the_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--store", "x", "--prompt", "hi", "--max-new-tokens", "0"])
    assert exit_.value.code == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "--max-new-tokens" in err[0] and "at least 1" in err[0]
    assert "flashmoe generate --help" in err[0]


def broken(args):
    raise ZeroDivisionError("a bug\nover two lines")


def test_an_unexpected_error_is_one_line_with_its_type(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(store_commands, "cmd_verify", broken)
    assert main(["verify", str(tmp_path)]) == 1
    err = lines(capsys.readouterr().err)
    assert err == ["flashmoe verify: internal error: ZeroDivisionError: a bug over two lines "
                   "(--debug shows the traceback)"]


@pytest.mark.parametrize("argv", [["--debug", "verify", "X"], ["verify", "X", "--debug"]])
def test_debug_anywhere_shows_the_traceback(capsys, monkeypatch, tmp_path, argv):
    monkeypatch.setattr(store_commands, "cmd_verify", broken)
    assert main([str(tmp_path) if a == "X" else a for a in argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ZeroDivisionError" in err
    assert lines(err)[-1] == ("flashmoe verify: internal error: ZeroDivisionError: a bug over two "
                              "lines")


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch, tmp_path):
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(store_commands, "cmd_verify", interrupted)
    assert main(["verify", str(tmp_path)]) == 130
    assert lines(capsys.readouterr().err) == ["flashmoe verify: interrupted"]


@pytest.mark.parametrize("argv, says", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["--prompt="], "--prompt: must not be empty"),
    (["--set", "cache.policy=foo"], "cache.policy (from --set cache.policy=foo) = 'foo' is not "
                                    "allowed; choices: arc,"),
    (["--warmup", "{tmp}/none"], "no such folder"),
    (["--warmup", "{tmp}"], "not a warm-up checkpoint for this model (2 MoE layers x 8 experts)"),
])
def test_generate_refuses_a_mistake_before_any_process_starts(capsys, tiny_store, tmp_path, argv,
                                                              says):
    """Every one of these used to start the cache manager and end in a traceback."""
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    try:
        rc = main(["generate", "--store", str(tiny_store), "--prompt", "hi",
                            "--home", str(tmp_path / "home"), *argv])
    except SystemExit as exc:  # argparse's own refusal
        rc = exc.code
    assert rc == 2
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and says in err[0], err
    assert not (tmp_path / "home").exists()  # nothing was started, no state made


@pytest.mark.parametrize("argv, says", [
    (["warmup", "--out", "{tmp}/w", "--text", "{tmp}/t.txt"],
     "flashmoe warmup: error: --text needs --store"),
    (["warmup", "--out", "{tmp}/w", "--passes", "-1"], "--passes: must be at least 0, got -1"),
    (["warmup", "--out", "{tmp}/w", "--max-tokens", "0"], "--max-tokens: must be at least 1"),
    (["trace-worker", "--cache", "ipc:///x", "--tokens", "0"], "--tokens: must be at least 1"),
    (["trace", "record", "--model", "m", "--prompts", "p", "--out", "o", "--max-new-tokens", "0"],
     "--max-new-tokens: must be at least 1"),
])
def test_the_learning_and_worker_commands_check_their_flags(capsys, tmp_path, argv, says):
    try:
        rc = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    err = lines(capsys.readouterr().err)
    assert rc == 2 and len(err) == 1 and says in err[0], err
    assert not (tmp_path / "w").exists()


def test_a_failure_that_is_no_mistake_is_one_line_and_exit_1(tmp_path):
    """A cache manager that does not answer: no traceback, and not called an internal error.
    (A process of its own: a service's loop takes the signals and the parent-death signal.)"""
    import subprocess

    from flashmoe.runtime.launch import child_env, cli_command

    proc = subprocess.run(cli_command("trace-worker", "--cache", f"ipc://{tmp_path}/none.sock",
                                      "--trace", "gptoss20b-sample:eval", "--tokens", "1",
                                      "--set", "ipc.handshake_timeout_s=0.1"),
                          env=child_env(), capture_output=True, text=True, timeout=120)
    rc = proc.returncode
    err = [line for line in lines(proc.stderr) if "flashmoe trace-worker:" in line]
    assert rc == 1 and "Traceback" not in proc.stderr
    assert len(err) == 1 and err[0].startswith("flashmoe trace-worker: error: no reply from the "
                                               "cache manager")


def test_a_path_that_cannot_be_written_is_a_users_mistake(capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    rc = main(["make-tiny-model", "qwen3_moe", str(tmp_path / "a-file" / "model")])
    err = lines(capsys.readouterr().err)
    assert rc == 2 and len(err) == 1
    assert err[0].startswith("flashmoe make-tiny-model: error: ") and "Not a directory" in err[0]

"""The service skeleton (common/service.py): a service's control socket answers health, stats
and tuning while its loop runs; a stop ends the loop; the hooks around it run in order, with
the error that ended it."""

import threading

import pytest

from common.bus import ServiceUnavailable, health, stats, tune
from common.config import load_config
from common.service import Service, ServiceFailed, State


class Demo(Service):
    name = "demo"

    def __init__(self, control_endpoint, fail_after_ticks=None):
        super().__init__(load_config(env={}), control_endpoint)
        self.fail_after_ticks = fail_after_ticks
        self.events = []
        self.ticks = 0

    def on_tick(self, now):
        self.ticks += 1
        if self.fail_after_ticks is not None and self.ticks > self.fail_after_ticks:
            raise ServiceFailed("demo cannot go on")

    def tune(self, changes, check):
        return [key for key in changes if key == "prefetch.threshold"], {}

    def on_exit(self, error):
        self.events.append(("exit", error))

    def close_resources(self):
        self.events.append(("close_resources", self.ctx.closed))


def run_in_thread(service):
    errors = []

    def target():
        try:
            service.run()
        except Exception as exc:  # what run_service_process turns into the exit status
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


def test_control_socket_answers_while_the_loop_runs_and_a_stop_ends_it(tmp_path):
    endpoint = f"ipc://{tmp_path}/demo.control.sock"
    service = Demo(endpoint)
    thread, errors = run_in_thread(service)
    rep = health(endpoint)
    assert (rep.service, rep.state) == ("demo", "running")
    assert stats(endpoint)["state"] == "running"
    rep = tune(endpoint, {"prefetch.threshold": 0.6, "cache.policy": "lru"})
    assert rep.supported and rep.applied == ["prefetch.threshold"]
    assert service.config.prefetch.threshold == 0.6
    service.request_stop()
    thread.join(10)
    assert not thread.is_alive() and errors == []
    assert service.state is State.STOP_REQUESTED
    assert service.events == [("exit", None), ("close_resources", True)]  # after the context
    with pytest.raises(ServiceUnavailable):
        health(endpoint, timeout_s=0.5)


def test_a_failure_reaches_on_exit_and_ends_the_run(tmp_path):
    service = Demo(None, fail_after_ticks=2)  # no control endpoint: no control socket
    thread, errors = run_in_thread(service)
    thread.join(10)
    assert service.control is None
    [error] = errors
    assert isinstance(error, ServiceFailed) and error.exit_code == 1
    assert service.events == [("exit", error), ("close_resources", True)]


# --- signals during set-up (a real process each) ------------------------------------------

CHILD = r"""
import sys, time
from pathlib import Path
from common.config import load_config
from common.service import Service, run_service_process

out, where = Path(sys.argv[1]), sys.argv[2]

class Slow(Service):
    name = "slow"

    def __init__(self):
        super().__init__(load_config(env={}), None)
        if where == "make":
            try:
                print("building", flush=True)
                time.sleep(120)
            except BaseException:
                (out / "cleaned").write_text("yes")
                raise

    def serve(self):
        with self.interruptible():
            print("waiting", flush=True)
            time.sleep(120)

    def close_resources(self):
        (out / "closed").write_text("yes")

def make():
    (out / "made").write_text("yes")
    return Slow()

sys.exit(run_service_process(make, "slow"))
"""


def start_child(tmp_path, where, env=None):
    import os
    import subprocess
    import sys

    from flashmoe.runtime.launch import child_env

    return subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), where],
                            env={**child_env(), **(env or {})}, stdout=subprocess.PIPE,
                            text=True, cwd=os.getcwd())


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_while_a_service_is_built_runs_its_clean_up_and_ends_it(tmp_path, sig):
    import signal

    proc = start_child(tmp_path, "make")
    assert proc.stdout.readline().strip() == "building"
    proc.send_signal(getattr(signal, sig))
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "cleaned").exists()


def test_a_signal_in_an_interruptible_wait_ends_it_and_closes_the_service(tmp_path):
    import signal

    proc = start_child(tmp_path, "serve")
    assert proc.stdout.readline().strip() == "waiting"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "closed").exists()


def test_a_child_whose_launcher_is_already_gone_exits_before_building(tmp_path):
    from common.service import PARENT_PID_ENV

    # a parent pid that is not this child's: as if the launcher died before it was armed
    proc = start_child(tmp_path, "make", env={PARENT_PID_ENV: "1"})
    assert proc.wait(timeout=60) == 0
    assert not (tmp_path / "made").exists()

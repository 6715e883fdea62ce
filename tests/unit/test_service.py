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

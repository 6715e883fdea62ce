"""The cache manager against hostile and unlucky workers, as a real process over real ipc
sockets: requests that do not fit the model, a model of another shape, a frozen worker, a
second instance on the same endpoint, its arena removed, failed reads. Every one gets a typed
answer and the manager goes on (or, for the arena, exits for its supervisor to restart it)."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from common.arena import SHM_DIR
from common.bus import health
from common.cache_client import (CacheClient, CacheManagerUnavailable, ExpertLoadError,
                                 PinsLost, RequestRefused, ShapeMismatch)
from common.protocol import AcquireError, AcquireReq, CacheToWorker, Decoder, Hello, encode
from flashmoe.runtime.launch import start_cache_manager, stop_process
from services.cache_manager.io_engine import DEFAULT_DRAIN_TIMEOUT_S
from services.cache_manager.loads import CLOSE_DRAIN_S, EXIT_ENGINE_FAILED
from services.cache_manager.process import EXIT_ARENA_LOST
from tests.support.stores import flip_byte
from tests.support.uring import uring_available

URING_OK, URING_WHY = uring_available()
ROOT = Path(__file__).resolve().parents[2]


def raw_request(endpoint: str, message, wait_ms: int = 5000):
    """Hello, then ``message`` from a bare DEALER; the decoded reply (None: none came)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    decoder = Decoder(CacheToWorker, max_bytes=1 << 20)
    try:
        sock.send(encode(Hello("hostile", os.getpid(), {})))
        assert sock.poll(wait_ms), "no Ready"
        decoder.decode(sock.recv())
        sock.send(encode(message))
        return decoder.decode(sock.recv()) if sock.poll(wait_ms) else None
    finally:
        sock.close(0)
        ctx.term()


def test_out_of_range_expert_gets_a_typed_error_and_the_manager_lives(tiny_store,
                                                                      start_manager):
    """What ../shared/checks/hardening sends: a bare peer's expert 10,000 of a layer of 8."""
    manager = start_manager(tiny_store)
    reply = raw_request(manager.endpoint, AcquireReq(1, 0, [10_000]))
    assert isinstance(reply, AcquireError) and reply.code == "unknown_expert"
    assert reply.experts == [10_000] and reply.seq == 1
    with CacheClient(manager.endpoint) as client:
        assert len(client.acquire(0, [1, 2])) == 2
        stats = client.stats()
    assert manager.proc.poll() is None
    assert stats["refused_unknown_expert"] == 1 and stats["n_hit"] + stats["n_miss"] == 2


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_requests_that_do_not_fit_the_model_are_refused_by_code(scope, tiny_store,
                                                                start_manager):
    """In both scopes (layer scope has one policy per layer: an unknown layer has none)."""
    manager = start_manager(tiny_store, f"cache.scope={scope}", "prefetch.budget=4")
    with CacheClient(manager.endpoint) as client:
        for layer, experts, code in [(7, [0], "unknown_layer"), (7, [], "unknown_layer"),
                                     (0, [8], "unknown_expert"), (1, [2, 2], "duplicate_expert"),
                                     (0, list(range(9)), "too_many_experts")]:
            with pytest.raises(ExpertLoadError) as info:
                client.acquire(layer, experts)
            assert info.value.code == code, (layer, experts)
        with pytest.raises(ExpertLoadError) as info:
            client.acquire(0, [1], release_layers=[5])
        assert info.value.code == "unknown_layer"
        with pytest.raises(ExpertLoadError) as info:  # one router weight for two experts
            client.acquire(0, [1, 2], weights=[1.0])
        assert info.value.code == "bad_weights"
        with pytest.raises(RequestRefused) as refused:
            client.release([9])
        assert refused.value.code == "unknown_layer"
        client.prefetch(0, [99])  # no reply: dropped and counted
        client.prefetch(4, [1])
        assert client.acquire(1, [3, 4]) and not client.lost()  # still usable
        stats = client.stats()
    assert manager.proc.poll() is None
    assert stats["refused_unknown_layer"] == 4 + 1
    assert stats["refused_unknown_expert"] == 2
    assert stats["refused_duplicate_expert"] == stats["refused_too_many_experts"] == 1
    assert stats["refused_bad_weights"] == 1
    assert stats["n_miss"] == 2 and stats["prefetch_issued"] == 0 and stats["pinned"] == 2


def test_handshake_compares_the_model_shape(tiny_store, start_manager):
    manager = start_manager(tiny_store)
    with CacheClient(manager.endpoint, shape={"layers": 2, "experts": 8, "top_k": 2,
                                              "expert_bytes": 0}) as client:
        assert client.acquire(0, [1])
    with pytest.raises(ShapeMismatch) as info:
        CacheClient(manager.endpoint, shape={"layers": 2, "experts": 128, "top_k": 2})
    text = str(info.value)
    assert "'experts': 128" in text and "'experts': 8" in text  # both shapes named
    assert manager.stats()["refused_shape_mismatch"] == 1


FROZEN_WORKER = textwrap.dedent("""
    import sys
    from common.cache_client import CacheClient
    client = CacheClient(sys.argv[1], name="frozen")
    client.acquire(0, [0, 1])
    print("ready", flush=True)
    sys.stdin.readline()
    lost = client.lost()
    try:
        client.acquire(1, [2, 3])
        print("acquired", lost, flush=True)
    except Exception as exc:
        print(type(exc).__name__, lost, flush=True)
    client.close()
""")


def test_frozen_worker_is_told_its_pins_are_lost(tiny_store, start_manager):
    """SIGSTOP past the heartbeat timeout, its slots given to other experts, then SIGCONT:
    ``lost()`` says so at once, with no round trip, and the worker's next request raises
    PinsLost."""
    manager = start_manager(tiny_store, "ipc.heartbeat_interval_s=0.1",
                            "ipc.heartbeat_timeout_s=0.5", "cache.capacity_experts=4")
    worker = subprocess.Popen([sys.executable, "-c", FROZEN_WORKER, manager.endpoint],
                              cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert worker.stdout.readline().strip() == "ready"
        assert manager.stats()["pinned"] == 2
        worker.send_signal(signal.SIGSTOP)
        manager.wait_for(lambda s: s["workers_gone"] == 1 and s["pinned"] == 0,
                         what="the frozen worker dropped")
        with CacheClient(manager.endpoint) as other:  # 4 new experts in 4 slots: all reused
            other.acquire(1, [4, 5, 6, 7])
        worker.send_signal(signal.SIGCONT)
        worker.stdin.write("go\n")
        worker.stdin.flush()
        outcome = worker.stdout.readline().split()
        assert worker.wait(60) == 0
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.kill()
        worker.wait()
    assert outcome == [PinsLost.__name__, "True"], outcome
    assert manager.proc.poll() is None


def test_a_dropped_worker_that_comes_back_is_told_pins_lost(tiny_store, start_manager):
    """Its connection gone (as after missed heartbeats), a worker that reconnects with its
    routing id gets Rejected('pins_lost'), not 'unexpected'; a new Hello makes it a worker
    again."""
    from common.protocol import Ready, Rejected

    manager = start_manager(tiny_store)
    routing_id = b"w" + os.urandom(15)
    decoder = Decoder(CacheToWorker, max_bytes=1 << 20)
    ctx = zmq.Context()
    try:
        first = ctx.socket(zmq.DEALER)
        first.setsockopt(zmq.ROUTING_ID, routing_id)
        first.connect(manager.endpoint)
        first.send(encode(Hello("w", os.getpid(), {})))
        assert first.poll(10_000) and isinstance(decoder.decode(first.recv()), Ready)
        first.send(encode(AcquireReq(1, 0, [1, 2])))
        assert first.poll(10_000) and decoder.decode(first.recv()).seq == 1
        first.close(0)
        manager.wait_for(lambda s: s["workers_gone"] == 1 and s["pinned"] == 0,
                         what="the worker dropped")
        again = ctx.socket(zmq.DEALER)
        again.setsockopt(zmq.ROUTING_ID, routing_id)
        again.connect(manager.endpoint)
        again.send(encode(AcquireReq(2, 0, [1, 2])))
        assert again.poll(10_000)
        reply = decoder.decode(again.recv())
        assert isinstance(reply, Rejected) and reply.code == "pins_lost", reply
        again.send(encode(Hello("w", os.getpid(), {})))
        assert again.poll(10_000) and isinstance(decoder.decode(again.recv()), Ready)
        again.send(encode(AcquireReq(3, 0, [1, 2])))
        assert again.poll(10_000) and decoder.decode(again.recv()).seq == 3
        again.close(0)
    finally:
        ctx.destroy(linger=0)
    stats = manager.stats()
    assert stats["refused_pins_lost"] == 1 and stats["rejected_unexpected"] == 0


def test_second_manager_refuses_a_live_endpoint_and_takes_a_stale_one(tiny_store, tmp_path,
                                                                      start_manager):
    """The live one keeps its endpoint; the second exits naming it."""
    first = start_manager(tiny_store)
    with CacheClient(first.endpoint):
        pass
    log = tmp_path / "second.log"
    with open(log, "w") as out:
        second = start_cache_manager(tiny_store, first.endpoint, log_file=out,
                                     control_endpoint=f"ipc://{tmp_path}/second.control.sock")
        try:
            rc = second.wait(60)
        finally:
            stop_process(second)
    assert rc != 0 and "another process is listening" in log.read_text()
    assert first.endpoint[len("ipc://"):] in log.read_text()
    with CacheClient(first.endpoint) as client:  # the first one still has it
        assert client.stats()["pid"] == first.proc.pid
    # A socket file nobody listens on (a dead process's) is taken over.
    stale = tmp_path / "stale.sock"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.bind(str(stale))
    probe.close()
    with open(tmp_path / "third.log", "w") as out:
        third = start_cache_manager(tiny_store, f"ipc://{stale}", log_file=out)
        try:
            with CacheClient(f"ipc://{stale}") as client:
                assert client.acquire(0, [1])
        finally:
            assert stop_process(third) == 0


def test_removed_arena_makes_the_manager_exit_for_a_restart(tiny_store, start_manager):
    """Health says failed and the process exits with its own status (no worker could
    attach to an arena whose file is gone)."""
    manager = start_manager(tiny_store)
    with CacheClient(manager.endpoint) as client:
        arena = SHM_DIR / client.ready.arena_name
    assert health(manager.control).state == "running"
    arena.unlink()
    try:
        state = health(manager.control).state
    except Exception:  # it may be gone already
        state = "failed"
    assert state == "failed"
    assert manager.proc.wait(30) == EXIT_ARENA_LOST
    assert "removed" in manager.log()


_OTHER_SHM_CHILD = """
import sys
from common.cache_client import ArenaUnreachable, CacheClient
try:
    CacheClient(sys.argv[1])
except ArenaUnreachable as exc:
    print("unreachable:", exc)
    sys.exit(0)
sys.exit(1)
"""


def test_a_worker_with_another_dev_shm_is_told_the_arena_is_unreachable(tiny_store,
                                                                          start_manager):
    """A container joined to the IPC namespace of a cache manager that restarted since keeps
    the old /dev/shm: the handshake works (the sockets are files of a shared volume) but the
    new arena is not there. Here a child in a mount namespace of its own with a fresh tmpfs on
    /dev/shm: it gets ArenaUnreachable, which ends a serving worker for a restart."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private /dev/shm")
    manager = start_manager(tiny_store)
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"', sys.executable, "-c",
         _OTHER_SHM_CHILD, manager.endpoint],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is not in this process's /dev/shm" in result.stdout
    with CacheClient(manager.endpoint):  # the manager itself goes on
        pass


@pytest.mark.parametrize("engine", ["pread", "uring"])
def test_a_transient_eio_is_read_again_and_costs_no_request(engine, tiny_store, start_manager):
    """eio:3 fails every third read: each failed read is retried once, and the retry (the
    next read) succeeds, so every acquire is answered with its expert."""
    if engine == "uring" and not URING_OK:
        pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
    manager = start_manager(tiny_store, f"io.engine={engine}", env={"FMIO_FAULT": "eio:3"})
    with CacheClient(manager.endpoint) as client:
        for expert in range(8):
            assert client.acquire(0, [expert])
        stats = client.stats()
    assert stats["n_io_error"] >= 2 and stats["n_read_retry"] == stats["n_io_error"]
    assert stats["resident"] == 8 and stats["bad_experts"] == 0
    assert manager.proc.poll() is None


@pytest.mark.parametrize("engine", ["pread", "uring"])
def test_eio_that_persists_costs_the_request_and_a_later_acquire_reads_again(engine, tiny_store,
                                                                              start_manager):
    """eio:1 fails every read: a load fails after its retry, its request gets io_error, the
    manager lives on, and the next acquire of that expert reads it again (and again fails)."""
    if engine == "uring" and not URING_OK:
        pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
    manager = start_manager(tiny_store, f"io.engine={engine}", env={"FMIO_FAULT": "eio:1"})
    with CacheClient(manager.endpoint) as client:
        for _ in range(2):
            with pytest.raises(ExpertLoadError) as info:
                client.acquire(0, [5])
            assert info.value.code == "io_error" and info.value.experts == [5]
        stats = client.stats()
    assert stats["n_io_error"] == 4 and stats["n_read_retry"] == 2
    assert stats["resident"] == 0 and manager.proc.poll() is None
    assert "Input/output error" in manager.log() and "stripe_" in manager.log()


def test_a_bad_block_is_reported_once_with_its_place(store_copy, start_manager):
    flip_byte(store_copy, 1, 3, block_index=0)
    manager = start_manager(store_copy)
    with CacheClient(manager.endpoint) as client:
        for _ in range(4):
            with pytest.raises(ExpertLoadError) as info:
                client.acquire(1, [3])
            assert info.value.code == "checksum"
        assert client.acquire(1, [2])
        client.prefetch(1, [3, 4])  # the bad expert is not prefetched, the good one is
        stats = client.stats()
    # each acquire reads the expert twice (the retry) before its request gets the error
    assert stats["n_checksum_error"] == 8 and stats["n_read_retry"] == 4
    assert stats["bad_experts"] == 1 and stats["prefetch_bad_skipped"] == 1
    reports = [line for line in manager.log().splitlines() if "layer 1 expert 3" in line]
    assert len(reports) == 1, reports
    assert "stripe_" in reports[0] and "offset" in reports[0]


def test_failed_set_up_leaves_no_arena(tiny_store, tmp_path):
    """An ipc path over the 107 characters AF_UNIX allows fails the bind after the arena and
    the IO engine were made: the arena goes too."""
    from common.config import load_config
    from services.cache_manager.process import CacheManager

    config = load_config(env={}, overrides=[f"store.path={tiny_store}"])
    mine = f"flashmoe-{os.getpid()}-"
    before = {p.name for p in SHM_DIR.iterdir() if p.name.startswith(mine)}
    long_dir = tmp_path / ("d" * 120)
    with pytest.raises(zmq.ZMQError):
        CacheManager(config, f"ipc://{long_dir}/cache.sock", f"ipc://{tmp_path}/c.sock")
    assert {p.name for p in SHM_DIR.iterdir() if p.name.startswith(mine)} == before


def test_lost_is_false_while_pins_hold_and_through_failed_acquires(store_copy, start_manager):
    """No false alarm: slots reloaded after this client let them go (a release, a new
    acquire of the layer, a failed load) do not count; its pinned slots never are."""
    flip_byte(store_copy, 1, 3, block_index=0)
    manager = start_manager(store_copy, "cache.capacity_experts=4")

    def churn(other):  # the two slots this client does not pin are reloaded again and again
        for expert in (4, 5, 6, 7):
            other.acquire(1, [expert])

    with CacheClient(manager.endpoint) as client, CacheClient(manager.endpoint) as other:
        client.acquire(0, [0, 1])
        churn(other)
        assert not client.lost()
        client.acquire(0, [2], release_layers=[0])
        client.release()
        churn(other)
        assert not client.lost()
        client.acquire(0, [0])
        with pytest.raises(ExpertLoadError):  # (1, 3) fails its checksum
            client.acquire(1, [3])
        churn(other)
        with pytest.raises(RequestRefused):
            client.release([9])
        assert not client.lost()
        assert client.acquire(0, [1], release_layers=[1]) and not client.lost()


def test_interrupted_set_up_leaves_no_arena(tiny_store, tmp_path, monkeypatch):
    """A signal that raises during set-up (common/service.py makes SIGTERM do so then) after
    the arena and the IO engine were made: both go (BaseException, not only Exception)."""
    from common.config import load_config
    from services.cache_manager import process

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(process, "make_socket", interrupted)
    config = load_config(env={}, overrides=[f"store.path={tiny_store}"])
    mine = f"flashmoe-{os.getpid()}-"
    before = {p.name for p in SHM_DIR.iterdir() if p.name.startswith(mine)}
    with pytest.raises(KeyboardInterrupt):
        process.CacheManager(config, f"ipc://{tmp_path}/cache.sock", f"ipc://{tmp_path}/c.sock")
    assert {p.name for p in SHM_DIR.iterdir() if p.name.startswith(mine)} == before


@pytest.mark.parametrize("engine", ["pread", "uring"])
def test_a_stuck_read_ends_the_manager_within_its_bounds_not_two_drains(engine, tiny_store,
                                                                       start_manager):
    """Every completion held back 60 s, io.read_timeout_s=1: the request gets io_timeout at
    once (answered before the drain), the failed engine's drain waits one read timeout and
    the close after it ``CLOSE_DRAIN_S``, so the manager exits for its restart in a few
    seconds, not after two full drains (2 x DEFAULT_DRAIN_TIMEOUT_S)."""
    if engine == "uring" and not URING_OK:
        pytest.skip(f"io_uring helper unavailable: {URING_WHY}")
    manager = start_manager(tiny_store, f"io.engine={engine}", "io.read_timeout_s=1",
                            env={"FMIO_FAULT": "delay:60000"})
    with CacheClient(manager.endpoint) as client:
        asked = time.monotonic()
        with pytest.raises((ExpertLoadError, CacheManagerUnavailable)) as info:
            client.acquire(0, [1])
        answered = time.monotonic() - asked
    if isinstance(info.value, ExpertLoadError):
        assert info.value.code == "io_timeout"
    rc = manager.proc.wait(2 * DEFAULT_DRAIN_TIMEOUT_S + 30)
    exited = time.monotonic() - asked
    assert rc == EXIT_ENGINE_FAILED
    bound = 1 + 1 + CLOSE_DRAIN_S  # the read timeout, the drain, the close
    assert answered < bound + 3, answered
    assert exited < bound + 6 < 2 * DEFAULT_DRAIN_TIMEOUT_S, exited

"""The concurrent hot path, live: layer pins, worker lifetime, parked requests, prefetch, IO
faults, the handshake and the control socket. Real processes, real sockets, real reads."""

import multiprocessing as mp
import os
import signal
import time

import pytest
import zmq

from common.bus import ConfigMismatch, health
from common.cache_client import CacheClient, CacheManagerUnavailable, ExpertLoadError
from common.config import load_config
from common.protocol import (AcquireRep, AcquireReq, CacheToWorker, Decoder, Hello, Ready,
                             encode)
from services.cache_manager.process import EXIT_ENGINE_FAILED

ALL = [(0, e) for e in range(8)] + [(1, e) for e in range(8)]


def hold_pins_then_wait(endpoint, layers, ready, overrides=()):
    """A worker that pins two experts of each layer in ``layers`` and then just waits."""
    config = load_config(env={}, overrides=list(overrides)) if overrides else None
    client = CacheClient(endpoint, config, name="holder")
    for layer in layers:
        client.acquire(layer, [0, 1])
    ready.set()
    time.sleep(600)


def start_holder(endpoint, layers, *overrides):
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=hold_pins_then_wait, args=(endpoint, layers, ready, overrides),
                       daemon=True)
    proc.start()
    assert ready.wait(60), "the holder worker did not start"
    return proc


def test_a_killed_worker_loses_its_pins_and_leaves_the_workers(tiny_store, start_manager):
    manager = start_manager(tiny_store, "cache.capacity_experts=4")
    holder = start_holder(manager.endpoint, [0, 1])
    assert manager.stats()["pinned"] == 4  # every slot: two layers of one worker
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    stats = manager.wait_for(lambda s: s["workers"] == 0, what="the dead worker to leave")
    assert stats["pinned"] == 0 and stats["workers_gone"] == 1
    with CacheClient(manager.endpoint, name="newcomer") as client:
        slots = client.acquire(0, [4, 5]) + client.acquire(1, [4, 5])  # holds all four
        assert sorted(slots) == [0, 1, 2, 3]
        assert client.stats()["workers"] == 1


def test_a_stopped_worker_misses_heartbeats_and_loses_its_pins(tiny_store, start_manager):
    settings = ("cache.capacity_experts=4", "ipc.heartbeat_interval_s=0.2",
                "ipc.heartbeat_timeout_s=1")
    manager = start_manager(tiny_store, *settings)
    holder = start_holder(manager.endpoint, [0, 1], f"store.path={tiny_store}", *settings)
    try:
        os.kill(holder.pid, signal.SIGSTOP)  # alive, but answers no heartbeat
        stats = manager.wait_for(lambda s: s["workers"] == 0, timeout_s=30,
                                 what="the silent worker to be declared dead")
        assert stats["pinned"] == 0
        with CacheClient(manager.endpoint, name="newcomer") as client:
            assert sorted(client.acquire(0, [4, 5]) + client.acquire(1, [4, 5])) == [0, 1, 2, 3]
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(10)


def test_one_worker_holds_two_layers_and_releases_them_piggybacked(tiny_store, start_manager):
    manager = start_manager(tiny_store, "cache.capacity_experts=6")
    with CacheClient(manager.endpoint) as client:
        client.acquire(0, [0, 1])
        client.acquire(1, [2, 3])  # layer 0 is still pinned while layer 1 is acquired
        assert client.stats()["pinned"] == 4
        client.acquire(0, [4], release_layers=[1])  # replaces layer 0, drops layer 1
        assert client.stats()["pinned"] == 1
        client.release()
        assert client.stats()["pinned"] == 0


class RawWorker:
    """A worker on a bare DEALER so that a test can send without waiting."""

    def __init__(self, endpoint):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.decoder = Decoder(CacheToWorker)
        self.sock.send(encode(Hello("raw", os.getpid(), {})))
        assert isinstance(self.receive(30), Ready)

    def send(self, message):
        self.sock.send(encode(message))

    def receive(self, timeout_s):
        if not self.sock.poll(int(timeout_s * 1000)):
            return None
        return self.decoder.decode(self.sock.recv())

    def close(self):
        self.sock.close(0)
        self.ctx.term()


def test_a_miss_is_parked_while_other_workers_hits_are_answered(tiny_store, start_manager):
    # Every read is held back 2 s by the engine's test-only fault hook.
    manager = start_manager(tiny_store, "io.read_timeout_s=30", env={"FMIO_FAULT": "delay:2000"})
    with CacheClient(manager.endpoint, name="hitter") as hitter:
        hitter.acquire(0, [0, 1])  # loaded once (slowly); every later acquire is a hit
        slow = RawWorker(manager.endpoint)
        try:
            slow.send(AcquireReq(1, 1, [5, 6]))
            answered = 0
            while slow.sock.poll(0) == 0 and answered < 20:
                hitter.acquire(0, [0, 1])
                answered += 1
            assert answered == 20, "hits waited behind another worker's miss"
            reply = slow.receive(30)
            assert isinstance(reply, AcquireRep) and reply.seq == 1 and len(reply.slots) == 2
        finally:
            slow.close()
        stats = hitter.stats()
    assert stats["n_hit"] >= 40 and stats["n_load"] == 4


def test_a_second_request_for_a_loading_expert_waits_on_the_same_read(tiny_store,
                                                                      start_manager):
    manager = start_manager(tiny_store, "io.read_timeout_s=30", env={"FMIO_FAULT": "delay:1500"})
    first, second = RawWorker(manager.endpoint), RawWorker(manager.endpoint)
    try:
        first.send(AcquireReq(1, 0, [3]))
        time.sleep(0.3)  # the read is in flight
        second.send(AcquireReq(1, 0, [3, 4]))
        a, b = first.receive(30), second.receive(30)
        assert isinstance(a, AcquireRep) and isinstance(b, AcquireRep)
        assert a.slots[0] == b.slots[0]
    finally:
        first.close()
        second.close()
    stats = manager.stats()
    assert stats["n_load"] == 2 and stats["n_hit_loading"] == 1 and stats["n_miss"] == 3


def test_prefetch_hints_load_ahead_and_are_counted(tiny_store, start_manager):
    manager = start_manager(tiny_store, "prefetch.budget=4")
    with CacheClient(manager.endpoint) as client:
        client.prefetch(1, [6, 7])
        manager.wait_for(lambda s: s["prefetch_issued"] == 2 and s["loading"] == 0,
                         what="the prefetches to land")
        client.acquire(1, [6, 7, 5])
        stats = client.stats()
    assert stats["n_hit"] == 2 and stats["n_miss"] == 1 and stats["prefetch_used"] == 2
    assert stats["prefetch_bytes"] == stats["prefetch_used_bytes"] > 0


def test_a_read_past_the_timeout_fails_the_request_and_the_manager_exits(tiny_store,
                                                                        start_manager):
    manager = start_manager(tiny_store, "io.read_timeout_s=0.5",
                            env={"FMIO_FAULT": "delay:60000"})
    client = CacheClient(manager.endpoint)
    started = time.monotonic()
    try:
        with pytest.raises((ExpertLoadError, CacheManagerUnavailable)) as info:
            client.acquire(0, [0, 1])
        if isinstance(info.value, ExpertLoadError):
            assert info.value.code == "io_timeout"
            with pytest.raises(CacheManagerUnavailable):  # then Dead
                client.acquire(0, [2])
    finally:
        client.close()
    assert manager.proc.wait(30) == EXIT_ENGINE_FAILED
    assert time.monotonic() - started < 30
    assert "io.read_timeout_s" in manager.log()


def test_a_config_mismatch_names_the_section(tiny_store, start_manager):
    manager = start_manager(tiny_store)
    differs = load_config(env={}, overrides=[f"store.path={tiny_store}",
                                             "store.block_size=128K"])
    with pytest.raises(ConfigMismatch, match="store"):
        CacheClient(manager.endpoint, differs)
    same = load_config(env={}, overrides=[f"store.path={tiny_store}", "cache.policy=arc",
                                          "io.queue_depth=3"])  # live or not shared: fine
    with CacheClient(manager.endpoint, same) as client:
        assert client.acquire(0, [1]) and client.stats()["rejected_config_mismatch"] == 1


def test_health_checks_use_the_control_socket_and_are_not_workers(tiny_store, start_manager):
    manager = start_manager(tiny_store)
    manager.wait_for(lambda s: s["state"] == "running")
    for _ in range(3):
        rep = health(manager.control)
        assert rep.service == "cache_manager" and rep.state == "running"
        assert rep.pid == manager.proc.pid
    assert manager.stats()["workers"] == 0

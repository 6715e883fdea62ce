"""Cluster sharing through a real ``redis-server`` (started here on a free port, stopped
always): two devices exchange features and one warm-starts from the other; TTLs; the size
cap; garbage rejected and counted; Redis killed, slow or behind a password; and a live
`flashmoe run --redis` that keeps serving while Redis is down and reconnects when it is back.
Skipped, with the reason, only where the ``redis-server`` binary is missing (scripts/setup.sh
installs it)."""

import json
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import redis

from common.cluster import (
    PARTS,
    ClusterAgent,
    ClusterLink,
    ModelShape,
    extractor_values,
    key,
    manifest_identity,
    merge,
    model_fingerprint,
    predictor_values,
)
from common.config import load_config
from flashmoe.bench.local import RedisServer
from flashmoe.sim.learning import Learning, cluster_shape
from services.feature_extractor.sharing import apply_to_extractor, extractor_patterns
from services.predictor.sharing import learner_patterns, write_predictor_checkpoint

REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None,
                                reason="redis-server is not installed (scripts/setup.sh "
                                       "installs it)")
L, E, K = 3, 8, 2
FINGERPRINT = model_fingerprint({"test": "three layers of eight experts"})


@pytest.fixture
def server():
    srv = RedisServer().start()
    yield srv
    srv.stop(kill=True)


def cluster_config(url: str, device: str, *overrides: str):
    return load_config(env={}, overrides=[
        "features.pca_components=8", "predictor.model=lstm", "predictor.lstm_hidden=32",
        f"cluster.redis_url={url}",
        f"cluster.device_id={device}", "cluster.timeout_s=0.3", "cluster.backoff_max_s=0.5",
        "cluster.publish_every_s=0.1", *overrides])


def device(url: str, name: str, seed: int, tokens: int, *overrides: str):
    """A device: its config, link and a learning path fed ``tokens`` random tokens."""
    config = cluster_config(url, name, *overrides)
    rng = np.random.default_rng(seed)
    learning = Learning.create(L, E, K, config)
    p = np.arange(E, 0, -1, dtype=float) ** (1 + seed)
    for t in range(tokens):
        experts = np.stack([rng.choice(E, K, replace=False, p=p / p.sum()) for _ in range(L)])
        learning.extractor.on_event(0, t, f"w{t % 5}", f"w{(t + 1) % 5}", experts, None)
    return config, ClusterLink(config.cluster, FINGERPRINT), learning


def values_of(learning: Learning, name: str) -> dict:
    patterns = extractor_patterns(learning.extractor, name)
    weights, meta = learner_patterns(learning.learner)
    return {**extractor_values(patterns, time.time_ns()),
            **predictor_values(name, meta["tokens"], weights, meta, time.time_ns())}


def shape_of(config) -> ModelShape:
    return cluster_shape(L, E, config)


def wait_until(condition, timeout_s: float = 10.0, what: str = ""):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_two_devices_exchange_and_a_warm_start_merges_the_peer(server, tmp_path):
    config_a, link_a, a = device(server.url, "a", 0, 50)
    config_b, link_b, b = device(server.url, "b", 1, 150)
    assert link_a.publish(values_of(a, "a")) and link_b.publish(values_of(b, "b"))
    assert [p.device for p in link_a.fetch_peers(shape_of(config_a))] == ["b"]
    assert [p.device for p in link_b.fetch_peers(shape_of(config_b))] == ["a"]
    # A third device starts: both peers, weighted by tokens; b's predictor (more tokens).
    config_c, link_c, c = device(server.url, "c", 2, 0)
    warm = merge(link_c.fetch_peers(shape_of(config_c)))
    assert warm.peers == ["a", "b"] and warm.tokens == 200 and warm.source == "b"
    pop_a = extractor_patterns(a.extractor, "a").popularity
    pop_b = extractor_patterns(b.extractor, "b").popularity
    np.testing.assert_allclose(warm.popularity, 0.25 * pop_a + 0.75 * pop_b, rtol=1e-5)
    apply_to_extractor(c.extractor, warm)
    np.testing.assert_array_equal(c.extractor.features.transition_counts,
                                  a.extractor.features.transition_counts +
                                  b.extractor.features.transition_counts)
    np.testing.assert_array_equal(c.extractor.pca.basis, b.extractor.pca.basis)
    c.learner.load(write_predictor_checkpoint(warm, tmp_path / "from-peer"))
    for mine, theirs in zip(c.learner.net.parameters(), b.learner.net.parameters()):
        np.testing.assert_allclose(mine.detach().numpy(), theirs.detach().numpy(), atol=2e-3)
    assert link_c.status()["state"] == "connected" and link_c.status()["peers"] == 2


def test_every_key_has_the_ttl_and_other_models_are_not_peers(server):
    config, link, a = device(server.url, "a", 0, 20, "cluster.ttl_s=120")
    assert link.publish(values_of(a, "a"))
    client = server.client()
    for what in PARTS:
        assert 0 < client.ttl(key(FINGERPRINT, "a", what)) <= 120, what
    other = ClusterLink(cluster_config(server.url, "z").cluster, model_fingerprint({"x": 1}))
    assert other.fetch_peers(shape_of(config)) == []


def test_size_cap_refuses_a_big_publish_and_ignores_a_big_peer(server):
    config, link, a = device(server.url, "a", 0, 20, "cluster.max_bytes=64K")
    values = values_of(a, "a")
    assert sum(map(len, values.values())) > 64 * 1024  # the predictor's weights alone are
    assert not link.publish(values)
    assert link.status()["n_publish_refused"] == 1 and "max_bytes" in link.status()["reason"]
    assert server.client().keys("flashmoe:*") == []
    # A peer under a bigger cap publishes; a device capped at 64 KiB does not take it.
    _, big_link, big = device(server.url, "big", 1, 20)
    assert big_link.publish(values_of(big, "big"))
    assert link.fetch_peers(shape_of(config)) == []
    assert link.status()["n_garbage"] == 1 and "over cluster.max_bytes" in \
        link.status()["last_garbage"]


def test_garbage_is_rejected_counted_and_the_good_peer_still_merged(server):
    config, link, _ = device(server.url, "me", 0, 0)
    _, good_link, good = device(server.url, "good", 1, 30)
    assert good_link.publish(values_of(good, "good"))
    client = server.client()
    for what in PARTS:
        client.set(key(FINGERPRINT, "evil", what), b"\x00garbage" * 10, ex=60)
    tampered = values_of(good, "bent")
    tampered["transitions"] = tampered["transitions"][:-4] + b"\xff\xff\xff\x7f"
    for what, value in tampered.items():
        client.set(key(FINGERPRINT, "bent", what), value, ex=60)
    peers = link.fetch_peers(shape_of(config))
    assert [p.device for p in peers] == ["good"]
    status = link.status()
    assert status["n_garbage"] == 2 and status["state"] == "connected"
    assert "checksum" in status["last_garbage"] or "magic" in status["last_garbage"]


def test_redis_killed_mid_run_goes_alone_keeps_going_and_reconnects(server):
    _, link, a = device(server.url, "a", 0, 20)
    agent = ClusterAgent(link, lambda: values_of(a, "a"), "test").start()
    try:
        wait_until(lambda: link.status()["n_published"] >= 2, what="publishes")
        server.stop(kill=True)
        wait_until(lambda: link.status()["state"] == "alone", what="the alone state")
        status = link.status()
        assert "unreachable" in status["reason"] and status["last_ok"] is not None
        # A publish that fails costs one refused connection, then the back-off spaces the
        # retries (the live test below shows a run serving on meanwhile).
        errors = status["n_errors"]
        time.sleep(0.6)
        assert link.status()["n_errors"] - errors <= 3
        server.start()  # an empty Redis on the same port
        wait_until(lambda: link.status()["state"] == "connected", what="the reconnection")
        wait_until(lambda: server.client().exists(key(FINGERPRINT, "a", "popularity")),
                   what="the republish")
        assert link.status()["n_reconnects"] >= 1
    finally:
        agent.stop()


def test_a_slow_redis_is_a_timeout_then_recovered():
    srv = RedisServer("--enable-debug-command", "yes").start()
    try:
        _, link, a = device(srv.url, "a", 0, 20)
        assert link.publish(values_of(a, "a"))
        # DEBUG SLEEP holds the whole server, as a swapping or overloaded Redis would.
        blocker = threading.Thread(target=lambda: srv.client().execute_command(
            "DEBUG", "SLEEP", "1.5"))
        blocker.start()
        time.sleep(0.2)
        assert not link.publish(values_of(a, "a"))
        assert link.status()["state"] == "alone" and "did not answer within" in \
            link.status()["reason"]
        blocker.join()
        wait_until(link.ready, what="the back-off")
        assert link.publish(values_of(a, "a")) and link.status()["state"] == "connected"
    finally:
        srv.stop(kill=True)


def test_auth_right_password_works_and_a_wrong_one_is_a_clear_error(tmp_path):
    srv = RedisServer("--requirepass", "s3cret").start()
    try:
        secret = tmp_path / "password"
        secret.write_text("s3cret\n")
        config, link, a = device(srv.url, "a", 0, 20, f"cluster.password_file={secret}")
        assert link.publish(values_of(a, "a"))
        assert srv.client(password="s3cret").exists(key(FINGERPRINT, "a", "tokens"))
        _, wrong, _ = device(srv.url, "b", 0, 0, "cluster.password=nope")
        assert wrong.fetch_peers(shape_of(config)) == []
        status = wrong.status()
        assert status["state"] == "error" and "authentication refused" in status["reason"]
        _, missing, _ = device(srv.url, "c", 0, 0)
        missing.peer_devices()
        assert missing.status()["state"] == "error" and \
            "authentication refused" in missing.status()["reason"]
    finally:
        srv.stop(kill=True)


def test_tls_settings_reach_the_connection(tmp_path):
    """TLS is checked as far as the client here (no certificates are made for a TLS Redis):
    with ``cluster.tls`` the link must try a TLS handshake with the configured CA (and fail
    against this plain server, into the alone state) rather than talk in clear."""
    srv = RedisServer().start()
    try:
        ca = tmp_path / "ca.pem"
        ca.write_text("")
        _, link, _ = device(srv.url, "a", 0, 0, "cluster.tls=true",
                            f"cluster.tls_ca_file={ca}")
        pool = link._client().connection_pool
        assert pool.connection_class is redis.SSLConnection
        assert pool.connection_kwargs["ssl_ca_certs"] == str(ca)
        assert link.peer_devices() is None and link.status()["state"] == "alone"
    finally:
        srv.stop(kill=True)


# --- live: `flashmoe run --redis` --------------------------------------------------------------

@pytest.mark.traces
def test_flashmoe_run_shares_keeps_serving_without_redis_and_a_peer_warm_starts(server,
                                                                               tmp_path):
    from common.store import ExpertStore
    from common.traces import load_gptoss20b
    from flashmoe.runtime.launch import child_env, cli_command
    from flashmoe.sim.learning import warmup
    from flashmoe.tools.synth_store import synth_store
    from tests.support.run_output import RunOutput
    from tests.support.traces import sequences_slice

    store = synth_store(tmp_path / "store", "gpt-oss-tiny", scale=1.0, block_size=8192,
                        parallelism=2, show_progress=False).path
    ckpt = tmp_path / "warmup"
    warmup(sequences_slice(load_gptoss20b("train"), "train-slice", 0, 2), load_config(env={}),
           ckpt, passes=1)
    fingerprint = model_fingerprint(manifest_identity(ExpertStore.open(store).manifest))

    def start(name: str, *args: str):
        runtime = tmp_path / f"rt-{name}"
        runtime.mkdir()
        cmd = cli_command("run", "--store", str(store), "--warmup", str(ckpt), "--capacity",
                          "96", "--token-ms", "20", "--redis", server.url, "--json",
                          str(tmp_path / f"{name}.json"), "--set", f"ipc.runtime_dir={runtime}",
                          "--set", "panel.port=0", "--set", f"cluster.device_id={name}",
                          "--set", "cluster.publish_every_s=0.5", "--set",
                          "cluster.timeout_s=0.3", "--set", "cluster.backoff_max_s=1",
                          "--set", "predictor.checkpoint_every_s=1", *args)
        proc = subprocess.Popen(cmd, env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        return proc, RunOutput(proc)

    proc, out = start("a", "--loop")
    try:
        out.wait_for(r"cluster connected", timeout_s=120)
        client = server.client()
        wait_until(lambda: all(client.exists(key(fingerprint, "a", w)) for w in PARTS),
                   timeout_s=60, what="device a's keys")
        server.stop(kill=True)
        mark = len(out.lines)
        out.wait_for(r"cluster alone .*unreachable", after=mark, timeout_s=30)
        before = out.tokens()
        wait_until(lambda: out.tokens() > before + 5, timeout_s=60,
                   what="tokens served while Redis is down")
        assert proc.poll() is None
        server.start()
        mark = len(out.lines)
        out.wait_for(r"cluster connected", after=mark, timeout_s=30)
        client = server.client()
        wait_until(lambda: all(client.exists(key(fingerprint, "a", w)) for w in PARTS),
                   timeout_s=30, what="device a's keys after the reconnection")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, "\n".join(out.lines[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary_a = json.loads((tmp_path / "a.json").read_text())
    assert summary_a["cluster"]["predictor"]["n_reconnects"] >= 1
    # Device b starts while a's keys live: it warm-starts from a.
    proc, out = start("b", "--tokens", "30")
    try:
        assert proc.wait(timeout=180) == 0, "\n".join(out.lines[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    summary_b = json.loads((tmp_path / "b.json").read_text())
    warm = summary_b["cluster"]["predictor"]["warm_start"]
    assert warm["peers"] == ["a"] and warm["predictor_from"] == "a", summary_b["cluster"]
    assert summary_b["cluster"]["feature_extractor"]["warm_start"]["peers"] == ["a"]

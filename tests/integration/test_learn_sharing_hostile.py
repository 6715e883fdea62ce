"""Peers are untrusted: values in a real ``redis-server`` that pass the envelope but carry a
list where a number belongs, a NaN counter, a string generation, a negative token count, a
value of another Redis type, or more bytes than ``cluster.max_bytes`` are garbage
(``PayloadError``), counted, and the good peers are still merged; sizes are read before any
download; at most ``cluster.max_peers`` peers (the most recently published) are read; and a
feature extractor started beside a poisoned key serves on. Skipped, with the reason, only
where the ``redis-server`` binary is missing."""

import hashlib
import json
import shutil
import struct
import time

import numpy as np
import pytest
from safetensors.numpy import load as st_load

from common.bus import stats
from common.cluster import (
    MAGIC,
    PARTS,
    VERSION,
    encode_arrays,
    key,
    manifest_identity,
    merge,
    model_fingerprint,
)
from common.config import load_config
from common.store import ExpertStore
from flashmoe.bench.local import RedisServer
from flashmoe.runtime.launch import Launcher
from flashmoe.sim.learning import Learning
from services.feature_extractor.core import ExtractorCore
from services.feature_extractor.sharing import apply_to_extractor
from services.predictor.sharing import write_predictor_checkpoint
from tests.integration.test_redis_sharing import (
    E,
    FINGERPRINT,
    K,
    L,
    device,
    shape_of,
    values_of,
)

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (scripts/setup.sh "
                                       "installs it)")


@pytest.fixture
def server():
    srv = RedisServer().start()
    yield srv
    srv.stop(kill=True)


def envelope(kind: str, body: bytes, **header) -> bytes:
    """An envelope with a checksum that matches, and any header field set to anything."""
    fields = {"what": kind, "device": "evil", "generation": 1, "tokens": 30,
              "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest(), **header}
    text = json.dumps(fields).encode()
    return struct.pack("<4sHI", MAGIC, VERSION, len(text)) + text + body


def split(raw: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack_from("<I", raw, 6)
    return json.loads(raw[10:10 + length]), raw[10 + length:]


def rebody(raw: bytes, body: bytes | None = None, **header) -> bytes:
    """A published value with another body and some header fields replaced (the length and
    checksum made right)."""
    old, old_body = split(raw)
    body = old_body if body is None else body
    kept = {k: v for k, v in old.items() if k not in ("what", "bytes", "sha256")}
    return envelope(old["what"], body, **{**kept, **header})


def with_counters(raw: bytes, counters) -> bytes:
    arrays = st_load(split(raw)[1])
    arrays["counters"] = np.asarray(counters, np.float64)
    return rebody(raw, encode_arrays(arrays))


def with_steps(raw: bytes, steps) -> bytes:
    return rebody(raw, json.dumps({**json.loads(split(raw)[1]), "steps": steps}).encode())


def as_device(values: dict[str, bytes], name: str) -> dict[str, bytes]:
    return {what: rebody(raw, device=name) for what, raw in values.items()}


# One tampering per field a review found unchecked; each device is otherwise whole.
POISONS = {
    "list-tokens": ("tokens", lambda raw: rebody(raw, tokens=[30])),
    "bool-tokens": ("tokens", lambda raw: rebody(raw, tokens=True)),
    "string-generation": ("popularity", lambda raw: rebody(raw, generation="1")),
    "list-generation": ("popularity", lambda raw: rebody(raw, generation=[1])),
    "negative-body": ("tokens", lambda raw: rebody(raw, b"-5")),
    "nan-counter": ("pca", lambda raw: with_counters(raw, [float("nan"), 1.0, 0.5])),
    "negative-weight": ("pca", lambda raw: with_counters(raw, [3, -1.0, 0.5])),
    "string-steps": ("predictor.json", lambda raw: with_steps(raw, "many")),
    "list-what": ("transitions", lambda raw: rebody(raw, what=["transitions"])),
    "deep-json": ("predictor.json", lambda raw: rebody(raw, b"[" * 100_000 + b"]" * 100_000)),
}


def store(client, name: str, values: dict[str, bytes], fingerprint: str = FINGERPRINT,
          ttl: int = 600) -> None:
    for what, value in values.items():
        client.set(key(fingerprint, name, what), value, ex=ttl)


def test_hostile_fields_are_garbage_and_the_good_peer_is_merged(server, tmp_path):
    config, link, _ = device(server.url, "me", 0, 0, "cluster.max_peers=64")
    _, good_link, good = device(server.url, "good", 1, 30)
    assert good_link.publish(values_of(good, "good"))
    values = values_of(good, "good")
    client = server.client()
    for name, (what, tamper) in POISONS.items():
        evil = as_device(values, name)
        evil[what] = tamper(evil[what])
        store(client, name, evil)
    peers = link.fetch_peers(shape_of(config))  # no TypeError, ValueError or RecursionError
    assert [p.device for p in peers] == ["good"]
    status = link.status()
    assert status["n_garbage"] == len(POISONS) and status["state"] == "connected"
    warm = merge(peers)  # and what is taken in works
    core = ExtractorCore(L, E, K, 8)
    apply_to_extractor(core, warm)
    assert np.isfinite(core.features.long_run_freq).all()
    learning = Learning.create(L, E, K, config)
    assert learning.learner.load(write_predictor_checkpoint(warm, tmp_path / "w"))["L"] == L


def test_a_value_of_another_type_is_garbage_not_a_lost_connection(server):
    config, link, _ = device(server.url, "me", 0, 0)
    _, good_link, good = device(server.url, "good", 1, 30)
    assert good_link.publish(values_of(good, "good"))
    client = server.client()
    store(client, "typed", {w: v for w, v in as_device(values_of(good, "good"), "typed").items()
                            if w != "popularity"})
    client.rpush(key(FINGERPRINT, "typed", "popularity"), b"a", b"b")
    peers = link.fetch_peers(shape_of(config))
    assert [p.device for p in peers] == ["good"]
    status = link.status()
    assert status["state"] == "connected" and status["n_garbage"] == 1
    assert "not a string value" in status["last_garbage"]


def test_sizes_are_checked_before_anything_is_downloaded(server):
    config, link, _ = device(server.url, "me", 0, 0, "cluster.max_bytes=64K")
    client = server.client()
    huge = b"\0" * (8 << 20)  # 8 MiB of a peer over the 64 KiB cap
    client.set(key(FINGERPRINT, "huge", "tokens"), b"x", ex=60)
    client.set(key(FINGERPRINT, "huge", "predictor.safetensors"), huge, ex=60)
    sent_before = client.info("stats")["total_net_output_bytes"]
    assert link.fetch_peers(shape_of(config)) == []
    sent = client.info("stats")["total_net_output_bytes"] - sent_before
    assert sent < len(huge) // 8, f"{sent} bytes sent for a peer over the cap"
    assert link.status()["n_garbage"] == 1 and "over cluster.max_bytes" in \
        link.status()["last_garbage"]


def test_at_most_max_peers_are_read_the_most_recently_published(server):
    config, link, _ = device(server.url, "me", 0, 0, "cluster.max_peers=2")
    _, _, source = device(server.url, "source", 1, 30)
    values = values_of(source, "source")
    client = server.client()
    for name in ["old", "older", "newest", "newer"]:
        ttl = {"older": 100, "old": 200, "newer": 500, "newest": 600}[name]
        store(client, name, as_device(values, name), ttl=ttl)
    peers = link.fetch_peers(shape_of(config))
    assert sorted(p.device for p in peers) == ["newer", "newest"]
    status = link.status()
    assert status["peers"] == 2 and status["n_peers_skipped"] == 2
    assert load_config(env={}).cluster.max_peers == 16


def test_an_extractor_started_beside_a_poisoned_key_serves_on(server, tiny_store, tmp_path):
    """The review's case: a NaN PCA counter passed the envelope, the extractor died at
    start, and again at every restart while the key lived."""
    manifest = ExpertStore.open(tiny_store).manifest
    fingerprint = model_fingerprint(manifest_identity(manifest))
    layers, experts = len(manifest.moe_layers), manifest.num_experts
    config = load_config(env={}, overrides=[f"store.path={tiny_store}",
                                            f"cluster.redis_url={server.url}",
                                            "cluster.device_id=me", "cluster.timeout_s=2"])
    peer = Learning.create(layers, experts, manifest.top_k, config)
    rng = np.random.default_rng(0)
    for t in range(40):
        routing = np.stack([rng.choice(experts, manifest.top_k, replace=False)
                            for _ in range(layers)])
        peer.extractor.on_event(0, t, f"w{t % 5}", f"w{(t + 1) % 5}", routing, None)
    values = values_of(peer, "peer")
    client = server.client()
    bad = as_device(values, "poisoned")
    bad["pca"] = with_counters(bad["pca"], [float("nan"), 1.0, 0.5])
    store(client, "poisoned", bad, fingerprint)
    launcher = Launcher(config, tmp_path / "run")
    try:
        child = launcher.start("feature_extractor", [
            "serve-features", str(tiny_store), "--events", f"ipc://{tmp_path}/events.sock",
            "--set", f"cluster.redis_url={server.url}", "--set", "cluster.device_id=me"])
        current = stats(child.control_endpoint)
        assert current["state"] == "running" and current["cluster_n_garbage"] == 1
        assert "pca: counters" in current["cluster_last_garbage"]
        time.sleep(0.5)
        assert child.proc.poll() is None
    finally:
        assert launcher.stop_all() == {"feature_extractor": 0}
    assert set(PARTS) >= set(values)

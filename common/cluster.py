"""Cluster sharing through Redis: each device publishes what it learned about the routing, and
a device that starts merges its peers' as a warm start.

Keys (one value each, ``SET ... EX cluster.ttl_s``, a publish is one MULTI/EXEC)::

    flashmoe:<model fingerprint>:<device>:tokens                 tokens these features cover
    flashmoe:<model fingerprint>:<device>:popularity             (N,) use frequency per expert
    flashmoe:<model fingerprint>:<device>:transitions            (L, E, E) + (L, E) counts
    flashmoe:<model fingerprint>:<device>:pca                    the extractor's online PCA
    flashmoe:<model fingerprint>:<device>:predictor.safetensors  the predictor's weights (fp16)
    flashmoe:<model fingerprint>:<device>:predictor.json         its hyper-parameters

The feature extractor publishes the first four, the predictor the last two (``PARTS``). The
fingerprint hashes the store manifest's model identity (family, layers, experts, top-k, the
experts' tensor shapes and dtypes), never a path: two devices share keys only when their
features mean the same thing.

Each service owns what it shares (services/feature_extractor/sharing.py and
services/predictor/sharing.py): it makes this device's ``Patterns`` from its state, declares
the shapes of its arrays and takes a ``WarmStart`` in. This module carries the values, checks
them against the shapes it is handed (``ModelShape``, which the app composes from both
declarations: each process checks every part, so that all of a device's services take the
same peers) and merges them.

Every value is an envelope: ``MAGIC``, a version, a JSON header (what, device, generation,
tokens, body length, SHA-256 of the body) and the body (safetensors for arrays; never
pickle). Peers are untrusted: a read checks the sizes first (``STRLEN``, then a bounded
``GETRANGE``: at most ``cluster.max_bytes`` per device is downloaded), then magic, version,
checksum, every header field's type and range, every array's name, dtype and shape against
this device's model, and every number's finiteness and range; a value that fails is garbage
(``PayloadError``, nothing else): counted (``n_garbage``, the last reason kept) and its device
ignored. At most ``cluster.max_peers`` peers are read, the most recently published (the
longest TTL left); the others are counted (``n_peers_skipped``).

Warm start (``merge``): popularity and transitions weighted by each peer's token count (the
transition tables are counts, so their sum is that weighting); the PCA and the predictor's
weights of the one peer with the most tokens (the predictor was trained on that PCA's
projection, so the two travel together).

Failure: Redis down, slow (past ``cluster.timeout_s``) or refusing AUTH never stops a
device. ``ClusterLink`` turns every error into a state (``alone`` or ``error``, with the
reason and the last success) and a back-off (0.5 s doubling to ``cluster.backoff_max_s``)
before the next try; ``ClusterAgent`` runs the periodic publish on its own thread, taking
the service's data through a snapshot callable, so no service loop waits on Redis.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from common.config import ClusterConfig

log = logging.getLogger("flashmoe.cluster")

MAGIC = b"FMCL"
VERSION = 1
_PREAMBLE = struct.Struct("<4sHI")  # magic, version, header length
EXTRACTOR_PARTS = ("tokens", "popularity", "transitions", "pca")
PREDICTOR_PARTS = ("predictor.safetensors", "predictor.json")
PARTS = EXTRACTOR_PARTS + PREDICTOR_PARTS
BACKOFF_START_S = 0.5
MAX_TOKENS = 1 << 62  # a token count past this is garbage
MAX_COUNT = 1e15  # a transition count past this is garbage (float32 sums stay finite)
SCAN_PER_PEER = 64  # a scan reads at most this x cluster.max_peers device names


class PayloadError(ValueError):
    """A shared value that is not what it claims (size, format, checksum, dtype, shape)."""


# --- identity -----------------------------------------------------------------------------------

def model_fingerprint(identity: dict) -> str:
    """16 hex digits naming a model's routing space (what the features describe)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def manifest_identity(manifest) -> dict:
    """The model identity in a store manifest: family, layers, experts, top-k and the experts'
    tensor layouts (names, dtypes, shapes), not where the weights are."""
    layouts = sorted({tuple((t.name, t.dtype, tuple(t.shape)) for t in e.tensors)
                      for e in manifest.experts})
    return {"family": manifest.model_family, "model_type": manifest.model_type,
            "num_layers": manifest.num_layers, "moe_layers": list(manifest.moe_layers),
            "num_experts": manifest.num_experts, "top_k": manifest.top_k,
            "tensors": [[list(map(str, t[:2])) + [list(t[2])] for t in layout]
                        for layout in layouts]}


def device_name(config: ClusterConfig) -> str:
    return config.device_id or socket.gethostname()


def key(fingerprint: str, device: str, what: str) -> str:
    return f"flashmoe:{fingerprint}:{device}:{what}"


# --- envelopes ----------------------------------------------------------------------------------

def encode(what: str, device: str, generation: int, tokens: int, body: bytes) -> bytes:
    header = json.dumps({"what": what, "device": device, "generation": generation,
                         "tokens": int(tokens), "bytes": len(body),
                         "sha256": hashlib.sha256(body).hexdigest()}).encode()
    return _PREAMBLE.pack(MAGIC, VERSION, len(header)) + header + body


def decode(raw: bytes, what: str, max_bytes: int) -> tuple[dict, bytes]:
    """(header, body) of an envelope; PayloadError naming what is wrong."""
    if len(raw) > max_bytes:
        raise PayloadError(f"{what}: {len(raw)} bytes, over cluster.max_bytes {max_bytes}")
    if len(raw) < _PREAMBLE.size:
        raise PayloadError(f"{what}: {len(raw)} bytes is too short for an envelope")
    magic, version, header_len = _PREAMBLE.unpack_from(raw)
    if magic != MAGIC:
        raise PayloadError(f"{what}: not a FlashMoE cluster value (magic {magic!r})")
    if version != VERSION:
        raise PayloadError(f"{what}: envelope version {version}, this device reads {VERSION}")
    if _PREAMBLE.size + header_len > len(raw):
        raise PayloadError(f"{what}: a header of {header_len} bytes in {len(raw)}")
    try:
        header = json.loads(raw[_PREAMBLE.size:_PREAMBLE.size + header_len])
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"{what}: unreadable header ({str(exc)[:200]})") from None
    body = raw[_PREAMBLE.size + header_len:]
    if not isinstance(header, dict) or header.get("what") != what or \
            not _is_int(header.get("bytes"), len(body), len(body)) or \
            not _is_int(header.get("tokens"), 0, MAX_TOKENS) or \
            not _is_int(header.get("generation"), 0, 1 << 64) or \
            not isinstance(header.get("device"), str) or \
            not isinstance(header.get("sha256"), str):
        raise PayloadError(f"{what}: header does not match the value ({str(header)[:300]})")
    if hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise PayloadError(f"{what}: checksum mismatch")
    return header, body


def _is_int(value, lo: int, hi: int) -> bool:
    """An int (not a bool) in [lo, hi]."""
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def encode_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    return st_save({k: np.ascontiguousarray(v) for k, v in arrays.items()})


def decode_arrays(body: bytes, what: str,
                  expected: dict[str, tuple[np.dtype, tuple[int, ...]]],
                  nonnegative: bool = False, nan_ok: tuple[str, ...] = ()
                  ) -> dict[str, np.ndarray]:
    """The arrays of a safetensors body, checked name by name against ``expected``; no
    infinity anywhere, no NaN outside ``nan_ok``."""
    try:
        arrays = st_load(body)
    except Exception as exc:  # SafetensorError, or any other refusal of untrusted bytes
        raise PayloadError(f"{what}: not a safetensors body ({str(exc)[:200]})") from None
    if set(arrays) != set(expected):
        raise PayloadError(f"{what}: arrays {sorted(arrays)}, expected {sorted(expected)}")
    for name, (dtype, shape) in expected.items():
        value = arrays[name]
        if value.dtype != dtype or value.shape != shape:
            raise PayloadError(f"{what}: {name} is {value.dtype}{list(value.shape)}, expected "
                               f"{np.dtype(dtype)}{list(shape)}")
        if value.dtype.kind == "f" and (np.isinf(value).any() or (
                name not in nan_ok and np.isnan(value).any())):
            raise PayloadError(f"{what}: {name} has non-finite values")
        if nonnegative and (value < 0).any():
            raise PayloadError(f"{what}: {name} has negative values")
    return arrays


# --- what a device shares -----------------------------------------------------------------------

# {what: {array name: (dtype, shape)}}: the arrays of each value that holds some.
ArraySpecs = dict[str, dict[str, tuple[np.dtype, tuple[int, ...]]]]


@dataclass(frozen=True)
class ModelShape:
    """What every shared array must look like on this device, as the services that publish
    them declare it (services/<name>/sharing.py), and the hyper-parameters a peer's
    ``predictor.json`` must have (``predictor_meta``: its keys and this device's values)."""
    arrays: ArraySpecs
    predictor_meta: dict = field(default_factory=dict)

    def expected(self, what: str) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
        return self.arrays[what]


@dataclass
class Patterns:
    """One device's shared features (a peer's after validation, or this device's to publish).
    ``pca`` and ``predictor`` may be missing (a device whose predictor has not checkpointed
    yet)."""
    device: str
    tokens: int
    popularity: np.ndarray  # (N,) float32, share of tokens that used each expert
    transitions: np.ndarray  # (L, E, E) float32: token t-1 used expert i -> token t used j
    transition_rows: np.ndarray  # (L, E) float32: times expert i was the source
    pca: dict[str, np.ndarray] | None = None
    predictor: dict[str, np.ndarray] | None = None  # the Net's state_dict as "net.<name>"
    predictor_meta: dict | None = None


def extractor_values(patterns: Patterns, generation: int) -> dict[str, bytes]:
    """The extractor's keys' values."""
    def env(what: str, body: bytes) -> bytes:
        return encode(what, patterns.device, generation, patterns.tokens, body)

    out = {"tokens": env("tokens", str(patterns.tokens).encode()),
           "popularity": env("popularity", encode_arrays({"popularity": patterns.popularity})),
           "transitions": env("transitions", encode_arrays(
               {"counts": patterns.transitions, "rows": patterns.transition_rows}))}
    if patterns.pca is not None:
        out["pca"] = env("pca", encode_arrays(patterns.pca))
    return out


def predictor_values(device: str, tokens: int, weights: dict[str, np.ndarray], meta: dict,
                     generation: int) -> dict[str, bytes]:
    """The predictor's keys' values."""
    return {"predictor.safetensors": encode("predictor.safetensors", device, generation, tokens,
                                            encode_arrays(weights)),
            "predictor.json": encode("predictor.json", device, generation, tokens,
                                     json.dumps(meta).encode())}


def parse_device(values: dict[str, bytes | None], device: str, shape: ModelShape,
                 max_bytes: int) -> Patterns:
    """A peer's ``Patterns`` from its raw values (None: key missing); PayloadError when any
    present value is garbage or the device's total is over ``max_bytes``."""
    total = sum(len(v) for v in values.values() if v is not None)
    if total > max_bytes:
        raise PayloadError(f"device {device}: {total} bytes, over cluster.max_bytes {max_bytes}")
    decoded = {what: decode(raw, what, max_bytes) for what, raw in values.items()
               if raw is not None}
    for what in ("tokens", "popularity", "transitions"):
        if what not in decoded:
            raise PayloadError(f"device {device}: {what} is missing")
    headers = {what: header for what, (header, _) in decoded.items()}
    for what, header in headers.items():
        if header["device"] != device:
            raise PayloadError(f"{what}: published by {header['device']!r} under {device!r}")
    text = decoded["tokens"][1]
    if not text.isdigit() or len(text) > 19:
        raise PayloadError("tokens: not a count")
    tokens = int(text)
    if tokens != headers["tokens"]["tokens"]:
        raise PayloadError(f"tokens: {tokens} in the body, {headers['tokens']['tokens']} in "
                           f"the header")
    # The extractor's keys go out in one transaction: one generation among them.
    generations = {headers[w]["generation"] for w in EXTRACTOR_PARTS if w in headers}
    if len(generations) != 1:
        raise PayloadError(f"device {device}: extractor keys of different publishes")
    popularity = decode_arrays(decoded["popularity"][1], "popularity",
                               shape.expected("popularity"), nonnegative=True)["popularity"]
    if popularity.max(initial=0.0) > 1.0:
        raise PayloadError("popularity: a share above 1")
    transitions = decode_arrays(decoded["transitions"][1], "transitions",
                                shape.expected("transitions"), nonnegative=True)
    if any(v.max(initial=0.0) > MAX_COUNT for v in transitions.values()):
        raise PayloadError(f"transitions: a count above {MAX_COUNT:g}")
    patterns = Patterns(device, tokens, popularity, transitions["counts"], transitions["rows"])
    if "pca" in decoded:
        # counters[2], the variance the PCA keeps, is NaN until its first fit.
        patterns.pca = decode_arrays(decoded["pca"][1], "pca", shape.expected("pca"),
                                     nan_ok=("counters",))
        counters = patterns.pca["counters"].tolist()
        n, weight, kept = (counters + [0.0] * 3)[:3]
        if not (0 <= n <= MAX_TOKENS and n == int(n) and 0 <= weight <= MAX_COUNT and
                (np.isnan(kept) or 0 <= kept <= 1)):
            raise PayloadError(f"pca: counters {counters} (updates, weight, variance kept)")
    if "predictor.safetensors" in decoded and "predictor.json" in decoded:
        if headers["predictor.safetensors"]["generation"] != \
                headers["predictor.json"]["generation"]:
            raise PayloadError(f"device {device}: predictor keys of different publishes")
        try:
            meta = json.loads(decoded["predictor.json"][1])
            mine = {k: meta[k] for k in shape.predictor_meta}
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise PayloadError(f"predictor.json: unreadable ({str(exc)[:200]})") from None
        if mine != shape.predictor_meta:
            raise PayloadError(f"predictor.json: a predictor of {str(mine)[:300]}, this "
                               f"device's is {shape.predictor_meta}")
        if not _is_int(meta.get("steps", 0), 0, MAX_TOKENS):
            raise PayloadError(f"predictor.json: steps {str(meta.get('steps'))[:40]}")
        patterns.predictor = decode_arrays(decoded["predictor.safetensors"][1],
                                           "predictor.safetensors",
                                           shape.expected("predictor.safetensors"))
        patterns.predictor_meta = meta
    return patterns


# --- merging ------------------------------------------------------------------------------------

@dataclass
class WarmStart:
    """What a starting device takes from its peers."""
    peers: list[str]
    tokens: int  # summed over the peers
    popularity: np.ndarray
    transitions: np.ndarray
    transition_rows: np.ndarray
    source: str = ""  # the peer whose PCA and predictor are taken ("" when none has both)
    pca: dict[str, np.ndarray] | None = None
    predictor: dict[str, np.ndarray] | None = None
    predictor_meta: dict | None = None

    def summary(self) -> dict:
        return {"peers": self.peers, "tokens": self.tokens, "predictor_from": self.source}


def merge(peers: list[Patterns]) -> WarmStart | None:
    """Popularity and transitions weighted by token count; PCA and predictor weights of the
    peer with the most tokens among those that have both. None without peers (or tokens)."""
    peers = [p for p in peers if p.tokens > 0]
    if not peers:
        return None
    total = sum(p.tokens for p in peers)
    weights = np.array([p.tokens / total for p in peers], np.float64)
    popularity = sum(w * p.popularity.astype(np.float64) for w, p in zip(weights, peers))
    transitions = sum(p.transitions.astype(np.float64) for p in peers)
    rows = sum(p.transition_rows.astype(np.float64) for p in peers)
    out = WarmStart(sorted(p.device for p in peers), total, popularity.astype(np.float32),
                    transitions.astype(np.float32), rows.astype(np.float32))
    complete = [p for p in peers if p.pca is not None and p.predictor is not None]
    if complete:
        best = max(complete, key=lambda p: (p.tokens, p.device))
        out.source, out.pca = best.device, best.pca
        out.predictor, out.predictor_meta = best.predictor, best.predictor_meta
    return out


def open_link(config, manifest) -> ClusterLink:
    """A service's link (not yet connected), under the fingerprint of its store's model."""
    return ClusterLink(config.cluster, model_fingerprint(manifest_identity(manifest)))


# --- the Redis link ---------------------------------------------------------------------------

class ClusterLink:
    """A Redis connection that never raises into its caller's service: ``call`` runs one
    operation and returns None on failure, having set ``state`` (``alone``: Redis unreachable,
    slow or rejecting commands; ``error``: authentication refused or a setting is wrong) and
    scheduled the next try after a doubling back-off."""

    def __init__(self, config: ClusterConfig, fingerprint: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.fingerprint, self.clock = config, fingerprint, clock
        self.device = device_name(config)
        self.state = "connecting"
        self.reason = ""
        self.last_ok: float | None = None  # wall-clock time of the last successful call
        self.retry_at = 0.0
        self.backoff = BACKOFF_START_S
        self.counters = {"n_published": 0, "n_publish_refused": 0, "n_garbage": 0,
                         "n_errors": 0, "n_reconnects": 0, "peers": 0, "n_peers_skipped": 0}
        self.last_garbage = ""
        self.lock = threading.Lock()  # status() from the control thread
        self.client: redis.Redis | None = None

    def _client(self) -> redis.Redis:
        cfg = self.config
        url = cfg.redis_url
        if cfg.tls and url.startswith("redis://"):
            url = "rediss://" + url[len("redis://"):]
        kwargs = {"socket_timeout": cfg.timeout_s, "socket_connect_timeout": cfg.timeout_s,
                  "retry": Retry(NoBackoff(), 0), "health_check_interval": 0}
        if cfg.username:
            kwargs["username"] = cfg.username
        if cfg.password_file:
            try:
                kwargs["password"] = Path(cfg.password_file).read_text().splitlines()[0]
            except (OSError, IndexError) as exc:
                raise _SettingError(f"cluster.password_file {cfg.password_file}: cannot read a "
                                    f"password ({exc})") from None
        elif cfg.password:
            kwargs["password"] = cfg.password
        if url.startswith("rediss://") and cfg.tls_ca_file:
            kwargs["ssl_ca_certs"] = cfg.tls_ca_file
        try:
            return redis.Redis.from_url(url, **kwargs)
        except ValueError as exc:
            raise _SettingError(f"cluster.redis_url {cfg.redis_url!r}: {exc}") from None

    def ready(self) -> bool:
        """Whether a call may be tried now (not waiting out a back-off)."""
        return self.clock() >= self.retry_at

    def call(self, operation: Callable[[redis.Redis], object]):
        """``operation(client)``, or None after a failure (state and back-off set)."""
        try:
            if self.client is None:
                self.client = self._client()
            result = operation(self.client)
        except _SettingError as exc:
            self._fail("error", str(exc))
            return None
        except redis.AuthenticationError as exc:
            self._fail("error", f"authentication refused: {exc} (check cluster.username, "
                                f"cluster.password / cluster.password_file)")
            return None
        except redis.ResponseError as exc:
            text = str(exc)
            if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                self._fail("error", f"authentication refused: {text} (check cluster.username, "
                                    f"cluster.password / cluster.password_file)")
            else:
                self._fail("alone", f"Redis refused a command: {text}")
            return None
        except redis.TimeoutError as exc:
            self._fail("alone", f"Redis did not answer within cluster.timeout_s = "
                                f"{self.config.timeout_s:g} s ({exc})")
            return None
        except (redis.RedisError, OSError) as exc:
            self._fail("alone", f"Redis unreachable: {exc}")
            return None
        with self.lock:
            if self.state != "connected" and self.last_ok is not None:
                self.counters["n_reconnects"] += 1
            self.state, self.reason = "connected", ""
            self.last_ok = time.time()
            self.backoff = BACKOFF_START_S
        return result

    def _fail(self, state: str, reason: str) -> None:
        with self.lock:
            if (state, reason) != (self.state, self.reason):
                log.warning("cluster: %s: %s", state, reason)
            self.state, self.reason = state, reason
            self.counters["n_errors"] += 1
            self.retry_at = self.clock() + self.backoff
            self.backoff = min(self.backoff * 2, self.config.backoff_max_s)
        if self.client is not None:
            try:
                self.client.close()
            except (redis.RedisError, OSError):
                pass
            self.client = None  # a fresh connection (and AUTH) on the next try

    def garbage(self, reason: str) -> None:
        with self.lock:
            self.counters["n_garbage"] += 1
            self.last_garbage = reason
        log.warning("cluster: ignored a peer's garbage: %s", reason)

    def status(self) -> dict:
        """What stats report: ``state`` is ``connected``, ``alone`` (serving without peers:
        Redis down, slow or refusing) or ``error`` (a setting or the password is wrong)."""
        with self.lock:
            return {"state": self.state, "reason": self.reason, "device": self.device,
                    "fingerprint": self.fingerprint,
                    "last_ok": round(self.last_ok, 3) if self.last_ok else None,
                    "retry_in_s": round(max(self.retry_at - self.clock(), 0.0), 2)
                    if self.state != "connected" else 0.0,
                    "last_garbage": self.last_garbage, **self.counters}

    # --- operations -----------------------------------------------------------------------------

    def publish(self, values: dict[str, bytes]) -> bool:
        """This device's ``values`` ({what: envelope}) in one transaction with the TTL, unless
        they and the device's other keys would pass ``cluster.max_bytes`` (then refused and
        counted)."""
        names = {what: key(self.fingerprint, self.device, what) for what in values}
        others = [key(self.fingerprint, self.device, w) for w in PARTS if w not in values]

        def run(client: redis.Redis):
            pipe = client.pipeline(transaction=False)
            for other in others:
                pipe.strlen(other)
            held = sum(pipe.execute()) if others else 0
            total = held + sum(len(v) for v in values.values())
            if total > self.config.max_bytes:
                return total
            pipe = client.pipeline(transaction=True)
            for what, value in values.items():
                pipe.set(names[what], value, ex=self.config.ttl_s)
            pipe.execute()
            return 0

        over = self.call(run)
        if over is None:
            return False
        with self.lock:
            if over:
                self.counters["n_publish_refused"] += 1
                self.reason = (f"publish refused: this device's keys would hold {over} bytes, "
                               f"over cluster.max_bytes {self.config.max_bytes}")
                log.warning("cluster: %s", self.reason)
                return False
            self.counters["n_published"] += 1
        return True

    def peer_devices(self) -> list[str] | None:
        """Devices with features of this model in Redis, this one left out (None: failed):
        the ``cluster.max_peers`` most recently published (the longest TTL left), the others
        counted in ``n_peers_skipped``. The scan stops after ``SCAN_PER_PEER`` x max_peers
        names (the rest count as skipped too)."""
        pattern = key(self.fingerprint, "*", "tokens")
        prefix = f"flashmoe:{self.fingerprint}:".encode()
        limit = SCAN_PER_PEER * self.config.max_peers

        def run(client: redis.Redis):
            found, more = {}, False
            for name in client.scan_iter(match=pattern, count=1000):
                name = name.encode() if isinstance(name, str) else name
                try:
                    device = name[len(prefix):-len(b":tokens")].decode()
                except UnicodeDecodeError:  # not a name this code writes
                    continue
                if device == self.device:
                    continue
                if len(found) >= limit:
                    more = True
                    break
                found[device] = name
            names = list(found)
            pipe = client.pipeline(transaction=False)
            for device in names:
                pipe.ttl(found[device])
            ttls = pipe.execute(raise_on_error=False) if names else []
            left = {d: t if isinstance(t, int) else -1 for d, t in zip(names, ttls)}
            kept = sorted(names, key=lambda d: (-left[d], d))[:self.config.max_peers]
            return sorted(kept), len(names) - len(kept) + more

        result = self.call(run)
        if result is None:
            return None
        devices, skipped = result
        with self.lock:
            self.counters["peers"] = len(devices)
            self.counters["n_peers_skipped"] += skipped
        return devices

    def fetch_peers(self, shape: ModelShape) -> list[Patterns]:
        """Every peer's validated features; garbage is counted and its device skipped. Sizes
        are read first: a device over ``cluster.max_bytes`` is not downloaded, and no read
        takes more than that (``GETRANGE``)."""
        devices = self.peer_devices() or []
        peers = []
        limit = self.config.max_bytes
        for device in devices:
            names = [key(self.fingerprint, device, what) for what in PARTS]
            raw = self.call(lambda client, names=names: _bounded_mget(client, names, limit))
            if raw is None:
                break
            try:
                if isinstance(raw, PayloadError):
                    raise raw
                peers.append(parse_device(dict(zip(PARTS, raw)), device, shape, limit))
            except PayloadError as exc:
                self.garbage(f"{device}: {exc}")
        return peers

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except (redis.RedisError, OSError):
                pass
            self.client = None


def _bounded_mget(client: redis.Redis, names: list[str],
                  max_bytes: int) -> list[bytes | None] | PayloadError:
    """The values of ``names`` (None: missing), or the PayloadError that refuses them before
    download: not plain strings, or more than ``max_bytes`` together."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.strlen(name)
    sizes = pipe.execute(raise_on_error=False)
    for name, size in zip(names, sizes):
        if not isinstance(size, int):  # WRONGTYPE: someone stored another type there
            return PayloadError(f"{name.rsplit(':', 1)[-1]}: not a string value ({size})")
    if sum(sizes) > max_bytes:
        return PayloadError(f"{sum(sizes)} bytes, over cluster.max_bytes {max_bytes}")
    pipe = client.pipeline(transaction=False)
    for name, size in zip(names, sizes):
        if size:
            pipe.getrange(name, 0, max_bytes)  # a value grown since is read one byte over
    values = iter(pipe.execute(raise_on_error=False))
    out = []
    for size in sizes:
        value = next(values) if size else None
        if isinstance(value, Exception):
            return PayloadError(f"unreadable value ({value})")
        out.append(value)
    return out


def cluster_stats(link: ClusterLink, warm_start: dict | None) -> dict[str, int | float | str]:
    """A service's cluster figures as flat ``cluster_*`` stats (the control socket carries
    flat numbers and text; nothing is left out but unknown values)."""
    out = {f"cluster_{k}": v for k, v in link.status().items() if v is not None}
    if warm_start is not None:
        out.update(cluster_warm_peers=",".join(warm_start["peers"]),
                   cluster_warm_tokens=warm_start["tokens"],
                   cluster_warm_predictor_from=warm_start["predictor_from"])
    return out


def summary_of_stats(stats: dict) -> dict | None:
    """The nested view of ``cluster_stats`` (run summaries, JSON), or None without a link."""
    if "cluster_state" not in stats:
        return None
    out = {k[len("cluster_"):]: v for k, v in stats.items()
           if k.startswith("cluster_") and not k.startswith("cluster_warm_")}
    out["warm_start"] = {"peers": [p for p in stats["cluster_warm_peers"].split(",") if p],
                         "tokens": stats["cluster_warm_tokens"],
                         "predictor_from": stats["cluster_warm_predictor_from"]} \
        if "cluster_warm_peers" in stats else None
    return out


class _SettingError(Exception):
    """A cluster setting that no retry can fix (bad URL, unreadable password file)."""


class ClusterAgent:
    """The periodic side of a service's cluster link, on its own daemon thread: every
    ``cluster.publish_every_s`` (or sooner, once a back-off ends) it takes ``snapshot()``
    (the service's values to publish, or None when it has nothing yet) and publishes it,
    then counts the peers. The service's loop never waits on Redis."""

    def __init__(self, link: ClusterLink, snapshot: Callable[[], dict[str, bytes] | None],
                 name: str) -> None:
        self.link, self.snapshot = link, snapshot
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"cluster-{name}", daemon=True)

    def start(self) -> ClusterAgent:
        self.thread.start()
        return self

    def _loop(self) -> None:
        every = self.link.config.publish_every_s
        while not self.stop_event.is_set():
            if self.link.ready():
                try:
                    values = self.snapshot()
                except Exception:  # the service's data mid-change: try again next round
                    log.exception("cluster: snapshot failed")
                    values = None
                if values:
                    self.link.publish(values)
                if self.link.state == "connected":
                    self.link.peer_devices()
            wait = every if self.link.state == "connected" else \
                min(every, max(self.link.retry_at - self.link.clock(), 0.05))
            self.stop_event.wait(wait)

    def stop(self, timeout_s: float = 5.0) -> None:
        self.stop_event.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        self.link.close()

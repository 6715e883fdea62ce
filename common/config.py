"""One root configuration for every FlashMoE process.

The root config is made of typed section dataclasses. Every field carries a docstring-like
``doc`` and its allowed range or choices in its metadata, so that validation, the CLI help and
the control panel all read the same definition.

Precedence, lowest first: device-profile defaults < config file (TOML or JSON) < environment
(``FLASHMOE_<SECTION>__<FIELD>``, e.g. ``FLASHMOE_IO__QUEUE_DEPTH=16``) < CLI ``--set
section.field=value``. An invalid value fails at start with a message naming the field, its
allowed range and where the value came from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

ENV_PREFIX = "FLASHMOE_"
# FLASHMOE_ variables that are not config fields: the device profile, and the checkpoint
# fault injection of common/checkpoints.py (testing only).
ENV_NOT_FIELDS = frozenset({ENV_PREFIX + "PROFILE", ENV_PREFIX + "CHECKPOINT_FAULT"})
KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


class ConfigError(ValueError):
    """A configuration value is unknown, malformed or out of range."""


# cache.precision_split's default: the budget's bytes to the native, int8 and int4 pools
PRECISION_SPLIT = (0.0, 0.7, 0.3)


def precision_numbers(setting: str, text: str) -> tuple[float, ...] | None:
    """``cache.precision_split`` or ``precision_fractions``: three non-negative numbers
    (native, int8, int4), not all 0; None for an empty text; else ConfigError."""
    if not text.strip():
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or any(v != v for v in values) or min(values) < 0 or \
            sum(values) <= 0 or sum(values) == float("inf"):
        raise ConfigError(f"{setting} = {text!r}: three non-negative numbers (native, int8, "
                          f"int4), comma-separated, not all 0")
    return values


def precision_split(cache) -> tuple[float, ...]:
    """``cache.precision_split`` as the pools' fractions of the budget's bytes (sum 1)."""
    split = precision_numbers("cache.precision_split", cache.precision_split) or PRECISION_SPLIT
    return tuple(v / sum(split) for v in split)


def _spec(doc: str, lo: float | None = None, hi: float | None = None,
          choices: tuple | None = None, size: bool = False, multiple_of: int | None = None,
          live: bool = False, fixed_because: str = "", secret: bool = False) -> dict:
    """Field metadata. ``live``: the running services may change it without a restart, so it
    is left out of the handshake digests (peers with different live values still connect).
    ``fixed_because``: why a field that is not live cannot change while running (what the
    control panel answers when asked to). ``secret``: never shown by the control panel."""
    return {"doc": doc, "lo": lo, "hi": hi, "choices": choices, "size": size,
            "multiple_of": multiple_of, "live": live, "fixed_because": fixed_because,
            "secret": secret}


def parse_size(text: str | int) -> int:
    """Parse ``262144``, ``256K``, ``256KiB``, ``4M``, ``1G`` into bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size: {text!r} (examples: 262144, 256K, 4M, 1G)")
    unit = {"": 1, "K": KIB, "M": MIB, "G": GIB}[match.group(2).upper()]
    return int(match.group(1)) * unit


@dataclass
class StoreConfig:
    path: str = field(default="", metadata=_spec("Expert store folder made by `flashmoe convert`."))
    block_size: int = field(default=256 * KIB, metadata=_spec(
        "Bytes per store block (one SSD read).", lo=4 * KIB, hi=16 * MIB, size=True,
        multiple_of=4096, fixed_because="the store's blocks are cut at this size when it is "
        "converted: re-run `flashmoe convert` with the new size, then restart"))
    parallelism: int = field(default=4, metadata=_spec(
        "Number of stripe files; global block b lives in stripe b % parallelism.", lo=1, hi=64))


@dataclass
class IOConfig:
    engine: str = field(default="auto", metadata=_spec(
        "IO engine: auto uses the io_uring helper when it loads and works, else pread.",
        choices=("auto", "uring", "pread")))
    queue_depth: int = field(default=8, metadata=_spec(
        "Reads kept in flight by the IO engine.", lo=1, hi=256))
    verify_checksums: bool = field(default=True, metadata=_spec(
        "Verify every block's checksum before its slot is marked ready."))
    read_timeout_s: float = field(default=5.0, metadata=_spec(
        "Seconds a submitted read may take; past it the IO engine is declared failed and the "
        "cache manager exits (its supervisor restarts it).", lo=0.01, hi=600))


@dataclass
class CacheConfig:
    policy: str = field(default="lru", metadata=_spec(
        "Eviction policy name from the policy registry.", live=True))
    policy_params: dict = field(default_factory=dict, metadata=_spec(
        "Parameters of the chosen policy (a table; keys are the policy's Params fields, an "
        "unknown key is an error). On the command line: a JSON object.", live=True))
    capacity_experts: int = field(default=64, metadata=_spec(
        "Arena slots (experts resident at once); the arena is this many slots. Live: it can "
        "go down to what pins hold and back up to the arena's size at start.", lo=1,
        hi=1 << 20, live=True))
    scope: str = field(default="global", metadata=_spec(
        "global: one budget over all layers; layer: one budget per layer.",
        choices=("global", "layer")))
    precision: str = field(default="native", metadata=_spec(
        "The experts' precision in the arena: native (the store's), int8 or int4 (every "
        "expert from that copy, more of them in the same bytes), dynamic (native, int8 and "
        "int4 pools; each load's precision chosen by the learned estimate: cache.policy "
        "flashmoe) or random (the same pools, each load's precision drawn with "
        "cache.precision_fractions: the ablation of dynamic). The budget stays "
        "capacity_experts native slots' bytes. The store needs the copies: `flashmoe "
        "synth-store/convert --precisions bf16,int8,int4`.",
        choices=("native", "int8", "int4", "dynamic", "random")))
    precision_split: str = field(default=",".join(map(str, PRECISION_SPLIT)), metadata=_spec(
        "dynamic and random: the budget's byte fractions of the native, int8 and int4 pools "
        "(three numbers, comma-separated; 0: no pool of that precision). The default, no "
        "native pool, computes with the least error at its bytes on the dev split "
        "(docs/results/precision.md)."))
    precision_admit: float = field(default=1.0, metadata=_spec(
        "dynamic: a miss is loaded at a better precision only if it is expected back sooner "
        "than that pool's latest-expected resident by (its bytes / int4's bytes) to this "
        "power (0: sooner at all).", lo=0.0, hi=8.0))
    precision_weight: float = field(default=0.0, metadata=_spec(
        "dynamic: how much a miss's router weight counts: its expected next use is divided "
        "by (its weight over the request's mean weight) to this power before the comparison "
        "(an expert carrying more than its share of the token goes to a better precision); "
        "0: weights ignored (on the dev split they moved bytes and error along the same "
        "line as precision_admit does: docs/results/precision.md).", lo=0.0, hi=8.0))
    precision_upgrades: int = field(default=0, metadata=_spec(
        "dynamic: most upgrades a decode step (a resident int4 or int8 expert read again at a "
        "better precision while the disk would idle, once it is expected sooner than that "
        "pool's worst resident by the precision_admit factor); 0: none.", lo=0, hi=64))
    precision_fractions: str = field(default="", metadata=_spec(
        "random: the probability of each precision (native, int8, int4) for a load; empty: "
        "the pools' shares of slots."))


@dataclass
class IPCConfig:
    runtime_dir: str = field(default="", metadata=_spec(
        "Folder for ipc sockets; empty means a private folder under the system temp dir."))
    handshake_timeout_s: float = field(default=10.0, metadata=_spec(
        "Seconds a client waits for READY after HELLO.", lo=0.05, hi=600))
    acquire_timeout_s: float = field(default=30.0, metadata=_spec(
        "Seconds a worker waits for an AcquireRep before raising CacheManagerUnavailable.",
        lo=0.05, hi=3600))
    max_message_bytes: int = field(default=64 * KIB, metadata=_spec(
        "Largest accepted control message; larger ones are rejected and counted.",
        lo=1 * KIB, hi=16 * MIB, size=True))
    heartbeat_interval_s: float = field(default=1.0, metadata=_spec(
        "Seconds between heartbeats on every connection (ZeroMQ ZMTP pings).", lo=0.05, hi=60))
    heartbeat_timeout_s: float = field(default=5.0, metadata=_spec(
        "Seconds without traffic after which a peer is dead: a worker loses its pins.",
        lo=0.1, hi=600))


@dataclass
class FeaturesConfig:
    pca_components: int = field(default=128, metadata=_spec(
        "Dimensions the online PCA keeps of each layer's raw feature vector (0: no PCA).",
        lo=0, hi=256))


@dataclass
class PredictorConfig:
    model: str = field(default="linear", metadata=_spec(
        "Predictor network: a linear model of the per-layer features, or a 2-layer LSTM "
        "over the token stream on the same inputs (default chosen on dev).",
        choices=("lstm", "linear")))
    lstm_hidden: int = field(default=64, metadata=_spec(
        "LSTM hidden size of the predictor (predictor.model = lstm).", choices=(32, 64, 128)))
    window_tokens: int = field(default=32, metadata=_spec(
        "Sliding training window, in tokens (one token is top-k x layers expert accesses).",
        lo=4, hi=4096))
    train_every_tokens: int = field(default=64, metadata=_spec(
        "Tokens between online training steps (default chosen on dev).", lo=1, hi=100_000))
    learning_rate: float = field(default=2e-3, metadata=_spec(
        "Adam learning rate of the heads (and the LSTM); the per-expert bias and the shared "
        "per-expert weights learn at 5x it.", lo=1e-5, hi=1.0))
    ewc_strength: float = field(default=0.0, metadata=_spec(
        "Weight of the EWC penalty (pull towards the anchored weights) in normal training.",
        lo=0.0, hi=1000.0, live=True))
    ewc_lambda: float = field(default=0.5, metadata=_spec(
        "Weight of the EWC penalty during an elastic update (after a drift).", lo=0.0,
        hi=1000.0, live=True))
    drift: bool = field(default=False, metadata=_spec(
        "Page-Hinkley drift detector on the prediction loss; a detected drift starts an "
        "elastic update (off by default, chosen on dev: the sliding training window already "
        "follows a new task).", live=True))
    drift_threshold: float = field(default=2.0, metadata=_spec(
        "Page-Hinkley threshold (lambda) of the drift detector.", lo=0.01, hi=1000.0,
        live=True))
    int8: bool = field(default=False, metadata=_spec(
        "Run inference on an INT8 dynamically quantized copy of the network."))
    infer_precision: str = field(default="int8", metadata=_spec(
        "Precision of the per-layer heads in the fused C inference (a copy made after each "
        "training step; training stays fp32): bf16 halves the bytes a token's inference "
        "reads, int8 (one scale per output, inputs in fp32) quarters them. A live predictor "
        "wakes with cold caches, where the bytes read set the cost.",
        choices=("fp32", "bf16", "int8")))
    publish_interval_ms: int = field(default=20, metadata=_spec(
        "Least time between Prediction messages, in ms. The predictor makes an estimate "
        "every token; 20 ms sends nearly every one (default chosen on dev).", lo=1,
        hi=60_000))
    max_age_ms: int = field(default=2000, metadata=_spec(
        "A prediction older than this is not used: the cache manager falls back to LRU.",
        lo=10, hi=3_600_000, live=True))
    checkpoint_every_s: float = field(default=30.0, metadata=_spec(
        "Seconds between the learned state's checkpoints: the predictor's, and the feature "
        "extractor's given a checkpoint folder (a restart resumes from the last).",
        lo=0.1, hi=86_400.0))


@dataclass
class PrefetchConfig:
    window: int = field(default=8, metadata=_spec(
        "Experts a prefetcher may ask for ahead of use (capped by prefetch.budget).", lo=0,
        hi=256, live=True))
    budget: int = field(default=8, metadata=_spec(
        "Most prefetch loads in flight at once, in experts; a hard cap set at start.",
        lo=0, hi=256, fixed_because="a hard cap set at start: restart the services to change "
        "it"))
    inline: bool = field(default=True, metadata=_spec(
        "The cache manager's inline next-layer prefetcher (hints from the current token's "
        "routing).", live=True))
    inline_with_learned: bool = field(default=False, metadata=_spec(
        "The inline prefetcher hints while FlashMoE's look-ahead prefetch runs on a usable "
        "estimate too (off: it hints only while there is none, as in the LRU fallback, and "
        "keeps learning meanwhile; default chosen on dev).", live=True))
    threshold: float = field(default=0.55, metadata=_spec(
        "The inline prefetcher hints an expert whose predicted chance of use reaches this.",
        lo=0.0, hi=1.0, live=True))
    learned: int = field(default=1, metadata=_spec(
        "Look-ahead prefetch by the learned estimate (policy flashmoe): while no demand read is "
        "in flight, load up to this many experts per request that the estimate needs sooner "
        "than the resident expert they would evict (0: off).", lo=0, hi=64, live=True))
    learned_ratio: float = field(default=6.0, metadata=_spec(
        "A look-ahead prefetch's expected next use must be at most 1/ratio of its victim's "
        "(both in layer steps from now; default chosen on dev).",
        lo=1.0, hi=1000.0, live=True))
    learned_margin: float = field(default=0.0, metadata=_spec(
        "Tokens by which a look-ahead prefetch's expected next use must also come before its "
        "victim's (0: no margin; the ratio alone decides).", lo=0.0, hi=1000.0, live=True))
    learned_skip: int = field(default=1, metadata=_spec(
        "Layers right after the current one that the look-ahead prefetch leaves alone: a "
        "read started now would still be in flight when they ask (default chosen on dev).",
        lo=0, hi=64, live=True))
    router_lookahead: bool = field(default=True, metadata=_spec(
        "Router look-ahead (`serve`, `generate`): while a MoE layer computes, the next MoE "
        "layer's router is applied to its input and its top experts are hinted to the cache "
        "while the hint's measured recall is at least 0.8 (its recall is always reported).",
        fixed_because="the worker reads it when it loads the model: restart it"))


@dataclass
class PanelConfig:
    port: int = field(default=8470, metadata=_spec(
        "TCP port of the control panel, on 127.0.0.1 (0: any free port; the URL is printed at "
        "start).", lo=0, hi=65535))
    token: str = field(default="", metadata=_spec(
        "Token that changes through the control panel must carry (header `Authorization: "
        "Bearer <token>` or `X-FlashMoE-Token`); empty: one is generated at start and printed.",
        secret=True))
    allowed_hosts: str = field(default="", metadata=_spec(
        "Host names (comma-separated) the panel answers besides the loopback names (localhost, "
        "127.0.0.1, ::1) and its listening address; a request naming another Host gets 400 "
        "(DNS rebinding). Add the name a browser uses for a published port, e.g. "
        "`panel.example.lan,192.168.1.5`; `*` accepts any.",
        fixed_because="the panel reads it when it starts: restart it"))


_SERVE_FIXED = "the API's settings are read when `flashmoe serve` starts: restart it"
_CLUSTER_FIXED = "the Redis link is made when a service starts: restart the services to change it"


@dataclass
class ClusterConfig:
    redis_url: str = field(default="", metadata=_spec(
        "Redis through which devices share pattern features (redis://host:port/db, rediss:// "
        "for TLS, unix:///path); empty: this device runs alone. `--redis URL` sets it.",
        fixed_because=_CLUSTER_FIXED))
    device_id: str = field(default="", metadata=_spec(
        "This device's name in the shared keys; empty: the host name.",
        fixed_because=_CLUSTER_FIXED))
    ttl_s: int = field(default=3600, metadata=_spec(
        "Seconds a published key lives unless republished (a gone device's features expire).",
        lo=10, hi=30 * 86_400, fixed_because=_CLUSTER_FIXED))
    max_bytes: int = field(default=8 * MIB, metadata=_spec(
        "Most bytes one device's keys may hold together; a larger publish is refused and a "
        "larger peer is ignored (gpt-oss-20b's linear predictor is 3.9 MB in float16, its "
        "extractor's tables ~0.7 MB).", lo=64 * KIB, hi=512 * MIB, size=True,
        fixed_because=_CLUSTER_FIXED))
    publish_every_s: float = field(default=30.0, metadata=_spec(
        "Seconds between this device's publishes (and peer counts).", lo=0.05, hi=86_400.0,
        fixed_because=_CLUSTER_FIXED))
    max_peers: int = field(default=16, metadata=_spec(
        "Most peers a device reads (the most recently published; the rest are skipped and "
        "counted).", lo=1, hi=1024, fixed_because=_CLUSTER_FIXED))
    timeout_s: float = field(default=1.0, metadata=_spec(
        "Seconds one Redis call (connect, read or write) may take; past it the device goes on "
        "alone and reconnects later.", lo=0.01, hi=60.0, fixed_because=_CLUSTER_FIXED))
    backoff_max_s: float = field(default=30.0, metadata=_spec(
        "Longest wait between reconnection attempts (the wait doubles from 0.5 s).", lo=0.1,
        hi=3600.0, fixed_because=_CLUSTER_FIXED))
    username: str = field(default="", metadata=_spec(
        "Redis ACL user name (AUTH username password); empty: the default user.",
        fixed_because=_CLUSTER_FIXED))
    password: str = field(default="", metadata=_spec(
        "Redis password (AUTH); prefer cluster.password_file, which stays off command lines.",
        secret=True, fixed_because=_CLUSTER_FIXED))
    password_file: str = field(default="", metadata=_spec(
        "File holding the Redis password (its first line); wins over cluster.password.",
        fixed_because=_CLUSTER_FIXED))
    tls: bool = field(default=False, metadata=_spec(
        "Talk TLS to Redis (also implied by a rediss:// URL).", fixed_because=_CLUSTER_FIXED))
    tls_ca_file: str = field(default="", metadata=_spec(
        "CA certificate(s) that verify the Redis server under TLS; empty: the system's.",
        fixed_because=_CLUSTER_FIXED))


@dataclass
class TracesConfig:
    dir: str = field(default="", metadata=_spec(
        "Folder of the full routing traces (holding gptoss20b/ and warp/); empty: "
        "../shared/traces beside the checkout when present. `--traces-dir` wins over it.",
        fixed_because="traces are read when a command starts"))


@dataclass
class ServeConfig:
    host: str = field(default="127.0.0.1", metadata=_spec(
        "Address `flashmoe serve`'s OpenAI-compatible API listens on (loopback by default; "
        "0.0.0.0 exposes it to the network: set serve.api_key then).",
        fixed_because=_SERVE_FIXED))
    port: int = field(default=8000, metadata=_spec(
        "TCP port of the API (0: any free port; the URL is printed at start).", lo=0,
        hi=65535, fixed_because=_SERVE_FIXED))
    api_key: str = field(default="", metadata=_spec(
        "Key every API request must carry (`Authorization: Bearer <key>`); empty: none asked.",
        secret=True, fixed_because=_SERVE_FIXED))
    model_name: str = field(default="", metadata=_spec(
        "The model's id in the API; empty: the store folder's name.",
        fixed_because=_SERVE_FIXED))
    max_queue: int = field(default=64, metadata=_spec(
        "Requests waiting for the model beyond those it decodes; more get 503.", lo=1,
        hi=100_000, fixed_because=_SERVE_FIXED))
    max_batch: int = field(default=8, metadata=_spec(
        "Sequences decoded together (each MoE layer's experts acquired once for all of them).",
        lo=1, hi=256, fixed_because=_SERVE_FIXED))
    allowed_hosts: str = field(default="", metadata=_spec(
        "Host names (comma-separated) the API answers besides the loopback names (localhost, "
        "127.0.0.1, ::1) and serve.host; a request naming another Host gets 400 (DNS "
        "rebinding). Add the name clients use for a published port, e.g. "
        "`llm.example.lan,192.168.1.5`; `*` accepts any.", fixed_because=_SERVE_FIXED))
    route_around: int = field(default=-1, metadata=_spec(
        "Experts that cannot be loaded (a bad block: its checksum fails, or its read in three "
        "steps) the model may route around: the requests that needed one get 502, later ones "
        "are computed without it (its share of each top-k goes to the others; /health says "
        "`degraded`, such answers carry `X-FlashMoE-Routed-Around`). -1: 1% of the model's "
        "experts, at least 1; 0: none (every request that needs one gets 502).", lo=-1,
        hi=1_000_000, fixed_because=_SERVE_FIXED))


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::")


def allowed_hosts(configured: str, bind_host: str) -> frozenset[str] | None:
    """The Host names an HTTP server (panel, serve's API) answers, from its ``allowed_hosts``
    field and its listening address: the loopback names, the address unless a wildcard, and
    the configured names; None when ``*`` is among them (any host)."""
    names = {name.strip().lower().rstrip(".") for name in configured.split(",")} - {""}
    if "*" in names:
        return None
    if bind_host.strip("[]") not in WILDCARD_ADDRESSES:
        names.add(bind_host.strip("[]").lower())
    return frozenset({*LOOPBACK_HOSTS, *(name.strip("[]") for name in names)})


def host_name(header: str) -> str:
    """The name in a Host header (``name``, ``name:port``, ``[v6]:port``), lower case."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    name = header.rpartition(":")[0] if header.count(":") == 1 else header
    return name.rstrip(".")


# DESIGN.md "Device profiles": defaults that depend on the device's RAM.
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "8gb": {"predictor": {"lstm_hidden": 32}, "store": {"block_size": 128 * KIB},
            "prefetch": {"window": 4, "budget": 4}},
    "16gb": {"predictor": {"lstm_hidden": 64}, "store": {"block_size": 256 * KIB},
             "prefetch": {"window": 8, "budget": 8}},
    "32gb": {"predictor": {"lstm_hidden": 128}, "store": {"block_size": 512 * KIB},
             "prefetch": {"window": 16, "budget": 16}},
}
DEFAULT_PROFILE = "16gb"


@dataclass
class FlashMoEConfig:
    profile: str = DEFAULT_PROFILE
    store: StoreConfig = field(default_factory=StoreConfig)
    io: IOConfig = field(default_factory=IOConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    ipc: IPCConfig = field(default_factory=IPCConfig)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    panel: PanelConfig = field(default_factory=PanelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    traces: TracesConfig = field(default_factory=TracesConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """Short hash of every value (logs, reports)."""
        return _hash(self.to_dict())

    def section_digests(self) -> dict[str, str]:
        """Per section, a hash of the fields that cannot change while running: what the
        HELLO/READY handshake compares (live-tunable fields are left out, so a service tuned
        at run time and a restarted child still connect)."""
        out = {}
        for section in SECTIONS:
            values = getattr(self, section)
            out[section] = _hash({f.name: getattr(values, f.name)
                                  for f in dataclasses.fields(values) if not f.metadata["live"]})
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "FlashMoEConfig":
        cfg = cls(profile=data.get("profile", DEFAULT_PROFILE))
        for section, values in data.items():
            if section == "profile":
                continue
            for name, value in values.items():
                _assign(cfg, section, name, value, "dict")
        return cfg


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def differing_sections(mine: Mapping[str, str], theirs: Mapping[str, str],
                       sections: tuple[str, ...] | None = None) -> list[str]:
    """Sections whose digests differ (only those named in ``sections``, when given)."""
    names = sections if sections is not None else tuple(mine)
    return [s for s in names if s in mine and s in theirs and mine[s] != theirs[s]]


SECTIONS = tuple(f.name for f in dataclasses.fields(FlashMoEConfig) if f.name != "profile")


def field_spec(section: str, name: str) -> tuple[dataclasses.Field, dict]:
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section {section!r}; sections: {', '.join(SECTIONS)}")
    section_cls = type(getattr(FlashMoEConfig(), section))
    fields = {f.name: f for f in dataclasses.fields(section_cls)}
    if name not in fields:
        raise ConfigError(f"unknown config field {section}.{name}; fields of [{section}]: "
                          f"{', '.join(fields)}")
    return fields[name], fields[name].metadata


def _coerce(f: dataclasses.Field, spec: dict, value: Any, where: str) -> Any:
    key_type = field_type(f)
    try:
        if spec.get("size"):
            return parse_size(value)
        if key_type == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"not a boolean: {value!r}")
        if key_type == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(f"not an integer: {value!r}")
            try:
                return int(value)
            except (TypeError, ValueError, OverflowError):
                raise ValueError(f"not an integer: {value!r}") from None
        if key_type == "float":
            try:
                return float(value)
            except (TypeError, ValueError):
                raise ValueError(f"not a number: {value!r}") from None
        if key_type == "dict":
            if isinstance(value, str):
                value = json.loads(value) if value.strip() else {}
            if not isinstance(value, dict):
                raise ValueError(f"not a table: {value!r} (on the command line: a JSON object)")
            return dict(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


# Choices a registry outside common/ knows (the policy names): the app hands the registry's
# names over at start (``register_choices``), so that such a field is checked where config is
# read like one declared with ``choices``, without common/ importing the registry.
_REGISTERED_CHOICES: dict[str, Callable[[], Iterable]] = {}


def register_choices(key: str, choices: Callable[[], Iterable]) -> None:
    """The field ``key`` (``section.field``) takes one of ``choices()`` from now on."""
    section, _, name = key.partition(".")
    field_spec(section, name)
    _REGISTERED_CHOICES[key] = choices


def field_choices(key: str, spec: Mapping[str, Any]) -> tuple | None:
    """The values the field ``key`` allows (None: any in its type and range)."""
    if key in _REGISTERED_CHOICES:
        return tuple(sorted(_REGISTERED_CHOICES[key]()))
    return spec.get("choices")


def _check(spec: dict, value: Any, where: str, choices: tuple | None) -> None:
    lo, hi = spec.get("lo"), spec.get("hi")
    if choices is not None and value not in choices:
        raise ConfigError(f"{where} = {value!r} is not allowed; choices: "
                          f"{', '.join(map(str, choices))}")
    if lo is not None and hi is not None and not (lo <= value <= hi):
        raise ConfigError(f"{where} = {value!r} is out of range [{lo}, {hi}]")
    multiple = spec.get("multiple_of")
    if multiple and value % multiple:
        raise ConfigError(f"{where} = {value!r} must be a multiple of {multiple}")


def _assign(cfg: FlashMoEConfig, section: str, name: str, value: Any, origin: str) -> None:
    checked = check_value(f"{section}.{name}", value, origin)
    setattr(getattr(cfg, section), name, checked)


def load_config(profile: str | None = None, file: str | os.PathLike | None = None,
                env: Mapping[str, str] | None = None,
                overrides: list[str] | tuple[str, ...] = ()) -> FlashMoEConfig:
    """Build the root config from profile, file, environment and CLI overrides, validated."""
    env = os.environ if env is None else env
    file_data: dict[str, Any] = {}
    if file:
        path = Path(file)
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        try:
            file_data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {path} is malformed: {exc}") from None
    profile = (profile or env.get(ENV_PREFIX + "PROFILE") or file_data.get("profile")
               or DEFAULT_PROFILE)
    if profile not in PROFILES:
        raise ConfigError(f"profile = {profile!r} is not allowed; choices: "
                          f"{', '.join(PROFILES)}")
    cfg = FlashMoEConfig(profile=profile)
    for section, values in PROFILES[profile].items():
        for name, value in values.items():
            _assign(cfg, section, name, value, f"profile {profile}")
    for section, values in file_data.items():
        if section == "profile":
            continue
        if not isinstance(values, dict):
            raise ConfigError(f"config file {file}: [{section}] must be a table of fields")
        for name, value in values.items():
            _assign(cfg, section, name, value, f"file {file}")
    for key, value in sorted(env.items()):
        if not key.startswith(ENV_PREFIX) or key in ENV_NOT_FIELDS:
            continue
        section, sep, name = key[len(ENV_PREFIX):].lower().partition("__")
        if not sep:
            raise ConfigError(f"environment {key}: expected {ENV_PREFIX}<SECTION>__<FIELD>")
        _assign(cfg, section, name, value, f"env {key}")
    for item in overrides:
        dotted, sep, value = item.partition("=")
        section, dot, name = dotted.strip().partition(".")
        if not sep or not dot:
            raise ConfigError(f"--set {item!r}: expected section.field=value")
        _assign(cfg, section, name, value.strip(), f"--set {item}")
    return cfg


def check_value(key: str, value: Any, origin: str) -> Any:
    """``value`` for the field ``key`` (``section.field``), coerced and checked as at start;
    raises ConfigError naming the field, its range or choices, and ``origin``."""
    section, dot, name = key.partition(".")
    if not dot:
        raise ConfigError(f"{key!r}: expected section.field")
    f, spec = field_spec(section, name)
    where = f"{key} (from {origin})"
    choices = field_choices(key, spec)
    try:
        coerced = _coerce(f, spec, value, where)
    except ConfigError as exc:
        if choices is None:
            raise
        raise ConfigError(f"{exc}; choices: {', '.join(map(str, choices))}") from None
    _check(spec, coerced, where, choices)
    return coerced


def field_type(f: dataclasses.Field) -> str:
    """The field's value type as a name: bool, int, float, str or dict."""
    return f.type if isinstance(f.type, str) else f.type.__name__


def describe_fields() -> list[dict[str, Any]]:
    """Every tunable field with its doc, default and bounds (CLI help, control panel)."""
    rows = []
    default = FlashMoEConfig()
    for section in SECTIONS:
        for f in dataclasses.fields(type(getattr(default, section))):
            spec = f.metadata
            rows.append({"key": f"{section}.{f.name}", "type": field_type(f),
                         "default": getattr(getattr(default, section), f.name),
                         "doc": spec["doc"], "lo": spec.get("lo"), "hi": spec.get("hi"),
                         "choices": field_choices(f"{section}.{f.name}", spec),
                         "size": spec["size"],
                         "multiple_of": spec.get("multiple_of"), "live": spec["live"],
                         "fixed_because": spec["fixed_because"], "secret": spec["secret"]})
    return rows

"""Every message FlashMoE processes exchange, and the one codec for them.

On the wire a message is one ZeroMQ frame of plain msgpack: ``[SCHEMA_VERSION, [tag, field,
...]]``. The version is checked before the body is decoded; the body is a msgspec Struct,
validated on decode (types and bounds). No pickle anywhere.

Decoding never raises anything but ``ProtocolError``, whose ``code`` says what was wrong
(``malformed``, ``wrong_version``, ``oversized``), so a service can count it and go on.

Sockets and the unions they accept:
  - worker -> cache manager (DEALER -> ROUTER, the hot path): ``WorkerToCache`` /
    ``CacheToWorker``;
  - any client -> a service's control socket (DEALER -> ROUTER, never the hot path):
    ``ControlRequest`` / ``ControlReply``;
  - the learning path (PUB -> SUB): worker -> feature extractor ``AccessEvent``, extractor ->
    predictor ``FeatureBatch``, predictor -> cache manager ``Prediction``
    (``LearningMessage``).
"""

from __future__ import annotations

from typing import Annotated, Any, Union

import msgspec

# 2: AcquireReq.release_layers (per-layer pins), PrefetchHint, Release.layers, per-section
#    config digests in Hello/Ready, the control socket's Health messages.
# 3: the learning path's AccessEvent, FeatureBatch, Prediction; AcquireReq.token.
# 4: the control socket's ConfigReq/Rep, TuneReq/Rep and ResidencyReq/Rep (the control panel).
# 5: AcquireReq.step (which decode step a request serves, in AccessEvent seq numbers).
# 6: AccessEvent.prefill (a prompt position's routing, not a decode step's).
# 7: Hello.shape (the model shape a worker expects; the manager refuses another).
# 8: Ready.pools (the arena's slots by precision: cache.precision).
# 9: AcquireReq.weights (the router's weight of each expert: cache.precision_weight).
SCHEMA_VERSION = 9

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
ExpertIds = Annotated[list[NonNeg], msgspec.Meta(max_length=1024)]
LayerIds = Annotated[list[NonNeg], msgspec.Meta(max_length=1024)]
ShortText = Annotated[str, msgspec.Meta(max_length=4096)]
# non-negative and finite (NaN fails the bound); router weights are at most 1 in the families
# here, and the bound only keeps out the absurd
Weight = Annotated[float, msgspec.Meta(ge=0.0, le=1e6)]
Digests = Annotated[dict[ShortText, ShortText], msgspec.Meta(max_length=64)]
# layers | experts | top_k | expert_bytes -> value; a key absent or 0 is not compared
ModelShape = Annotated[dict[ShortText, NonNeg], msgspec.Meta(max_length=16)]


class Message(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """Base of all messages; the tag is the class name."""


# --- worker <-> cache manager (DEALER -> ROUTER) -------------------------------------------

class Hello(Message):
    worker_name: ShortText  # free-form name for logs and stats
    pid: NonNeg  # worker process id
    config_digests: Digests  # FlashMoEConfig.section_digests() of the sender; {} = none
    shape: ModelShape = {}  # the model shape the sender expects; {} = not compared


class Ready(Message):
    arena_name: ShortText  # shm name of the arena (under /dev/shm)
    slot_bytes: NonNeg  # bytes per arena slot
    n_slots: NonNeg  # slots in the arena
    store_path: ShortText  # store folder; the worker reads the manifest for tensor layout
    engine: ShortText  # IO engine in use ("uring" or "pread")
    config_digests: Digests  # the cache manager's section digests
    # [precision, first unit, slots, units a slot] per pool (common.arena.ArenaLayout); [] =
    # every slot native, one unit each
    pools: Annotated[list[tuple[ShortText, NonNeg, NonNeg, NonNeg]],
                     msgspec.Meta(max_length=8)] = []


class AcquireReq(Message):
    seq: NonNeg  # worker-chosen sequence number, echoed in the reply
    layer: NonNeg  # MoE layer index
    experts: ExpertIds  # expert ids selected for this layer (the router's top-k)
    # Layers whose pins this worker drops first (piggybacked release, no extra round trip).
    # Pins are per (worker, layer): acquiring a layer again replaces that layer's pins.
    release_layers: LayerIds = []
    token: ShortText = ""  # the decode step's input token (context for the prefetcher)
    # The decode step this request serves: the seq of the AccessEvent this worker publishes
    # for it (-1: it publishes none). A Prediction's event_seq + 1 is the step it is for, so
    # the cache manager can tell an estimate of a step already past from the current one's.
    step: Annotated[int, msgspec.Meta(ge=-1)] = -1
    # The router's weight of each expert, in request order (for several positions, its mean
    # over them; an expert a position did not choose counts 0 there); [] when unknown. A
    # dynamic-precision cache keeps the experts of large weight at a better precision.
    weights: Annotated[list[Weight], msgspec.Meta(max_length=1024)] = []


class AcquireRep(Message):
    seq: NonNeg  # echo of AcquireReq.seq
    layer: NonNeg
    slots: list[NonNeg]  # arena slot of each requested expert, in request order; pinned


class AcquireError(Message):
    seq: NonNeg  # echo of AcquireReq.seq
    layer: NonNeg
    # checksum | io_error | io_timeout | no_free_slot (the load or the room failed);
    # unknown_layer | unknown_expert | duplicate_expert | too_many_experts | bad_weights
    # (refused: the request does not fit the model; nothing changed)
    code: ShortText
    message: ShortText  # human-readable detail
    experts: list[NonNeg]  # the experts the error is about


class PrefetchHint(Message):
    layer: NonNeg  # load these experts of this layer ahead of use; nobody waits, no reply
    experts: ExpertIds


class Release(Message):
    seq: NonNeg  # answered by Released
    layers: LayerIds = []  # layers whose pins the sender drops; [] = every layer


class Released(Message):
    seq: NonNeg


class StatsReq(Message):
    seq: NonNeg


class StatsRep(Message):
    seq: NonNeg
    stats: dict[str, Union[int, float, str]]  # counters and gauges, flat


class Rejected(Message):
    # malformed | wrong_version | oversized | unexpected | config_mismatch | unsupported |
    # shape_mismatch (Hello's shape differs) | pins_lost (the manager dropped this worker:
    # missed heartbeats; Hello again) | unknown_layer (a Release of a layer the model lacks)
    code: ShortText
    message: ShortText


class Dead(Message):
    reason: ShortText  # sent by a process that is going down so peers fail fast


# --- the learning path (PUB/SUB; every message sequence-numbered per publisher) --------------
# A publisher's ``epoch`` (its start time, ns) tells a restart from a gap; ``seq`` counts its
# messages from 0.

Rows = Annotated[list[ExpertIds], msgspec.Meta(max_length=1024)]
ProbRows = Annotated[list[Annotated[list[float], msgspec.Meta(max_length=1024)]],
                     msgspec.Meta(max_length=1024)]


class AccessEvent(Message):
    source: ShortText  # the worker that served the token
    epoch: NonNeg
    seq: NonNeg
    sequence: NonNeg  # the sequence (request) the token belongs to
    position: NonNeg  # decode step within that sequence (0 = its first)
    input_token: ShortText  # the token fed to this step, as text
    next_token: ShortText  # the token it produced (the next step's input); "" at the end
    experts: Rows  # per MoE layer, the router's top-k expert ids, highest first
    probs: ProbRows  # the same shape: router probabilities; [] when unknown
    prefill: bool = False  # a prompt position's routing (its prefill), not a decode step's


class FeatureBatch(Message):
    source: ShortText  # the feature extractor
    epoch: NonNeg
    seq: NonNeg
    event_seq: NonNeg  # the AccessEvent (token t) after which these features were computed
    event_source: ShortText
    position: NonNeg  # position of token t + 1, the token the features describe
    experts: Rows  # token t's routing (the predictor's labels)
    layers: NonNeg
    experts_per_layer: NonNeg
    per_layer: bytes  # float32 (layers, dims): the reduced per-layer vector (online PCA)
    dims: NonNeg
    per_expert: bytes  # float16 (layers * experts_per_layer, features): per-expert features
    features: NonNeg
    variance_kept: float  # share of the raw vectors' variance the reduction keeps


class Prediction(Message):
    source: ShortText  # the predictor
    epoch: NonNeg
    seq: NonNeg
    event_seq: NonNeg  # the last token (AccessEvent seq) the prediction has seen
    model_version: NonNeg  # training steps so far
    layers: NonNeg
    experts_per_layer: NonNeg
    variants: NonNeg
    scores: bytes  # float32 (variants, layers * experts_per_layer): S of policies/scored.py


# --- control socket of every service ---------------------------------------------------------

class HealthReq(Message):
    seq: NonNeg


class HealthRep(Message):
    seq: NonNeg
    service: ShortText  # e.g. "cache_manager"
    pid: NonNeg
    state: ShortText  # "running" | "stopping" | "failed"
    uptime_s: float


class ConfigReq(Message):
    seq: NonNeg


class ConfigRep(Message):
    seq: NonNeg
    config: dict[str, Any]  # the service's FlashMoEConfig.to_dict(), live changes included


ConfigValue = Union[bool, int, float, ShortText]


class TuneReq(Message):
    seq: NonNeg
    # "section.field" -> new value; checked again by the receiver against common/config.py
    changes: Annotated[dict[ShortText, ConfigValue], msgspec.Meta(max_length=256)]
    check: bool = False  # True: only say what would be applied or refused; nothing changes


class TuneRep(Message):
    seq: NonNeg
    supported: bool  # False: this service takes no live change at all (yet)
    applied: list[ShortText]  # the keys this service uses live (applied, unless check)
    refused: dict[ShortText, ShortText]  # key -> why this service cannot take it now
    # keys in neither list are not read by this service


class ResidencyReq(Message):
    seq: NonNeg


class ResidencyRep(Message):
    seq: NonNeg
    layers: list[NonNeg]  # MoE layer ids, in the order of the rows below
    experts_per_layer: NonNeg
    resident: bytes  # uint8 (layers, experts_per_layer): 1 resident or loading, 0 not
    popularity: bytes  # float32 (layers, experts_per_layer): requests for each expert so far


class PoliciesReq(Message):
    seq: NonNeg


class PoliciesRep(Message):
    seq: NonNeg
    choices: list[ShortText]  # the eviction policies this cache manager can run live
    policy: ShortText  # the one it runs now


WorkerToCache = Union[Hello, AcquireReq, PrefetchHint, Release, StatsReq]
CacheToWorker = Union[Ready, AcquireRep, AcquireError, Released, StatsRep, Rejected, Dead]
LearningMessage = Union[AccessEvent, FeatureBatch, Prediction]
ControlRequest = Union[HealthReq, StatsReq, ConfigReq, TuneReq, ResidencyReq, PoliciesReq]
ControlReply = Union[HealthRep, StatsRep, ConfigRep, TuneRep, ResidencyRep, PoliciesRep,
                     Rejected, Dead]


class ProtocolError(ValueError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


_envelope_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])


def encode(message: Message) -> bytes:
    return _envelope_encoder.encode((SCHEMA_VERSION, message))


class Decoder:
    """Typed decoder for one direction of one socket, e.g. ``Decoder(WorkerToCache)``."""

    def __init__(self, union, max_bytes: int = 64 * 1024) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        self.max_bytes = max_bytes

    def decode(self, frame: bytes | memoryview) -> Message:
        if len(frame) > self.max_bytes:
            raise ProtocolError("oversized", f"{len(frame)} bytes > limit {self.max_bytes}")
        try:
            version, body = _envelope_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError("malformed", f"not a FlashMoE envelope: {exc}") from None
        if version != SCHEMA_VERSION:
            raise ProtocolError("wrong_version",
                                f"schema version {version}, expected {SCHEMA_VERSION}")
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError("malformed", str(exc)) from None

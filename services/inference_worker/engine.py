"""The serving engine: one model, many requests, the experts through the cache manager.

Requests come in through ``submit`` (any thread) into a bounded queue (``max_queue``: a full
queue raises ``QueueFull``, the API's 503) and are served by the model loop on its own thread.
Each turn of the loop is one step: the requests admitted since the last step join (up to
``max_batch`` sequences in all) and every sequence runs one forward, in a thread of one
``StepGroup``: a new sequence its whole prompt (the prefill), the others their last token.
At each MoE layer the forwards meet and the union of their experts is acquired once (in
requests that fit the cache, see ``StepGroup``); each sequence then computes its own experts,
one forward at a time, so its arithmetic is what it would be alone: at temperature 0 an
answer never depends on what else is being served.

After the forward each sequence picks its next token (greedy at temperature 0, else sampled
with the request's own generator: ``seed`` reproduces an answer), its new text goes to the
request's ``emit`` (detokenized incrementally, an incomplete UTF-8 character and a possible
start of a stop string held back), and one AccessEvent per prompt position (marked prefill)
and per decode step goes to the feature extractor. A request that is cancelled (its client
went away) leaves at the next step; when no sequence is left the engine's pins are released.

Nothing of a step that fails is emitted: a failed load (``ExpertLoadError``) fails the requests
that routed to those experts with that error, the others go on; an expert whose block is bad
(its load failed twice in the cache manager) is then routed around (``ModelRunner.reroute``, at
most ``serve.route_around`` of them), so it costs the requests that met it first, not every
later one; a lost cache manager (restarted,
or this worker dropped after a freeze: ``CacheManagerUnavailable``) has the step done again on
a new connection, each sequence's KV cache rewound to where the step began (``Engine.step``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from common.cache_client import CacheManagerUnavailable, ExpertLoadError, PinsLost

from .model_runner import ModelRunner, StepAborted, StepGroup

log = logging.getLogger("flashmoe.engine")

GREEDY_BELOW = 1e-5  # a temperature below this is greedy, as in vLLM (1e-300 would make
# float32 scores of 0/0)
IDLE_WAIT_S = 0.05
# The router look-ahead hints only while its recent recall reaches this: a wrong hint costs a
# whole expert's read and evicts a resident, a right one only starts a read a layer sooner.
# Pre-gating on trained models gives 0.8-0.95; random-weight models about 0.5.
LOOKAHEAD_MIN_RECALL = 0.8
LOOKAHEAD_EMA = 0.02  # weight of each layer's recall in the running figure
LOOKAHEAD_MIN_SAMPLES = 32  # layers measured before the first hint
STEP_TRIES = 3  # steps in a row done again after losing the cache manager, then they fail
# An expert is routed around after its load failed its checksum once (the cache manager read it
# twice), or with io_error in this many steps: one io_error may be the engine failing as a
# whole (it names whatever it was loading) or a transient error the manager's retry missed.
IO_ERROR_STRIKES = 3


def needs(routing: dict, layer: int, experts: list[int]) -> bool:
    """Whether a forward's routing (layer -> (top-k index, weights)) chose any of ``experts``
    at ``layer``."""
    chosen = routing.get(layer)
    return chosen is not None and bool(set(chosen[0].flatten().tolist()) & set(experts))


def token_text(tokenizer, token: int) -> str:
    """A token as text for events and the prefetcher (never empty: "" means 'no token')."""
    return tokenizer.decode([token]) or tokenizer.convert_ids_to_tokens(token) or f"<{token}>"


class QueueFull(RuntimeError):
    """More requests wait than ``max_queue`` allows."""


class RequestError(ValueError):
    """A request the model cannot take (its ``code`` is OpenAI's error code, if any)."""

    def __init__(self, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param = code, param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: all
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def check(self) -> None:
        """RequestError (param named) on a value out of range."""
        if self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}",
                               param="max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise RequestError(f"temperature must be in [0, 2], got {self.temperature}",
                               param="temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be 0 (all) or more, got {self.top_k}",
                               param="top_k")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise RequestError("stop takes at most 4 non-empty strings", param="stop")


@dataclass
class Request:
    """One completion. ``emit(kind, payload)`` is called from the model loop: ("text",
    piece) for each new token (the text it adds, possibly ""), then ("done", {"finish_reason", "prompt_tokens",
    "completion_tokens"}) or ("error", exception)."""
    prompt_ids: list[int]
    params: SamplingParams
    emit: Callable[[str, object], None]
    id: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        self.cancelled.set()


class StopText:
    """The text of a growing list of token ids, cut at the first stop string: ``push``
    returns what may be sent now, holding back an incomplete UTF-8 character and a tail that
    could still become a stop string; ``stopped`` once one appeared."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, token: int, last: bool) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not last:
            return ""
        self.text = text
        for s in self.stop:
            at = text.find(s, max(0, self.sent - len(s)))
            if at >= 0 and (not self.stopped or at < len(self.text)):
                self.text, self.stopped = text[:at], True
        end = len(self.text)
        if not (self.stopped or last):
            for s in self.stop:  # a tail that may grow into s
                for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text.endswith(s[:n]):
                        end = min(end, len(self.text) - n)
                        break
        piece, self.sent = self.text[self.sent:end], max(self.sent, end)
        return piece


@dataclass
class _Sequence:
    request: Request
    tokens: StopText
    generator: torch.Generator | None
    cache: object = None
    generated: list[int] = field(default_factory=list)
    prefilled: bool = False
    first_token_at: float | None = None
    rerouted: int = 0  # rows of its forwards computed without an expert routed around


class Engine:
    """The model loop (see the module docstring). ``fetch`` and ``hint`` reach the cache
    manager (``fetch(layer, experts, release_layers, token)``, ``hint(layer, experts)``);
    ``publish`` is an ``EventPublisher``'s or None; ``max_request``: the most experts one
    acquire may hold (the cache's slots); ``lost()`` says, after a step's forwards and before
    anything of it is emitted, whether a slot it computed on may have been given to another
    expert (``CacheClient.lost``: this worker was dropped while frozen)."""

    def __init__(self, runner: ModelRunner, tokenizer, max_request: int, *,
                 release: Callable[[], None], hint=None, publisher=None,
                 set_step: Callable[[int], None] = lambda step: None,
                 lost: Callable[[], bool] = lambda: False,
                 max_queue: int = 64, max_batch: int = 8, route_around: int = -1) -> None:
        self.runner, self.tokenizer = runner, tokenizer
        total = len(runner.moe_layers) * runner.num_experts
        # bad experts the model may be computed without (-1: 1% of them, at least one)
        self.route_around_max = max(1, total // 100) if route_around < 0 else route_around
        self.load_failures: dict[tuple[int, int], int] = {}  # (layer, expert) -> failed steps
        self.refused_route_around: set[tuple[int, int]] = set()  # said once in the log
        self.lost = lost
        self.max_request, self.release, self.hint = max_request, release, hint
        self.publisher, self.set_step = publisher, set_step
        self.max_queue, self.max_batch = max_queue, max_batch
        self.eos = runner.eos_token_ids | ({tokenizer.eos_token_id}
                                           if tokenizer.eos_token_id is not None else set())
        self.queue: deque[Request] = deque()
        self.wake = threading.Condition()
        self.active: list[_Sequence] = []
        self.ids = itertools.count(1)
        self.pool = ThreadPoolExecutor(max_batch, thread_name_prefix="forward")
        self.running = True
        self.holds_pins = False
        self.thread: threading.Thread | None = None
        self.stats = {"requests": 0, "requests_finished": 0, "requests_cancelled": 0,
                      "requests_failed": 0, "requests_rejected": 0, "tokens_generated": 0,
                      "steps_redone": 0, "experts_routed_around": 0, "rows_routed_around": 0,
                      "prompt_tokens": 0, "steps": 0, "max_batch": 0,
                      "lookahead_hinted": 0, "lookahead_hits": 0, "lookahead_samples": 0,
                      "router_lookahead_hints": 0}
        self.lookahead_recent: float | None = None  # running recall of the look-ahead
        self.lost_steps = 0  # steps in a row done again after losing the cache manager

    # --- any thread -----------------------------------------------------------------------

    @property
    def context_length(self) -> int:
        return self.runner.context_length

    def clamp(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Check the prompt against the context: RequestError with code
        ``context_length_exceeded`` when it leaves no room; ``max_tokens`` is cut to what the
        context leaves."""
        n, ctx = len(prompt_ids), self.context_length
        if not n:
            raise RequestError("the prompt gives no tokens", param="prompt")
        if ctx and n >= ctx:
            raise RequestError(f"this model's context is {ctx} tokens; the prompt has {n}, "
                               f"which leaves none to generate", code="context_length_exceeded",
                               param="prompt")
        if ctx:
            params.max_tokens = min(params.max_tokens, ctx - n)

    def submit(self, request: Request) -> Request:
        with self.wake:
            if len(self.queue) >= self.max_queue:
                self.stats["requests_rejected"] += 1
                raise QueueFull(f"{len(self.queue)} requests are waiting (serve.max_queue)")
            request.id = next(self.ids)
            self.queue.append(request)
            self.stats["requests"] += 1
            self.wake.notify()
        return request

    def queue_length(self) -> int:
        return len(self.queue)

    def start(self) -> None:
        self.thread = threading.Thread(target=self.loop, name="model-loop", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.running = False
        with self.wake:
            self.wake.notify()
        if self.thread is not None:
            self.thread.join(30)
        self.pool.shutdown(wait=False)

    # --- the model loop -------------------------------------------------------------------

    def loop(self) -> None:
        while self.running:
            if not self.turn():
                with self.wake:
                    if not self.queue and self.running:
                        self.wake.wait(IDLE_WAIT_S)
        for seq in self.active:
            seq.request.emit("error", RuntimeError("the server is shutting down"))
        self.active = []

    def turn(self) -> bool:
        """One turn of the model loop: admit what waits, then one step if any sequence is
        active (else the pins go); False when there was nothing to do."""
        self._admit()
        if not self.active:
            if self.holds_pins:
                self.release()
                self.holds_pins = False
            return False
        self.step()
        return True

    def lookahead_recall(self) -> float | None:
        hinted = self.stats["lookahead_hinted"]
        return round(self.stats["lookahead_hits"] / hinted, 4) if hinted else None

    def _admit(self) -> None:
        kept = []
        for seq in self.active:
            if seq.request.cancelled.is_set():
                self.stats["requests_cancelled"] += 1
            else:
                kept.append(seq)
        self.active = kept
        with self.wake:
            while self.queue and len(self.active) < self.max_batch:
                request = self.queue.popleft()
                if request.cancelled.is_set():
                    self.stats["requests_cancelled"] += 1
                    continue
                p = request.params
                generator = None
                if p.temperature > 0:
                    generator = torch.Generator()
                    generator.manual_seed(p.seed if p.seed is not None
                                          else int(torch.randint(0, 2**62, (1,))))
                self.active.append(_Sequence(request, StopText(self.tokenizer, p.stop),
                                             generator))

    def _text(self, token: int) -> str:
        return token_text(self.tokenizer, token)

    def step(self) -> None:
        """One forward of every active sequence, then each one's next token. A step that
        fails emits nothing of it: an ``ExpertLoadError`` fails the requests whose routing
        needs the experts that failed (the others are rewound and go on at the next turn); a
        lost cache manager (``CacheManagerUnavailable``: a restart, or pins lost after a
        freeze) rewinds every sequence and the next turn does the step again, on a new
        connection, up to ``STEP_TRIES`` times in a row; any other failure fails the step's
        requests. The pins are released after a failure."""
        sequences = list(self.active)
        marks = [self.runner.cache_mark(seq.cache) if seq.cache is not None else None
                 for seq in sequences]
        routings: list[dict] = [{} for _ in sequences]
        results, failure = self._forwards(sequences, routings)
        if failure is None and self.lost():
            failure = PinsLost("the cache manager dropped this worker during the step: its "
                               "slots may hold other experts now")
        self.stats["steps"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(sequences))
        if failure is None:
            self.lost_steps = 0
            now = time.monotonic()
            for seq, (result, cache) in zip(sequences, results):
                try:
                    self._advance(seq, result, cache, now)
                except Exception as exc:  # noqa: BLE001 - its request fails, the loop goes on
                    log.error("a request failed choosing its next token: %r", exc)
                    self._fail([seq], exc)
            return
        self.release()
        self.holds_pins = False
        if isinstance(failure, CacheManagerUnavailable) and self.lost_steps < STEP_TRIES:
            self.lost_steps += 1
            self.stats["steps_redone"] += 1
            log.warning("a step of %d sequences lost the cache manager (%s); doing it again",
                        len(sequences), failure)
            failed = []
        elif isinstance(failure, ExpertLoadError):
            failed = [seq for seq, routing in zip(sequences, routings)
                      if needs(routing, failure.layer, failure.experts)] or sequences
            log.warning("%d of %d requests of a step failed: %s", len(failed), len(sequences),
                        failure)
            self._route_around(failure)
        else:
            log.warning("a step of %d sequences failed: %r", len(sequences), failure)
            failed = sequences
        for seq, mark in zip(sequences, marks):
            if seq not in failed and seq.cache is not None and \
                    not self.runner.rewind(seq.cache, mark):
                failed.append(seq)  # its cache holds half a step: it cannot go on
        self._fail(failed, failure)

    def _fail(self, failed: list[_Sequence], error: BaseException) -> None:
        """Each of ``failed`` answered with ``error`` and dropped from the batch."""
        for seq in failed:
            seq.request.emit("error", error)
            self.stats["requests_failed"] += 1
        self.active = [s for s in self.active if s not in failed]

    def _route_around(self, failure: ExpertLoadError) -> None:
        """Experts with a bad block are computed without from now on: one whose load failed
        its checksum (the cache manager read it twice), or failed with ``io_error`` in
        ``IO_ERROR_STRIKES`` steps; at most ``route_around_max`` of them, and never so many
        that a layer has fewer than top-k left. Beyond that the requests that need one fail,
        said once per expert in the log."""
        if failure.code not in ("checksum", "io_error"):
            return
        layer, routed = failure.layer, self.runner.routed_around
        new = []
        for expert in failure.experts:
            if expert in routed.get(layer, ()):
                continue
            key = (layer, expert)
            self.load_failures[key] = self.load_failures.get(key, 0) + 1
            if failure.code == "checksum" or self.load_failures[key] >= IO_ERROR_STRIKES:
                new.append(expert)
        if not new:
            return
        have = sum(len(experts) for experts in routed.values())
        if have + len(new) > self.route_around_max or \
                not self.runner.may_route_around(layer, new):
            for expert in new:
                if (layer, expert) not in self.refused_route_around:
                    self.refused_route_around.add((layer, expert))
                    log.error("layer %d expert %d cannot be loaded (%s) and %d are routed "
                              "around already (serve.route_around = %d; a layer keeps its "
                              "top-k): requests that need it fail; run `flashmoe verify` on "
                              "the store", layer, expert, failure.code, have,
                              self.route_around_max)
            return
        self.runner.route_around(layer, new)
        self.stats["experts_routed_around"] = have + len(new)
        log.error("layer %d experts %s cannot be loaded (%s): the model is computed without "
                  "them from now on (each top-k that chooses one gives its share to the "
                  "others); run `flashmoe verify` on the store and convert it again",
                  layer, new, failure.code)

    def degraded(self) -> list[dict]:
        """The experts routed around, as ``[{"layer", "expert"}]`` (empty: the model whole)."""
        return [{"layer": layer, "expert": expert}
                for layer, experts in sorted(self.runner.routed_around.items())
                for expert in sorted(experts)]

    def _forwards(self, sequences: list[_Sequence], routings: list[dict]
                  ) -> tuple[list, Exception | None]:
        """Every sequence's forward in one ``StepGroup`` (each filling its ``routings``
        entry): the results, and the first failure (None when all went through)."""
        runner = self.runner
        first = sequences[0]
        token = "" if not first.prefilled else self._text(first.generated[-1])
        group = StepGroup(len(sequences),
                          lambda layer, experts, weights: runner.fetch_layer(
                              layer, experts, token, weights),
                          self.max_request, runner.dtype,
                          hint=self._hint if self.hint is not None else None)
        if self.publisher is not None:
            self.set_step(self.publisher.seq)
        self.holds_pins = True

        def forward(seq: _Sequence, routing: dict):
            with group.cond:
                try:
                    if seq.prefilled:
                        return runner.forward([seq.generated[-1]], seq.cache, group,
                                              self._text(seq.generated[-1]), routing=routing)
                    return runner.forward(seq.request.prompt_ids, None, group,
                                          all_positions=self.publisher is not None,
                                          routing=routing)
                except BaseException as exc:
                    group.fail(exc)  # the others stop at their next meeting
                    raise

        futures = [self.pool.submit(forward, seq, routing)
                   for seq, routing in zip(sequences, routings)]
        results, failure = [], None
        for f in futures:
            try:
                results.append(f.result())
            except StepAborted:
                results.append(None)
            except Exception as exc:  # noqa: BLE001 - a request fails, the server goes on
                results.append(None)
                failure = failure or exc
        return results, failure

    def _choose(self, seq: _Sequence, logits: torch.Tensor) -> int:
        p = seq.request.params
        if p.temperature < GREEDY_BELOW:
            return int(logits.argmax())
        scores = logits.float()
        scores = (scores - scores.max()) / p.temperature  # the largest 0: no overflow
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            ordered, order = torch.sort(scores, descending=True)
            cumulative = torch.softmax(ordered, -1).cumsum(-1)
            cut = cumulative - torch.softmax(ordered, -1) > p.top_p  # keep the first past p
            scores = scores.scatter(0, order[cut], float("-inf"))
        probs = torch.softmax(scores, -1)
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def _advance(self, seq: _Sequence, result, cache, now: float) -> None:
        request, p = seq.request, seq.request.params
        seq.cache = cache
        seq.rerouted += result.rerouted
        self.stats["rows_routed_around"] += result.rerouted
        token = self._choose(seq, result.logits)
        was_prefill = not seq.prefilled
        seq.prefilled = True
        seq.generated.append(token)
        self.stats["tokens_generated"] += 1
        finish = None
        if token in self.eos and not p.ignore_eos:
            finish = "stop"
        elif len(seq.generated) >= p.max_tokens:
            finish = "length"
        piece = seq.tokens.push(token, finish is not None)
        if seq.tokens.stopped:
            finish = "stop"
        self._publish(seq, result, was_prefill, token, finish is not None)
        self._score_lookahead(result)
        if seq.first_token_at is None:
            seq.first_token_at = now
        request.emit("text", piece)  # every token, "" included: its time is a figure
        if finish is not None:
            self.stats["prompt_tokens"] += len(request.prompt_ids)
            request.emit("done", {"finish_reason": finish,
                                  "prompt_tokens": len(request.prompt_ids),
                                  "completion_tokens": len(seq.generated),
                                  "token_ids": list(seq.generated),
                                  "routed_around_rows": seq.rerouted})
            self.stats["requests_finished"] += 1
            self.active.remove(seq)

    def _publish(self, seq: _Sequence, result, was_prefill: bool, token: int,
                 last: bool) -> None:
        publisher = self.publisher
        if publisher is None:
            return
        request = seq.request
        nxt = "" if last else self._text(token)
        if was_prefill:
            prompt = request.prompt_ids
            for i, (experts, probs) in enumerate(result.positions or []):
                following = self._text(prompt[i + 1]) if i + 1 < len(prompt) else nxt
                publisher.publish(request.id, i, self._text(prompt[i]), following, experts,
                                  probs, prefill=True)
            return
        position = len(request.prompt_ids) + len(seq.generated) - 2
        publisher.publish(request.id, position, self._text(seq.generated[-2]), nxt,
                          result.experts, result.probs)

    def lookahead_hinting(self) -> bool:
        """Whether the router look-ahead's hints go to the cache manager: once measured on
        enough layers, while its running recall reaches ``LOOKAHEAD_MIN_RECALL``."""
        return self.stats["lookahead_samples"] >= LOOKAHEAD_MIN_SAMPLES and \
            (self.lookahead_recent or 0.0) >= LOOKAHEAD_MIN_RECALL

    def _hint(self, layer: int, experts: list[int]) -> None:
        if self.lookahead_hinting():
            self.hint(layer, experts)
            self.stats["router_lookahead_hints"] += 1

    def _score_lookahead(self, result) -> None:
        """Recall of the router look-ahead: of the experts a layer's router chose (at the
        step's last position), the share the look-ahead predicted for it."""
        for layer, predicted in result.lookahead.items():
            gone = self.runner.routed_around.get(layer, frozenset())  # never hinted
            actual = [e for e in result.experts[self.runner.moe_layers.index(layer)]
                      if e not in gone]
            if not actual:
                continue
            hits = len(predicted & set(actual))
            self.stats["lookahead_hinted"] += len(actual)
            self.stats["lookahead_hits"] += hits
            self.stats["lookahead_samples"] += 1
            recall = hits / len(actual)
            recent = self.lookahead_recent
            self.lookahead_recent = recall if recent is None else \
                recent + LOOKAHEAD_EMA * (recall - recent)

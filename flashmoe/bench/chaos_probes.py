"""`flashmoe chaos`'s probes: what a run measures while the target is under load and fault.

``Verifier``: a worker of its own (a real ``CacheClient`` with the target's config) that
acquires experts through the target's cache manager, compares each slot's bytes with the
store's true bytes (read from the untouched original store, never the copy a fault corrupts)
and releases them. Every acquire ends as ``ok``, ``wrong`` (bytes differ: counted), ``typed``
(``ExpertLoadError`` or ``CacheManagerUnavailable``), ``hang`` (no reply within the client's
``ipc.acquire_timeout_s``) or ``untyped`` (any other exception). ``reconnect()`` makes it join
again as a new worker, which is how a fault that breaks new workers (a removed arena) shows.

``ServeLoad``: deterministic completions (temperature 0, fixed prompts) sent one after another
over plain HTTP to `flashmoe serve`; the first answer to each prompt before the fault is the
reference, and a later answer that differs counts its differing bytes as wrong. A request ends
``ok``, ``wrong``, ``typed`` (an HTTP error whose body is a JSON ``error`` object), ``hang``
(no answer within ``REQUEST_TIMEOUT_S``), ``refused`` (no connection, or it was cut: the API
process was not there) or ``untyped``.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from common.cache_client import CacheClient, CacheManagerUnavailable, ExpertLoadError
from common.config import FlashMoEConfig
from common.store import ExpertStore, block_location, block_read_len

CHECK_PAUSE_S = 0.1
REQUEST_TIMEOUT_S = 30.0
PROMPTS = ("The cache manager", "Once upon a time", "Experts live on SSD")
MAX_TOKENS = 8


class TrueBytes:
    """Each expert's bytes as the original store holds them, read with buffered IO."""

    def __init__(self, store_path) -> None:
        self.store = ExpertStore.open(store_path)
        self.cache: dict[tuple[int, int], np.ndarray] = {}

    def of(self, layer: int, expert: int) -> np.ndarray:
        key = (layer, expert)
        if key not in self.cache:
            e, m = self.store.expert(layer, expert), self.store.manifest
            parts = []
            for i in range(e.n_blocks):
                stripe, offset = block_location(e.first_block + i, m.block_size, m.parallelism)
                with open(self.store.stripe_paths[stripe], "rb") as f:
                    f.seek(offset)
                    valid = min(m.block_size, e.nbytes - i * m.block_size)
                    parts.append(f.read(block_read_len(e, i, m.block_size))[:valid])
            self.cache[key] = np.frombuffer(b"".join(parts), dtype=np.uint8)
        return self.cache[key]


@dataclass
class Outcomes:
    """Counts of a probe's requests by how they ended, with times for the recovery test."""
    counts: dict[str, int] = field(default_factory=dict)
    wrong_bytes: int = 0
    last_ok_started: float = 0.0  # monotonic start of the latest request answered right
    notes: list[str] = field(default_factory=list)

    def add(self, outcome: str, started: float, note: str = "") -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        if outcome in ("ok", "degraded"):  # an answer: the server went on serving
            self.last_ok_started = max(self.last_ok_started, started)
        if note and len(self.notes) < 5 and note not in self.notes:
            self.notes.append(note)


class Verifier:
    """A worker of the chaos tool's own, checking served bytes on a thread."""

    def __init__(self, endpoint: str, config: FlashMoEConfig, truth: TrueBytes,
                 seed: int) -> None:
        self.endpoint, self.config, self.truth = endpoint, config, truth
        self.rng = random.Random(seed)
        self.keys = truth.store.keys()
        self.focus: tuple[int, int] | None = None  # asked for every other check
        self.out = Outcomes()
        self.client: CacheClient | None = None
        self.connected_at = 0.0  # monotonic time of the latest successful handshake
        self.connect_errors: list[str] = []
        self.want_reconnect = False
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="chaos-verifier", daemon=True)
        self.thread.start()

    def reconnect(self) -> None:
        self.want_reconnect = True

    def _drop(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - a broken client is dropped whatever it says
                pass
            self.client = None

    def _connect(self) -> bool:
        try:
            self.client = CacheClient(self.endpoint, self.config, name="chaos-verifier")
            self.connected_at = time.monotonic()
            return True
        except Exception as exc:  # noqa: BLE001 - every way of failing to join is recorded
            note = f"{type(exc).__name__}: {str(exc)[:160]}"
            if note not in self.connect_errors and len(self.connect_errors) < 5:
                self.connect_errors.append(note)
            return False

    def _loop(self) -> None:
        n = 0
        while not self.stopping.is_set():
            if self.want_reconnect:
                self.want_reconnect = False
                self._drop()
            if self.client is None and not self._connect():
                self.stopping.wait(0.2)
                continue
            n += 1
            layer, expert = self.focus if self.focus and n % 2 == 0 else \
                self.rng.choice(self.keys)
            self._check(layer, expert)
            self.stopping.wait(CHECK_PAUSE_S)
        self._drop()

    def _check(self, layer: int, expert: int) -> None:
        started = time.monotonic()
        client = self.client
        try:
            slot = client.acquire(layer, [expert])[0]
            truth = self.truth.of(layer, expert)
            served = np.frombuffer(client.arena.slot(slot), dtype=np.uint8)[:len(truth)]
            differ = int(np.count_nonzero(served != truth))
            client.release([layer])
        except ExpertLoadError as exc:
            self.out.add("typed", started, f"ExpertLoadError {exc.code}")
            return
        except CacheManagerUnavailable as exc:
            hang = "no reply" in str(exc)
            self.out.add("hang" if hang else "typed", started, f"CacheManagerUnavailable: "
                                                              f"{str(exc)[:120]}")
            self._drop()
            return
        except Exception as exc:  # noqa: BLE001 - an untyped failure is what is counted
            # the client's own error types are its contract; anything else (a raw
            # ProtocolError, a KeyError...) is not
            typed = type(exc).__module__ == CacheClient.__module__
            self.out.add("typed" if typed else "untyped", started,
                         f"{type(exc).__name__}: {str(exc)[:120]}")
            self._drop()
            return
        if differ:
            self.out.wrong_bytes += differ
            self.out.add("wrong", started, f"layer {layer} expert {expert}: {differ} bytes")
        else:
            self.out.add("ok", started)

    def ok_since(self, t: float) -> bool:
        """A check started after ``t`` on a connection made after ``t`` was answered right."""
        return self.connected_at > t and self.out.last_ok_started > self.connected_at

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(REQUEST_TIMEOUT_S + 5)


class ServeLoad:
    """Deterministic completions, one at a time, against `flashmoe serve`'s API."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.reference: dict[str, str] = {}
        self.out = Outcomes()
        self.stopping = threading.Event()
        self.go = threading.Event()  # cleared: no new request is sent (fds are being counted)
        self.go.set()
        self.busy = threading.Lock()  # held while a request is in flight
        self.thread = threading.Thread(target=self._loop, name="chaos-serve-load", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        n = 0
        while not self.stopping.is_set():
            if not self.go.wait(0.2):
                continue
            with self.busy:
                if self.go.is_set():
                    n += 1
                    self._one(PROMPTS[n % len(PROMPTS)])

    def _one(self, prompt: str) -> None:
        """One completion. An answer the server declares computed without some experts
        (``X-FlashMoE-Routed-Around``: a bad block routed around) is ``degraded``: it cannot be
        compared with the whole model's answer; the run says whether its fault may cause it."""
        started = time.monotonic()
        outcome, text, note = self.request(prompt)
        if outcome == "ok":
            want = self.reference.setdefault(prompt, text)
            if text != want:
                a, b = text.encode(), want.encode()
                differ = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
                self.out.wrong_bytes += differ
                outcome, note = "wrong", f"{prompt!r}: {text!r} != {want!r}"
        self.out.add(outcome, started, note)
        if outcome != "ok":
            self.stopping.wait(0.2)

    def request(self, prompt: str) -> tuple[str, str, str]:
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as reply:
                text = json.loads(reply.read())["choices"][0]["text"]
                around = reply.headers.get("X-FlashMoE-Routed-Around")
                if around:
                    return "degraded", text, f"routed around {around}"
                return "ok", text, ""
        except urllib.error.HTTPError as exc:
            try:
                error = json.loads(exc.read())["error"]
                return "typed", "", f"HTTP {exc.code} {error.get('code') or error.get('type')}"
            except (ValueError, KeyError, TypeError, OSError):
                return "untyped", "", f"HTTP {exc.code} without a JSON error"
        except TimeoutError:
            return "hang", "", f"no answer within {REQUEST_TIMEOUT_S:g} s"
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                return "hang", "", f"no answer within {REQUEST_TIMEOUT_S:g} s"
            return "refused", "", f"URLError: {exc.reason}"
        except (ConnectionError, OSError, http.client.HTTPException) as exc:
            # cut mid-answer: the server died (RemoteDisconnected, IncompleteRead...)
            return "refused", "", f"{type(exc).__name__}: {exc}"
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return "untyped", "", f"a 200 answer that is not a completion: {exc!r}"

    def ready(self) -> bool:
        return len(self.reference) == len(PROMPTS)

    def pause(self) -> None:
        """No request in flight until ``resume`` (at most one request's bound to wait)."""
        self.go.clear()
        with self.busy:
            pass

    def resume(self) -> None:
        self.go.set()

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(REQUEST_TIMEOUT_S + 5)

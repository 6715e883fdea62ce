"""LIRS (Jiang & Zhang, "LIRS: An Efficient Low Inter-reference Recency Set Replacement
Policy", SIGMETRICS'02).

Keys are LIR (low inter-reference recency, always resident) or HIR (resident or not). The
stack S holds recency order of LIR keys and of HIR keys seen recently (resident or not); its
bottom is always LIR ("pruning" pops HIR keys off the bottom). The queue Q holds resident HIR
keys, the only eviction candidates. c = capacity, Lhirs = max(1, hir_ratio * c), Llirs = c - Lhirs.

    hit on LIR x:          move x to the top of S; prune
    hit on resident HIR x: if x in S: x becomes LIR, leaves Q; the bottom LIR of S becomes
                           HIR at the end of Q; prune
                           else: x to the top of S and to the end of Q
    miss on x:             (cache full: evict the front of Q; it stays in S as non-resident)
                           if fewer than Llirs LIR keys: x becomes LIR on top of S
                           elif x in S (non-resident HIR): x becomes LIR on top of S; the bottom
                             LIR becomes resident HIR at the end of Q; prune
                           else: x is resident HIR, on top of S and at the end of Q

The paper leaves S's size unbounded; here, as in libCacheSim, S is capped at
``stack_ratio * c`` entries by dropping the non-resident HIR entries that left the cache first.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Container

from .base import NOTHING_PINNED, EvictionPolicy, Key, PolicyError

LIR, HIR_RESIDENT, HIR_NONRESIDENT = 0, 1, 2


@dataclass(frozen=True)
class LIRSParams:
    hir_ratio: float = 0.01  # share of the capacity for resident HIR keys (at least one)
    stack_ratio: float = 2.0  # cap on the entries of S, times the capacity

    def check(self) -> None:
        if not 0.0 < self.hir_ratio < 1.0:
            raise PolicyError(f"lirs: hir_ratio {self.hir_ratio} must be in (0, 1)")
        if self.stack_ratio < 1:
            raise PolicyError(f"lirs: stack_ratio {self.stack_ratio} must be >= 1")


class LIRSPolicy(EvictionPolicy):
    name = "lirs"
    Params = LIRSParams

    def __init__(self, capacity: int, params: LIRSParams | None = None) -> None:
        super().__init__(capacity, params)
        self.hir_capacity = max(1, int(self.params.hir_ratio * capacity))
        self.lir_capacity = max(capacity - self.hir_capacity, 1 if capacity > 1 else 0)
        self.max_stack = int(self.params.stack_ratio * capacity)
        self.state: dict[Key, int] = {}  # every key in S or Q
        self.stack: OrderedDict[Key, None] = OrderedDict()  # bottom first
        self.queue: OrderedDict[Key, None] = OrderedDict()  # resident HIR, front first
        self.nonresident: OrderedDict[Key, None] = OrderedDict()  # in the order they left
        self.n_lir = 0

    def __contains__(self, key: Key) -> bool:
        state = self.state.get(key)
        return state == LIR or state == HIR_RESIDENT

    def __len__(self) -> int:
        return self.n_lir + len(self.queue)

    def _prune(self) -> None:
        stack, state = self.stack, self.state
        while stack:
            bottom = next(iter(stack))
            if state[bottom] == LIR:
                return
            del stack[bottom]
            if state[bottom] == HIR_NONRESIDENT:
                del state[bottom]
                del self.nonresident[bottom]

    def _push(self, key: Key) -> None:
        self.stack.pop(key, None)
        self.stack[key] = None
        while len(self.stack) > self.max_stack and self.nonresident:
            old, _ = self.nonresident.popitem(last=False)
            del self.stack[old]
            del self.state[old]

    def _push_resident_hir(self, key: Key) -> None:
        """Top of S and end of Q as a resident HIR key."""
        self.state[key] = HIR_RESIDENT
        self._push(key)
        self.queue.pop(key, None)
        self.queue[key] = None
        if not self.n_lir:  # no LIR key (capacity 1): S's bottom would be HIR
            self._prune()

    def _demote_bottom_lir(self) -> None:
        self._prune()
        bottom = next(iter(self.stack))
        del self.stack[bottom]
        self.state[bottom] = HIR_RESIDENT
        self.queue[bottom] = None
        self.n_lir -= 1
        self._prune()

    def on_hit(self, key: Key) -> None:
        if self.state[key] == LIR:
            at_bottom = next(iter(self.stack)) == key
            self._push(key)
            if at_bottom:
                self._prune()
        elif key in self.stack:
            del self.queue[key]
            self._push(key)
            self.state[key] = LIR
            self.n_lir += 1
            self._demote_bottom_lir()
        else:
            self._push_resident_hir(key)

    def on_insert(self, key: Key) -> None:
        in_stack = self.state.get(key) == HIR_NONRESIDENT
        lir_set_full = self.n_lir >= self.lir_capacity
        if not lir_set_full or in_stack:
            if in_stack:
                del self.nonresident[key]
            self.state[key] = LIR
            self.n_lir += 1
            self._push(key)
            if lir_set_full:
                self._demote_bottom_lir()
        else:
            self._push_resident_hir(key)

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        for key in self.queue:
            if key not in pinned:
                return key
        for key in self.stack:  # every resident HIR is pinned: fall back to LIR, oldest first
            if self.state[key] == LIR and key not in pinned:
                return key
        return None

    def on_evict(self, key: Key) -> None:
        if self.state[key] == LIR:
            del self.stack[key]
            del self.state[key]
            self.n_lir -= 1
            self._prune()
            return
        del self.queue[key]
        if key in self.stack:
            self.state[key] = HIR_NONRESIDENT
            self.nonresident[key] = None
        else:
            del self.state[key]

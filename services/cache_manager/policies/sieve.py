"""SIEVE (Zhang et al., "SIEVE is Simpler than LRU", NSDI'24).

A FIFO queue with one visited bit per key and a hand that sweeps from the tail (oldest) toward
the head (newest), wrapping around:

    on hit:    visited[x] = 1
    on insert: x at the head, visited[x] = 0
    victim:    o = hand or tail
               while visited[o]: visited[o] = 0; o = o.newer or tail
               evict o; hand = o.newer
"""

from __future__ import annotations

from typing import Container

from .base import NOTHING_PINNED, EvictionPolicy, Key


class _Node:
    __slots__ = ("key", "newer", "older", "visited")

    def __init__(self, key: Key) -> None:
        self.key, self.newer, self.older, self.visited = key, None, None, False


class SIEVEPolicy(EvictionPolicy):
    name = "sieve"

    def __init__(self, capacity: int, params=None) -> None:
        super().__init__(capacity, params)
        self._nodes: dict[Key, _Node] = {}
        self._head: _Node | None = None  # newest
        self._tail: _Node | None = None  # oldest
        self._hand: _Node | None = None

    def __contains__(self, key: Key) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def on_hit(self, key: Key) -> None:
        self._nodes[key].visited = True

    def on_insert(self, key: Key) -> None:
        node = _Node(key)
        node.older = self._head
        if self._head is not None:
            self._head.newer = node
        self._head = node
        if self._tail is None:
            self._tail = node
        self._nodes[key] = node

    def victim(self, pinned: Container[Key] = NOTHING_PINNED) -> Key | None:
        if not self._nodes:
            return None
        node = self._hand or self._tail
        # Two sweeps clear every visited bit; a third finds nothing only if all are pinned.
        for _ in range(3 * len(self._nodes)):
            if node.visited:
                node.visited = False
            elif node.key not in pinned:
                self._hand = node
                return node.key
            node = node.newer or self._tail
        return None

    def on_evict(self, key: Key) -> None:
        node = self._nodes.pop(key)
        if self._hand is node:
            self._hand = node.newer
        if node.newer is not None:
            node.newer.older = node.older
        else:
            self._head = node.older
        if node.older is not None:
            node.older.newer = node.newer
        else:
            self._tail = node.newer

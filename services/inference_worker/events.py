"""The worker's side of the learning path: one AccessEvent per decode step on a PUB socket,
sequence-numbered from 0 (the seq a worker's acquires carry as their step)."""

from __future__ import annotations

import time

import zmq

from common.bus import Publisher
from common.config import FlashMoEConfig
from common.protocol import AccessEvent


class EventPublisher:
    """One AccessEvent per token on a PUB socket."""

    def __init__(self, config: FlashMoEConfig, endpoint: str, source: str) -> None:
        self.ctx = zmq.Context()
        self.publisher = Publisher(self.ctx, config, endpoint)
        self.source, self.epoch, self.seq = source, time.time_ns(), 0

    def publish(self, sequence: int, position: int, input_token: str, next_token: str,
                experts: list[list[int]], probs: list[list[float]],
                prefill: bool = False) -> None:
        self.publisher.publish(AccessEvent(self.source, self.epoch, self.seq, sequence,
                                           position, input_token, next_token, experts, probs,
                                           prefill))
        self.seq += 1

    def close(self) -> None:
        self.publisher.close()
        self.ctx.term()

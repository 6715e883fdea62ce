"""Device models for turning hit counts into time and bandwidth, on the model shapes of
``common.model_families.MODEL_SHAPES`` (bytes per expert and per layer).

Every number here is an assumption, printed by `flashmoe bench` next to its results.

Per-token time (demand fetching, no prefetch): each layer computes for ``compute_ms_per_layer``
and first waits for its missed experts, read in parallel: one ``ssd_latency_ms`` plus
``misses * expert_bytes / ssd_bytes_per_s``. Compute per layer is the memory-bound decode
estimate: bytes touched per layer per token (attention + the active experts + router) divided
by the device's effective memory bandwidth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

from common.model_families import MODEL_SHAPES, ModelShape
from common.traces import TraceError


@dataclass(frozen=True)
class DeviceModel:
    name: str
    description: str
    ssd_bytes_per_s: float  # effective read bandwidth for expert-sized reads
    ssd_latency_ms: float  # time to first byte of a batch of parallel reads
    memory_bytes_per_s: float  # effective DRAM bandwidth for decode compute

    def compute_ms_per_layer(self, shape: ModelShape) -> float:
        touched = shape.dense_bytes_per_layer + shape.top_k * shape.expert_bytes
        return touched / self.memory_bytes_per_s * 1e3


DEVICES = {
    # Jetson AGX Orin 64 GB: 204.8 GB/s LPDDR5, ~60% reachable by decode kernels.
    # Samsung 980 Pro on Orin's PCIe Gen4 x4: ~6.5 GB/s sequential; ~5 GB/s for multi-MB
    # reads at depth; ~0.1 ms to the first byte.
    "orin-980pro": DeviceModel("orin-980pro", "Jetson AGX Orin 64GB + Samsung 980 Pro (PCIe 4 x4)",
                               5.0e9, 0.10, 0.6 * 204.8e9),
    # Jetson Orin NX 16 GB: 102.4 GB/s LPDDR5; a PCIe Gen3 x4 NVMe at ~2.5 GB/s effective.
    "orin-nx-gen3": DeviceModel("orin-nx-gen3", "Jetson Orin NX 16GB + PCIe 3 x4 NVMe",
                                2.5e9, 0.12, 0.6 * 102.4e9),
}


def shape_for_trace(trace, model: str | None = None,
                    expert_bytes: int | None = None) -> ModelShape | None:
    """The shape profile named by ``model`` or by the trace's own model; for a model without
    one, a shape from ``expert_bytes`` (no dense weights counted) or None (hit rates only)."""
    name = model or trace.model
    if name in MODEL_SHAPES:
        shape = MODEL_SHAPES[name]
        return shape if expert_bytes is None else replace(shape, expert_bytes=expert_bytes)
    if model:
        raise TraceError(f"no model-shape profile {model!r} (choices: "
                         f"{', '.join(MODEL_SHAPES)})")
    if expert_bytes is None:
        return None
    return ModelShape(name or "custom", trace.num_layers, trace.num_experts, trace.top_k,
                      expert_bytes, 0)


def describe(device: DeviceModel, shape: ModelShape) -> dict:
    return {"device": asdict(device), "model": asdict(shape),
            "compute_ms_per_layer": round(device.compute_ms_per_layer(shape), 4)}


def token_time_ms(misses_per_token_layer: np.ndarray, device: DeviceModel,
                  shape: ModelShape) -> np.ndarray:
    """Time of each (token, layer) step: compute plus the wait for its demand misses."""
    misses = misses_per_token_layer.astype(np.float64)
    load = np.where(misses > 0, device.ssd_latency_ms
                    + misses * shape.expert_bytes / device.ssd_bytes_per_s * 1e3, 0.0)
    return device.compute_ms_per_layer(shape) + load


class SimulatedSSD:
    """The virtual clock's disk: one channel of ``ssd_bytes_per_s`` shared by every read,
    demand and prefetch alike (a prefetch is never free), ``ssd_latency_ms`` to the first byte,
    reads served in issue order. A read issued at ``now`` starts when both its latency has
    passed and the channel is free, and holds the channel for ``nbytes / bandwidth``; so a
    batch of m reads issued to an idle disk ends ``latency + m * bytes / bandwidth`` later,
    as in ``token_time_ms``."""

    def __init__(self, device: DeviceModel) -> None:
        self.latency_ms = device.ssd_latency_ms
        self.ms_per_byte = 1e3 / device.ssd_bytes_per_s
        self.free_at = 0.0

    def read(self, now: float, nbytes: int) -> float:
        """Issue one read at ``now``; returns its completion time (ms)."""
        start = max(now + self.latency_ms, self.free_at)
        self.free_at = start + nbytes * self.ms_per_byte
        return self.free_at

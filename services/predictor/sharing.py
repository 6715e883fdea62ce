"""What the predictor shares with its peers through the cluster (common/cluster.py carries it):
its network's weights in float16 (``predictor.safetensors``) and the hyper-parameters a peer
must match to use them (``predictor.json``); their shapes on this device; and the chosen
peer's weights written as a checkpoint ``Learner.load`` reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from common.checkpoints import write_durably, write_text_durably
from common.cluster import ArraySpecs, WarmStart
from common.config import PredictorConfig

from .core import LSTM_LAYERS, Learner
from .model import Net


def shared_arrays(layers: int, experts: int, dims: int, features: int,
                  config: PredictorConfig) -> tuple[ArraySpecs, dict]:
    """The predictor's shared weights on this device ({what: {array: (dtype, shape)}}) for
    inputs of ``dims`` per layer and ``features`` per expert, and the hyper-parameters a
    peer's ``predictor.json`` must have."""
    net = Net(layers, experts, dims, features, config.model, config.lstm_hidden, LSTM_LAYERS)
    weights = {f"net.{name}": (np.dtype(np.float16), tuple(value.shape))
               for name, value in net.state_dict().items()}
    meta = {"L": layers, "E": experts, "dims": dims, "features": features,
            "model": config.model, "hidden": config.lstm_hidden}
    return {"predictor.safetensors": weights}, meta


def learner_patterns(learner: Learner) -> tuple[dict[str, np.ndarray], dict]:
    """(weights as float16, meta) of a ``Learner``: what a peer needs to start from (not the
    EWC anchor or Fisher, which are this device's own history)."""
    weights = {f"net.{k}": v.detach().to(torch.float16).numpy().copy()
               for k, v in learner.net.state_dict().items()}
    meta = {"L": learner.L, "E": learner.E, "dims": learner.dims, "features": learner.features,
            "model": learner.config.model, "hidden": learner.config.lstm_hidden,
            "tokens": learner.t, "steps": learner.steps}
    return weights, meta


def write_predictor_checkpoint(warm: WarmStart, folder: str | Path) -> Path | None:
    """The chosen peer's predictor as a checkpoint folder ``Learner.load`` reads (weights back
    in float32); None when no peer had one."""
    if warm.predictor is None:
        return None
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: torch.from_numpy(v.astype(np.float32)) for k, v in warm.predictor.items()}
    write_durably(folder / "predictor.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    meta = warm.predictor_meta
    write_text_durably(folder / "predictor.json", json.dumps({
        "params": {"model": meta["model"], "hidden": meta["hidden"]}, "L": meta["L"],
        "E": meta["E"], "dims": meta["dims"], "features": meta["features"], "tokens": 0,
        "steps": int(meta.get("steps", 0)), "cluster": {"from": warm.source,
                                                        "tokens": warm.tokens}}))
    return folder

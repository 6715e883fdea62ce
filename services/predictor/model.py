"""The predictor's model: when is each expert needed next (Belady's question), as a
distribution over next-use-distance buckets, and the eviction estimate made from it.

Buckets of the distance in tokens from the token being predicted to the expert's next use
(1 = used in that token): 1, 2, 3-4, 5-8, ..., 129-256, more than 256.

The network, one step per token with the layers as the batch:
    h_l    = LSTM(z_l)            z_l: layer l's reduced feature vector (online PCA)
    logits = head_l(h_l)[expert] + x_k W_skip + bias_k     for every key k = (l, expert)
two heads of ``BUCKETS`` logits per key: A, the distance from this token; B, the distance
from the next token for an expert used in this one. ``core="linear"`` drops the LSTM (h = z):
the same inputs and heads, for the ablation.

The estimate (policies/scored.py): S = L * (D - 1), D the harmonic mean of the distance
(1 / E[1/dist] over the buckets' representative distances), in five variants: var 0 from
head A; var 1, an expert whose layer this token visited without using it: head A given
distance >= 2, shifted by one token; var 2, an expert used in this token: head B. Two more
serve a policy whose estimate is one token old (the next token began before the estimate for
it arrived), for an expert whose layer the next token visited without using it: var 3, used
in this token: head B given distance >= 2, shifted by one; var 4, not used in it: head A
given distance >= 3, shifted by two.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

EDGES = np.array([1, 2, 4, 8, 16, 32, 64, 128, 256], np.int64)  # bucket b: (EDGES[b-1], EDGES[b]]
BUCKETS = len(EDGES) + 1
REPS = np.array([1, 2, 3.5, 6.5, 12.5, 24.5, 48.5, 96.5, 192.5, 512.0], np.float32)
INV = (1.0 / REPS).astype(np.float32)
INV_SHIFTED = (1.0 / (REPS[1:] - 1.0)).astype(np.float32)  # given dist >= 2, a token later
INV_SHIFTED2 = (1.0 / (REPS[2:] - 2.0)).astype(np.float32)  # given dist >= 3, two tokens later
VARIANTS = 5
HEADS = 2


def bucket_of(distance: np.ndarray) -> np.ndarray:
    return np.searchsorted(EDGES, distance, side="left").astype(np.int64)


def bucket_nll(logits: torch.Tensor, bucket: torch.Tensor, censored: torch.Tensor
               ) -> torch.Tensor:
    """-log P(label) from logits (..., BUCKETS, N) and labels (..., N): P(the bucket), or
    P(bucket >= it) where censored (the next use lies beyond the window). One masked sum over
    the buckets (a third cheaper than gathers from a reversed cumulative sum)."""
    p = torch.softmax(logits, -2)
    b = torch.arange(p.shape[-2])[:, None]
    mask = torch.where(censored[..., None, :], b >= bucket[..., None, :],
                       b == bucket[..., None, :])
    return -torch.log((p * mask).sum(-2) + 1e-9)


# estimates() as one product: rows E[1/dist] of head A, of its tail given dist >= 2 shifted
# by one token, of head B, of head B's tail given dist >= 2 shifted by one, of head A's tail
# given dist >= 3 shifted by two; then the masses of those three tails.
_MIX = np.zeros((VARIANTS + 3, HEADS * BUCKETS), np.float32)
_MIX[0, :BUCKETS] = INV
_MIX[1, 1:BUCKETS] = INV_SHIFTED
_MIX[2, BUCKETS:] = INV
_MIX[3, BUCKETS + 1:] = INV_SHIFTED
_MIX[4, 2:BUCKETS] = INV_SHIFTED2
_MIX[5, 1:BUCKETS] = 1.0
_MIX[6, BUCKETS + 1:] = 1.0
_MIX[7, 2:BUCKETS] = 1.0


def estimates(P: np.ndarray, num_layers: int) -> np.ndarray:
    """(VARIANTS, N) S arrays from the bucket probabilities P (HEADS, BUCKETS, N) of heads A
    and B: S = L * (D - 1), D the harmonic mean of the distance, in the variants above."""
    R = _MIX @ P.reshape(HEADS * BUCKETS, -1)
    R[[1, 3, 4]] /= np.maximum(R[5:], 1e-9)
    S = num_layers / R[:VARIANTS]
    S -= num_layers
    return S.astype(np.float32, copy=False)


class Net(nn.Module):
    def __init__(self, num_layers: int, num_experts: int, dims: int, features: int,
                 core: str = "lstm", hidden: int = 64, lstm_layers: int = 2) -> None:
        super().__init__()
        if core not in ("lstm", "linear"):
            raise ValueError(f"predictor core must be lstm or linear, got {core!r}")
        self.L, self.E, self.core = num_layers, num_experts, core
        out = num_experts * HEADS * BUCKETS
        if core == "lstm":
            self.lstm = nn.LSTM(dims, hidden, lstm_layers)
            width = hidden
        else:
            self.lstm = None
            width = dims
        self.head = nn.Parameter(torch.zeros(num_layers, width, out))
        self.skip = nn.Parameter(torch.zeros(features, HEADS * BUCKETS))
        self.bias = nn.Parameter(torch.zeros(HEADS * BUCKETS, num_layers * num_experts))

    def fast_parameters(self) -> list[nn.Parameter]:
        """The per-key bias and the skip weights (a higher learning rate)."""
        return [self.skip, self.bias]

    def slow_parameters(self) -> list[nn.Parameter]:
        return [p for name, p in self.named_parameters() if name not in ("skip", "bias")]

    def forward(self, z: torch.Tensor, x: torch.Tensor, state=None):
        """z (T, L, dims), x (T, N, features) -> logits (T, HEADS, BUCKETS, N), LSTM state.
        Buckets come before keys: a softmax over a middle dimension of this shape is many
        times faster than over the last one of the transposed shape."""
        T, L, E = x.shape[0], self.L, self.E
        out = torch.einsum("tnf,fo->ton", x, self.skip) + self.bias
        h = z
        if self.lstm is not None:
            h, state = self.lstm(z, state)
        o = torch.einsum("tlh,lho->tlo", h, self.head)
        out = out + o.view(T, L, HEADS * BUCKETS, E).transpose(1, 2).reshape(
            T, HEADS * BUCKETS, L * E)
        return out.view(T, HEADS, BUCKETS, L * E), state

    @torch.no_grad()
    def recurrent_step(self, z: np.ndarray, state=None) -> tuple[np.ndarray, tuple | None]:
        """The layer vectors the heads read for one token, z (L, dims) -> h (L, width), and
        the new LSTM state (z itself without an LSTM). The LSTM runs as cells."""
        if self.lstm is None:
            return z, state
        inp = torch.from_numpy(z)
        if state is None:
            zeros = inp.new_zeros(self.lstm.num_layers, self.L, self.lstm.hidden_size)
            state = (zeros, zeros)
        hs, cs = [], []
        for k in range(self.lstm.num_layers):
            inp, c = torch.lstm_cell(inp, (state[0][k], state[1][k]),
                                     *self.lstm._flat_weights[4 * k:4 * k + 4])
            hs.append(inp)
            cs.append(c)
        return inp.numpy(), (torch.stack(hs), torch.stack(cs))

    @torch.no_grad()
    def step(self, z: np.ndarray, x: np.ndarray, state=None):
        """One token, for inference: z (L, dims), x (N, features) -> logits (HEADS, BUCKETS,
        N) as a numpy array, the new LSTM state. The same function as ``forward`` at T = 1 (to
        float rounding), at about half its CPU: the LSTM runs as cells, the rest as numpy
        products on views of the weights (a live predictor wakes with cold caches once a
        token, and then every torch dispatch costs several times its warm price). The
        reference of the fused C inference (fast_infer.py)."""
        L, E = self.L, self.E
        h, state = self.recurrent_step(z, state)
        out = self.skip.detach().numpy().T @ x.T  # (HEADS * BUCKETS, N)
        out += self.bias.detach().numpy()
        o = np.matmul(h[:, None, :], self.head.detach().numpy())  # (L, 1, HEADS*BUCKETS*E)
        out += o.reshape(L, HEADS * BUCKETS, E).transpose(1, 0, 2).reshape(HEADS * BUCKETS,
                                                                             L * E)
        return out.reshape(HEADS, BUCKETS, L * E), state

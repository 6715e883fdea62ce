"""The tiny checkpoints' families, how their stores are written, and the tensors a store must give
back for an expert."""

from __future__ import annotations

from pathlib import Path

from common.store import ExpertStore, block_location, stripe_name

FAMILIES = ("qwen3_moe", "olmoe", "mixtral")
# Small blocks so that every expert spans several blocks and every stripe.
TEST_BLOCK_SIZE = 8192
TEST_PARALLELISM = 3


def expected_expert_tensors(checkpoint: Path, store: ExpertStore, layer: int, expert: int) -> dict:
    """The checkpoint's own tensors for one expert, read with the safetensors library."""
    from safetensors import safe_open

    out = {}
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            for t in store.expert(layer, expert).tensors:
                if t.key in keys:
                    out[t.name] = f.get_tensor(t.key)
    return out


def flip_byte(store_path, layer, expert, block_index=0):
    """Flip one bit of an expert's block in a store (a bad block); returns the block's index."""
    store = ExpertStore.open(store_path)
    e = store.expert(layer, expert)
    stripe, offset = block_location(e.first_block + block_index, store.manifest.block_size,
                                    store.manifest.parallelism)
    with open(store_path / stripe_name(stripe), "r+b") as f:
        f.seek(offset + 7)
        byte = f.read(1)
        f.seek(offset + 7)
        f.write(bytes([byte[0] ^ 0x01]))
    return e.first_block + block_index

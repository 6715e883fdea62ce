"""`flashmoe generate` on a store with corrupt blocks: the services start, the first load fails
its checksum, and the command ends with one line naming the block and `flashmoe verify`, not a
traceback; every process it started is gone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from common.store import ExpertStore, block_location, stripe_name

ROOT = Path(__file__).resolve().parents[2]


def corrupt_every_block(store_path: Path) -> None:
    with ExpertStore.open(store_path) as store:
        m = store.manifest
        for block in range(len(m.block_crc)):
            stripe, offset = block_location(block, m.block_size, m.parallelism)
            with open(store_path / stripe_name(stripe), "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupt_block_ends_generate_with_one_line(store_copy, tmp_path):
    corrupt_every_block(store_copy)
    done = subprocess.run([sys.executable, "-m", "flashmoe", "generate", "--store",
                           str(store_copy), "--prompt", "hello", "--max-new-tokens", "2",
                           "--home", str(tmp_path / "home")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    err = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(err) <= 3, done.stderr
    assert err[-1].startswith(f"flashmoe generate: error: {store_copy}: checksum: layer ")
    assert f"`flashmoe verify {store_copy}`" in err[-1]
    leftover = subprocess.run(["pgrep", "-f", str(store_copy)], capture_output=True, text=True)
    assert leftover.stdout == ""

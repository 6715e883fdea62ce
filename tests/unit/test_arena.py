"""The shared-memory arena: safe names, memory reserved up front, stale arenas swept."""

import errno
import fcntl
import os
import subprocess
import sys

import pytest

from common import arena as arena_module
from common.arena import Arena, ArenaSpaceError, arena_bytes, sweep_stale_arenas


@pytest.fixture
def shm_dir(tmp_path, monkeypatch):
    """A private SHM_DIR, so that no test touches the real /dev/shm's other files."""
    monkeypatch.setattr(arena_module, "SHM_DIR", tmp_path)
    return tmp_path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    try:
        os.kill(proc.pid, 0)
    except ProcessLookupError:
        return proc.pid
    pytest.skip(f"pid {proc.pid} was reused at once; cannot make a dead owner")


@pytest.mark.parametrize("name, why", [
    ("../etc/passwd", "path separator"),
    ("a/b", "path separator"),
    ("..", "contains '..'"),
    ("flashmoe-1..2", "contains '..'"),
    ("", "empty"),
    ("with space", r"outside \[A-Za-z0-9._-\]"),
    ("a\\b", r"outside \[A-Za-z0-9._-\]"),
    ("na\u00efve", r"outside \[A-Za-z0-9._-\]"),
    (".", "the shared-memory folder itself"),
])
def test_attach_refuses_names_that_are_not_one_plain_file(shm_dir, name, why):
    with pytest.raises(ValueError, match=why):
        Arena.attach(name, 4096, 1)


def test_create_and_attach_share_the_bytes(shm_dir):
    owner = Arena.create(2, 5000)
    try:
        assert owner.slot_bytes == 8192 and owner.name.startswith(f"flashmoe-{os.getpid()}-")
        owner.slot(1)[:3] = b"abc"
        worker = Arena.attach(owner.name, owner.slot_bytes, owner.n_slots)
        assert bytes(worker.slot(1)[:3]) == b"abc"
        worker.close()
        assert owner.path.exists()  # only the owner removes it
    finally:
        owner.close()
    assert not owner.path.exists()


def test_create_reserves_the_memory_up_front():
    if not arena_module.SHM_DIR.is_dir():
        pytest.skip(f"{arena_module.SHM_DIR} does not exist on this machine")
    arena = Arena.create(4, 64 * 1024)
    try:
        assert os.stat(arena.path).st_blocks * 512 >= 4 * 64 * 1024
    finally:
        arena.close()


def test_too_small_shm_fails_at_creation_with_sizes_and_a_remedy(shm_dir, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(ArenaSpaceError) as err:
        Arena.create(1000, 1 << 20)
    message = str(err.value)
    fs = os.statvfs(shm_dir)
    assert f"{arena_bytes(1 << 20, 1000)} bytes (0.98 GiB) wanted" in message
    assert f"{fs.f_bavail * fs.f_frsize} bytes" in message and "free" in message
    assert "cache.capacity_experts" in message and "shm_size" in message
    assert err.value.errno == errno.ENOSPC
    assert list(shm_dir.iterdir()) == []  # the partly made file is gone


def test_other_reservation_errors_pass_through_and_clean_up(shm_dir, monkeypatch):
    def broken(fd, offset, length):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "posix_fallocate", broken)
    with pytest.raises(OSError) as err:
        Arena.create(1, 4096)
    assert err.value.errno == errno.EIO and not isinstance(err.value, ArenaSpaceError)
    assert list(shm_dir.iterdir()) == []


def test_sweep_removes_only_arenas_of_dead_owners(shm_dir):
    dead, live = dead_pid(), os.getpid()
    stale = [f"flashmoe-{dead}-0123abcd", f"flashmoe-iobench-{dead}-89abcdef"]
    kept = [f"flashmoe-{live}-0123abcd",  # live owner
            f"other-{dead}-0123abcd",  # another prefix
            f"flashmoe-{dead}-xyz", f"flashmoe-{dead}-0123abcd.bak", "flashmoe-notes",
            f"flashmoeextra-{dead}-0123abcd", f"flashmoe-{dead}-0123ABCD",
            f"flashmoe-{10**30}-0123abcd"]  # not a pid
    for name in stale + kept:
        (shm_dir / name).write_bytes(b"x")
    # An owner whose pid this process cannot see (another PID namespace) still holds its lock.
    locked = f"flashmoe-{dead}-fedcba98"
    (shm_dir / locked).write_bytes(b"x")
    lock_fd = os.open(shm_dir / locked, os.O_RDONLY)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    arena = Arena.create(1, 4096)
    try:
        assert sweep_stale_arenas() == sorted(stale)
        assert sorted(p.name for p in shm_dir.iterdir()) == sorted(kept + [locked, arena.name])
        assert sweep_stale_arenas() == []
    finally:
        arena.close()
        os.close(lock_fd)
    assert sweep_stale_arenas() == [locked]  # its owner's lock went with it


def test_sweep_with_another_prefix(shm_dir):
    dead = dead_pid()
    for name in (f"flashmoe-{dead}-0123abcd", f"bench-{dead}-0123abcd"):
        (shm_dir / name).write_bytes(b"")
    assert sweep_stale_arenas(prefix="bench") == [f"bench-{dead}-0123abcd"]
    assert [p.name for p in shm_dir.iterdir()] == [f"flashmoe-{dead}-0123abcd"]


def test_slot_load_counts_are_shared_and_outside_the_slots():
    arena = Arena.create(3, 4096)
    worker = Arena.attach(arena.name, arena.slot_bytes, arena.n_slots)
    try:
        arena.slot(2)[:] = b"\xff" * 4096
        assert list(worker.generations) == [0, 0, 0]
        arena.generations[1] += 1
        assert list(worker.generations) == [0, 1, 0]
        assert os.stat(arena.path).st_size == arena_bytes(4096, 3) > 3 * 4096
    finally:
        worker.close()
        arena.close()

"""`flashmoe chaos`'s hold on real processes: the target's process tree, the throttled block-IO
cgroup it starts, the loop-mounted disk a store copy may live on, and what a run can leave
behind (its redis-server is ``local.RedisServer``).

``ProcessTree`` walks /proc every ``POLL_S`` for the target's descendants and remembers every
one it saw by (pid, start time): a pid is only ever signalled while its start time is still
the one seen, so a reused pid of another program is never touched, and a descendant that
outlives the target (re-parented to init) is still known. Services are told apart by their
command line (``python -m flashmoe serve-cache ...``, see ``ROLES``).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

POLL_S = 0.5
SHM_DIR = Path("/dev/shm")
ARENA_NAME = re.compile(r"flashmoe(?:-.+)?-([0-9]+)-[0-9a-f]{8}")
BLKIO_ROOT = Path("/sys/fs/cgroup/blkio")
# The `flashmoe` subcommand of each service process -> its role in the chaos matrix.
ROLES = {"serve-cache": "cache_manager", "serve-features": "feature_extractor",
         "serve-predictor": "predictor", "serve-panel": "panel", "trace-worker": "worker",
         "serve-worker": "worker"}


@dataclass
class Seen:
    pid: int
    start: int  # start time in clock ticks since boot (/proc/PID/stat field 22)
    argv: list[str]

    @property
    def role(self) -> str | None:
        if "flashmoe" not in self.argv:
            return None
        words = self.argv[self.argv.index("flashmoe") + 1:]
        return ROLES.get(words[0]) if words else None


def proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state letter) of a live process; None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[19]), fields[0]


def held_threads(pid: int) -> list[tuple[str, str]]:
    """The threads still alive of a process whose main thread has exited (a zombie leader):
    (name, state letter) each, e.g. io_uring's ``iou-wrk-PID`` workers in a read the kernel
    cannot cancel. Such a process cannot be reaped until they end. Empty otherwise."""
    stat = proc_stat(pid)
    if stat is None or stat[2] != "Z":
        return []
    held = []
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    except OSError:
        return []
    for tid in tids:  # /proc/TID is a thread's own entry
        stat = proc_stat(tid)
        try:
            comm = Path(f"/proc/{tid}/comm").read_text().strip()
        except OSError:
            continue
        if stat is not None and stat[2] != "Z":
            held.append((comm, stat[2]))
    return held


def proc_argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def fd_kinds(pid: int) -> collections.Counter | None:
    """A process's open fds by kind (``socket``, ``pipe``, ``anon_inode:[eventfd]``, a file's
    folder); None when it is gone."""
    kinds: collections.Counter = collections.Counter()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        kinds[target.split(":[")[0] if target.startswith(("socket:", "pipe:")) else
              target if target.startswith("anon_inode:") else str(Path(target).parent)] += 1
    return kinds


class ProcessTree:
    """The target and every descendant seen since it started, polled on a thread."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.seen: dict[int, Seen] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.scan()
        self.thread = threading.Thread(target=self._poll, name="chaos-proc-tree", daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stopping.wait(POLL_S):
            self.scan()

    def scan(self) -> None:
        parents: dict[int, list[int]] = {}
        starts: dict[int, int] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            stat = proc_stat(int(name))
            if stat is not None:
                parents.setdefault(stat[0], []).append(int(name))
                starts[int(name)] = stat[1]
        with self.lock:
            known = {pid for pid, s in self.seen.items() if starts.get(pid) == s.start}
            todo = [self.root, *known]
            while todo:
                pid = todo.pop()
                if pid not in starts:
                    continue
                if pid not in self.seen or self.seen[pid].start != starts[pid]:
                    self.seen[pid] = Seen(pid, starts[pid], proc_argv(pid))
                todo.extend(c for c in parents.get(pid, ()) if c not in self.seen or
                            self.seen[c].start != starts.get(c))

    def close(self) -> None:
        self.stopping.set()
        self.thread.join()

    def alive(self, include_root: bool = True) -> list[Seen]:
        """Processes seen that still run (same pid and start time), zombies excepted."""
        with self.lock:
            seen = list(self.seen.values())
        out = []
        for s in seen:
            stat = proc_stat(s.pid)
            if stat is not None and stat[1] == s.start and stat[2] != "Z" and \
                    (include_root or s.pid != self.root):
                out.append(s)
        return out

    def service(self, role: str) -> Seen | None:
        """The newest live process of a role."""
        live = [s for s in self.alive() if s.role == role]
        return max(live, key=lambda s: s.start) if live else None

    def runtime_dir(self) -> Path | None:
        """The services' runtime folder: where their ``--config`` file lives."""
        with self.lock:
            seen = list(self.seen.values())
        for s in seen:
            if s.role and "--config" in s.argv:
                return Path(s.argv[s.argv.index("--config") + 1]).parent
        return None

    def signal(self, s: Seen, sig: int) -> bool:
        """Send ``sig`` to a process seen, if it is still that process."""
        stat = proc_stat(s.pid)
        if stat is None or stat[1] != s.start:
            return False
        try:
            os.kill(s.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def kill_all(self) -> list[Seen]:
        """SIGKILL (after SIGCONT) whatever of the tree still runs; returns what was left."""
        left = self.alive()
        for s in left:
            self.signal(s, signal.SIGCONT)
            self.signal(s, signal.SIGKILL)
        return left


def arena_pids() -> dict[str, int]:
    """The flashmoe arenas in /dev/shm and the pid named in each."""
    out = {}
    for path in SHM_DIR.iterdir():
        match = ARENA_NAME.fullmatch(path.name)
        if match:
            out[path.name] = int(match.group(1))
    return out


def sockets_under(*folders: Path) -> list[Path]:
    found = []
    for folder in folders:
        if folder.is_dir():
            found += [p for p in folder.rglob("*") if p.is_socket()]
    return found


class LoopDisk:
    """An ext4 file system in an image file, mounted through a loop device at ``mount``: a
    block device of its own for a target's store copy. Throttling its reads slows the store
    and nothing else; on the disk that also holds the program, a failing service that faults
    in a page of its code or reads a module not in the page cache would wait for it at the
    throttled rate too. Needs root, ``mkfs.ext4`` and a free loop device (``OSError`` else);
    ``close`` unmounts it (the loop device goes with it) and deletes the image."""

    def __init__(self, image: Path, mount: Path, size_bytes: int) -> None:
        self.image, self.mount = image, mount
        with open(image, "wb") as f:
            f.truncate(size_bytes)
        mount.mkdir()
        try:
            for command in (["mkfs.ext4", "-q", "-F", str(image)],
                            ["mount", "-o", "loop", str(image), str(mount)]):
                out = subprocess.run(command, capture_output=True, text=True)
                if out.returncode != 0:
                    raise OSError(f"{command[0]}: {out.stderr.strip() or out.returncode}")
        except (OSError, FileNotFoundError):
            self.close()
            raise

    def close(self) -> None:
        if os.path.ismount(self.mount):
            subprocess.run(["umount", str(self.mount)], capture_output=True)
        if not os.path.ismount(self.mount):
            self.image.unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                self.mount.rmdir()


class ThrottledReads:
    """A blkio cgroup (cgroup v1) that limits reads from one block device to ``bps`` bytes a
    second; processes moved into it read slowly for real, O_DIRECT included, and their children
    too. ``close`` moves whatever is left back and removes the group."""

    def __init__(self, device_of: Path, bps: int) -> None:
        st = os.stat(device_of)
        major, minor = os.major(st.st_dev), os.minor(st.st_dev)
        if not (BLKIO_ROOT / "blkio.throttle.read_bps_device").exists():
            raise RuntimeError(f"no cgroup v1 blkio controller at {BLKIO_ROOT}")
        if major == 0:
            raise RuntimeError(f"{device_of} is not on a block device (st_dev {major}:{minor})")
        self.group = BLKIO_ROOT / f"flashmoe-chaos-{os.getpid()}-{time.monotonic_ns()}"
        self.group.mkdir()
        (self.group / "blkio.throttle.read_bps_device").write_text(f"{major}:{minor} {bps}")

    def add(self, pid: int) -> None:
        (self.group / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        if not self.group.exists():
            return
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for pid in (self.group / "cgroup.procs").read_text().split():
                try:
                    (BLKIO_ROOT / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            try:
                self.group.rmdir()
                return
            except OSError:
                time.sleep(0.2)

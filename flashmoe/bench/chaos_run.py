"""One run of `flashmoe chaos`: a fresh target under load, one fault, recovery, stop, leaks.

The phases, each bounded:

1. start the target (`flashmoe run --loop` replaying a trace, or `flashmoe serve` with a client
   sending completions) in a folder of its own: its ``--home``, a copy of the store, and its
   ``TMPDIR`` (so its runtime folder is made there);
2. ready: every service process up, the control sockets answering, load flowing (run: the cache
   manager's acquires growing; serve: ``/health``), the verifier and the client answered right;
3. the fault, at a random moment (``Fault.inject``);
4. recovered: every service has a live, not stopped process answering its health check, the
   panel answers, the load makes progress again, and a verifier that joined after the fault
   (a new worker) got right bytes; the time from the fault to that is the recovery time;
5. a few more seconds under load, then the target gets SIGTERM and must exit 0;
6. leaks: processes of its tree still alive, socket files left in its folder, arenas in
   /dev/shm named after one of its processes, the fds the cache manager and the worker hold
   after recovery beyond what they held before the fault (when the fault did not replace
   them; the least of a few samples each time), and a runtime folder left after a clean
   exit.
"""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from common.bus import ServiceUnavailable, control_endpoint_for, health, ipc_endpoint, stats
from common.config import load_config
from flashmoe.bench.chaos_faults import Fault
from flashmoe.bench.chaos_probes import ServeLoad, TrueBytes, Verifier
from flashmoe.bench.chaos_procs import (LoopDisk, ProcessTree, arena_pids, fd_kinds,
                                        held_threads, proc_stat, sockets_under)
from flashmoe.bench.local import RedisServer, free_port
from flashmoe.runtime.launch import child_env, cli_command

READ_TIMEOUT_S = 2.0  # io.read_timeout_s of every target
HEARTBEAT_TIMEOUT_S = 2.0  # ipc.heartbeat_timeout_s of every target
START_TIMEOUT_S = 180.0
WARM_TIMEOUT_S = 60.0
RECOVER_TIMEOUT_S = 45.0  # longer without recovery, with the target alive: a hang
OBSERVE_S = 4.0  # under load after recovery, before the stop
STOP_TIMEOUT_S = 40.0  # longer to exit after SIGTERM: a hang
FAULT_AFTER_S = (0.3, 2.0)  # the fault comes this long (uniform) after the target is warm
FD_SAMPLES = 5
ROLES = ("cache_manager", "feature_extractor", "predictor", "panel", "worker")
SETTINGS = (f"io.read_timeout_s={READ_TIMEOUT_S:g}", "ipc.heartbeat_interval_s=0.5",
            f"ipc.heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S:g}", "ipc.handshake_timeout_s=3",
            "ipc.acquire_timeout_s=10")
RUN_CAPACITY = 64  # of the run store's 768 experts: loads go on all the time
SERVE_CAPACITY = 8  # of the tiny model's 16 experts
TOKEN_MS = 20.0
LOOP_DISK_SLACK_BYTES = 32 << 20  # ext4's own blocks, beyond a quarter more than the store


@dataclass
class Assets:
    """What every run of a target starts from (made once per `flashmoe chaos`)."""
    target: str  # "run" or "serve"
    store: Path  # the untouched original; each run copies it
    focus: tuple[int, int]  # the expert corrupt-block damages (and the verifier asks for)
    warmup: Path | None = None
    trace: str | None = None


@dataclass
class RunResult:
    recovered: bool = False
    hangs: int = 0
    wrong_bytes: int = 0
    degraded: int = 0  # serve's answers declared computed without a bad expert
    leaks: dict[str, int] = field(default_factory=dict)
    leak_examples: list[str] = field(default_factory=list)
    recover_s: float | None = None
    wall_s: float = 0.0
    probes: dict[str, dict[str, int]] = field(default_factory=dict)  # outcomes by probe
    notes: list[str] = field(default_factory=list)  # why it failed
    events: list[str] = field(default_factory=list)  # what the fault did


class ChaosRun:
    def __init__(self, assets: Assets, fault: Fault, folder: Path, seed: int,
                 keep_logs: bool = False) -> None:
        self.assets, self.fault, self.folder = assets, fault, folder
        self.keep_logs = keep_logs  # copy the services' logs into the run's folder at the end
        self.rng = random.Random(seed)
        self.result = RunResult()
        self.read_timeout_s, self.heartbeat_timeout_s = READ_TIMEOUT_S, HEARTBEAT_TIMEOUT_S
        self.store_copy = folder / "store"
        self.truth = TrueBytes(assets.store)
        self.proc: subprocess.Popen | None = None
        self.tree: ProcessTree | None = None
        self.verifier: Verifier | None = None
        self.load: ServeLoad | None = None
        self.redis: RedisServer | None = None
        self.throttle = None
        self.disk: LoopDisk | None = None
        self.victim = None
        self.panel_port = free_port()
        self.serve_port = free_port()
        self.progress: list[tuple[float, int, int]] = []  # (time, manager pid, n_acquire)
        self.cluster: list[tuple[float, bool]] = []  # (time, every link connected)
        self.cluster_outage_seen = False
        self.redis_back = 0.0

    def note(self, text: str) -> None:
        """Why the run failed (one of the reasons)."""
        self.result.notes.append(text)

    def event(self, text: str) -> None:
        """What the fault did."""
        self.result.events.append(text)

    # --- the run ----------------------------------------------------------------------------

    def execute(self) -> RunResult:
        started = time.monotonic()
        r = self.result
        exited_early = False
        try:
            self.start()
            if self.wait(self.ready, START_TIMEOUT_S, "ready") and self.warm():
                fds_before = self.fd_counts()
                time.sleep(self.rng.uniform(*FAULT_AFTER_S))
                before = self.pids()
                t0 = self.fault.inject(self)
                self.verifier.reconnect()
                if self.wait(lambda: self.healthy_since(t0), RECOVER_TIMEOUT_S, "recovered"):
                    r.recover_s = round(time.monotonic() - t0, 3)
                    time.sleep(OBSERVE_S)
                    self.count_fds(fds_before, self.fd_counts())
                    self.check_survivors(before)
                    effect = self.fault.took_effect(self)
                    if effect:
                        self.note(f"fault not in effect: {effect}")
            exited_early = self.proc.poll() is not None
        except Exception as exc:  # noqa: BLE001 - a run that breaks is a failed run, reported
            self.note(f"chaos error: {type(exc).__name__}: {exc}")
        finally:
            self.close_probes()
            if self.keep_logs:
                self.copy_logs()
            rc = self.stop()
            self.count_leaks(rc)
            self.close_helpers()
        if exited_early:
            self.note(f"the target exited by itself (status {rc}): {self.log_tail()}")
        elif rc not in (0, None):
            self.note(f"the target exited {rc} on SIGTERM: {self.log_tail()}")
        untyped = self.untyped()
        if untyped:
            self.note(f"requests without an answer or a typed error: {untyped}")
        r.recovered = (r.recover_s is not None and rc == 0 and not exited_early and not untyped
                       and not any(n.startswith(("fault not", "chaos error", "not "))
                                   for n in r.notes))
        r.wall_s = round(time.monotonic() - started, 1)
        return r

    # --- start and readiness ----------------------------------------------------------------

    def start(self) -> None:
        if self.fault.own_disk:
            self.place_store_on_own_disk()
        shutil.copytree(self.assets.store, self.store_copy)
        if self.disk is not None:
            os.sync()  # a direct read of a page still dirty from the copy waits for its write
        home, tmp = self.folder / "home", self.folder / "tmp"
        tmp.mkdir()
        settings = [*SETTINGS, f"panel.port={self.panel_port}", *self.fault.settings]
        if self.fault.needs_redis:
            self.redis = RedisServer("--dir", str(self.folder), "--protected-mode", "yes").start()
            settings.append(f"cluster.redis_url={self.redis.url}")
        if self.assets.target == "run":
            words = ["run", "--store", str(self.store_copy), "--trace", self.assets.trace,
                     "--warmup", str(self.assets.warmup), "--home", str(home), "--loop",
                     "--capacity", str(RUN_CAPACITY), "--token-ms", f"{TOKEN_MS:g}"]
        else:
            words = ["serve", str(self.store_copy), "--home", str(home), "--capacity",
                     str(SERVE_CAPACITY)]
            settings.append(f"serve.port={self.serve_port}")
        for item in settings:
            words += ["--set", item]
        env = {**child_env(), "TMPDIR": str(tmp), **self.fault.env}
        with open(self.folder / "target.log", "wb") as log:
            self.proc = subprocess.Popen(cli_command(*words), env=env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        self.tree = ProcessTree(self.proc.pid)

    def wait(self, condition, timeout_s: float, what: str) -> bool:
        """Poll ``condition`` until true; a target that exits first is not a hang, one that
        stays alive past ``timeout_s`` is."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.note(f"the target exited (status {self.proc.returncode}) before it was "
                          f"{what}")
                return False
            if condition():
                return True
            time.sleep(0.25)
        self.result.hangs += 1
        self.note(f"not {what} within {timeout_s:g} s: {self.why_not()}")
        return False

    def runtime(self) -> Path | None:
        return self.tree.runtime_dir()

    def control(self, role: str) -> str:
        return control_endpoint_for(ipc_endpoint(self.runtime(), role))

    def missing_roles(self) -> list[str]:
        out = []
        for role in ROLES:
            s = self.tree.service(role)
            if s is None or (proc_stat(s.pid) or (0, 0, "T"))[2] == "T":
                out.append(role)
        return out

    def services_answer(self) -> bool:
        if self.missing_roles() or self.runtime() is None:
            return False
        try:
            for role in ("cache_manager", "feature_extractor", "predictor"):
                health(self.control(role), timeout_s=1.0)
        except ServiceUnavailable:
            return False
        return self.http_ok(f"http://127.0.0.1:{self.panel_port}/")

    def http_ok(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return reply.status == 200
        except OSError:
            return False

    def sample_progress(self) -> None:
        manager = self.tree.service("cache_manager")
        try:
            n = stats(self.control("cache_manager"), timeout_s=1.0)["n_acquire"]
        except (ServiceUnavailable, KeyError):
            return
        if manager is not None:
            self.progress.append((time.monotonic(), manager.pid, n))

    def progress_since(self, t: float) -> bool:
        after = [(pid, n) for when, pid, n in self.progress if when > t]
        return any(p1 == p2 and n2 > n1 for (p1, n1), (p2, n2) in zip(after, after[1:]))

    def sample_cluster(self, outage: bool = False) -> None:
        links = []
        for role in ("feature_extractor", "predictor"):
            try:
                links.append(stats(self.control(role), timeout_s=1.0).get("cluster_state"))
            except ServiceUnavailable:
                links.append(None)
        connected = all(state == "connected" for state in links)
        self.cluster.append((time.monotonic(), connected))
        if outage and any(state not in (None, "connected") for state in links):
            self.cluster_outage_seen = True

    def cluster_connected_since(self, t: float) -> bool:
        self.sample_cluster()
        return any(ok for when, ok in self.cluster if when > t + 1.0)

    def ready(self) -> bool:
        if not self.services_answer():
            return False
        if self.assets.target == "serve":
            return self.http_ok(f"http://127.0.0.1:{self.serve_port}/health")
        self.sample_progress()
        return bool(self.progress) and self.progress[-1][2] > 0 and \
            (not self.fault.needs_redis or self.cluster_connected_since(0.0))

    def warm(self) -> bool:
        """Start the probes; true once they were answered right."""
        config = load_config(file=self.runtime() / "config.json", env={})
        self.verifier = Verifier(ipc_endpoint(self.runtime(), "cache_manager"), config,
                                 self.truth, self.rng.randrange(1 << 30))
        self.verifier.focus = self.assets.focus
        if self.assets.target == "serve":
            self.load = ServeLoad(f"http://127.0.0.1:{self.serve_port}", self.store_copy.name)

        def answered() -> bool:
            if self.assets.target == "run":
                self.sample_progress()
            return self.verifier.out.counts.get("ok", 0) >= 3 and \
                (self.load is None or self.load.ready())
        if not self.wait(answered, WARM_TIMEOUT_S, "answering right under load"):
            return False
        if self.assets.target == "serve":
            # /stats asks the predictor through a ZeroMQ context made at its first use: made
            # now, it is not counted as fds grown after the fault
            self.http_ok(f"http://127.0.0.1:{self.serve_port}/stats")
        return True

    def healthy_since(self, t0: float) -> bool:
        if not self.services_answer():
            return False
        if self.assets.target == "run":
            self.sample_progress()
            if not self.progress_since(t0):
                return False
        elif self.load.out.last_ok_started <= t0:
            return False
        return self.verifier.ok_since(t0) and self.fault.recovered(self)

    def why_not(self) -> str:
        parts = []
        if self.missing_roles():
            parts.append(f"missing or stopped: {', '.join(self.missing_roles())}")
        held = held_threads(self.victim.pid) if self.victim is not None else []
        if held:
            states = collections.Counter(f"{name.split('-')[0]}-* {state}" if "-" in name
                                         else f"{name} {state}" for name, state in held)
            parts.append(f"the {self.victim.role} {self.victim.pid} the fault hit: main thread "
                         f"exited, held by the kernel in {dict(states)}")
        if self.verifier is not None:
            v = self.verifier
            parts.append(f"verifier {v.out.counts} {v.out.notes[:2]}" +
                         (f" connect: {v.connect_errors[-1]}" if v.connect_errors else ""))
        if self.load is not None:
            parts.append(f"client {self.load.out.counts} {self.load.out.notes[:2]}")
        return "; ".join(parts) or "-"

    def pids(self) -> dict[str, int]:
        return {role: s.pid for role in ROLES if (s := self.tree.service(role)) is not None}

    def check_survivors(self, before: dict[str, int]) -> None:
        after = self.pids()
        for role, pid in before.items():
            if role not in self.fault.replaces and after.get(role) != pid:
                self.note(f"fault not contained: the {role} exited (pid {pid} -> "
                          f"{after.get(role)}; see its log)")

    # --- measures ---------------------------------------------------------------------------

    def fd_counts(self) -> dict[str, tuple[int, collections.Counter]]:
        """(pid, its fds by kind at the sample with the fewest) of the cache manager and the
        worker, over a few samples, with no completion in flight (its connection is not
        counted)."""
        if self.load is not None:
            self.load.pause()
        out = {}
        for role in ("cache_manager", "worker"):
            s = self.tree.service(role)
            samples = []
            for _ in range(FD_SAMPLES):
                kinds = fd_kinds(s.pid) if s is not None else None
                if kinds is not None:
                    samples.append(kinds)
                time.sleep(0.1)
            if samples:
                out[role] = (s.pid, min(samples, key=lambda k: k.total()))
        if self.load is not None:
            self.load.resume()
        return out

    def count_fds(self, before: dict, after: dict) -> None:
        # A process the fault replaced is another process: only a survivor's growth is a leak.
        grown = {role: after[role][1].total() - before[role][1].total() for role in before
                 if role in after and after[role][0] == before[role][0]}
        grown = {role: n for role, n in grown.items() if n > 0}
        if grown:
            self.result.leaks["fds"] = sum(grown.values())
            for role in grown:
                self.result.leak_examples.append(
                    f"{role} fds grown by {grown[role]}: {dict(after[role][1] - before[role][1])}")

    def untyped(self) -> dict[str, int]:
        out = {}
        for name, probe in (("verifier", self.verifier), ("client", self.load)):
            if probe is None:
                continue
            counts = probe.out.counts
            bad = counts.get("untyped", 0) + \
                (counts.get("refused", 0) if not self.fault.api_down_expected else 0)
            if bad:
                out[name] = bad
        return out

    def checkpoint_dirs(self) -> list[Path]:
        runtime = self.runtime()
        folders = [runtime / "predictor-checkpoint"] if runtime else []
        folders += [p for p in (self.folder / "home" / "stores").glob("*/*") if p.is_dir()]
        return folders

    def log_tail(self, lines: int = 3) -> str:
        try:
            text = (self.folder / "target.log").read_text(errors="replace").strip()
        except OSError:
            return "(no log)"
        return " | ".join(text.splitlines()[-lines:])

    def copy_logs(self) -> None:
        """The services' logs as they are before the stop (a clean exit removes them)."""
        runtime = self.runtime()
        if runtime is not None and runtime.is_dir():
            (self.folder / "logs").mkdir(exist_ok=True)
            for log in runtime.glob("*.log"):
                shutil.copy(log, self.folder / "logs" / log.name)

    # --- the end ----------------------------------------------------------------------------

    def close_probes(self) -> None:
        for probe in (self.verifier, self.load):
            if probe is not None:
                probe.close()
        for name, probe in (("verifier", self.verifier), ("client", self.load)):
            if probe is None:
                continue
            self.result.probes[name] = dict(probe.out.counts)
            self.result.hangs += probe.out.counts.get("hang", 0)
            self.result.wrong_bytes += probe.out.wrong_bytes
            if probe.out.counts.get("wrong") or probe.out.counts.get("hang"):
                self.note(f"{name}: {probe.out.counts} {probe.out.notes}")
            degraded = probe.out.counts.get("degraded", 0)
            self.result.degraded += degraded
            if degraded and not self.fault.degrades:
                self.note(f"not expected: {degraded} answers computed without some experts "
                          f"(X-FlashMoE-Routed-Around) under {self.fault.name}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.throttle is not None:
            self.throttle.close()  # nothing stays slow while the target stops
            self.throttle = None
        if self.tree is not None:
            for s in self.tree.alive():
                self.tree.signal(s, signal.SIGCONT)  # a worker frozen by a failed run
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.result.hangs += 1
            self.note(f"the target did not exit within {STOP_TIMEOUT_S:g} s of SIGTERM")
            self.tree.kill_all()
            self.proc.wait()
            return None

    def count_leaks(self, rc: int | None) -> None:
        if self.tree is None:
            return
        time.sleep(0.5)
        self.tree.scan()
        self.tree.close()
        leaks, examples = self.result.leaks, self.result.leak_examples
        left = self.tree.kill_all()
        if left:
            leaks["processes"] = len(left)
            examples.append("processes: " + ", ".join(f"{s.role or s.argv[:3]} {s.pid}"
                                                      for s in left))
        pids = set(self.tree.seen)
        arenas = [name for name, pid in arena_pids().items() if pid in pids]
        for name in arenas:
            (Path("/dev/shm") / name).unlink(missing_ok=True)
        if arenas:
            leaks["shm"] = len(arenas)
            examples.append(f"shm: {arenas}")
        socks = sockets_under(self.folder)
        if socks:
            leaks["sockets"] = len(socks)
            examples.append(f"sockets: {[p.name for p in socks][:4]}")
        runtime = self.tree.runtime_dir()
        if rc == 0 and runtime is not None and runtime.exists():
            leaks["runtime_dirs"] = 1
            examples.append(f"runtime folder kept after a clean exit: "
                            f"{sorted(p.name for p in runtime.iterdir())[:6]}")

    def place_store_on_own_disk(self) -> None:
        """The store copy on a loop device of its own; where none can be made (not root, no
        mkfs.ext4), on the folder's disk, said in the run's events."""
        size = sum(p.stat().st_size for p in self.assets.store.rglob("*") if p.is_file())
        try:
            self.disk = LoopDisk(self.folder / "disk.img", self.folder / "disk",
                                 int(size * 1.25) + LOOP_DISK_SLACK_BYTES)
        except OSError as exc:
            self.event(f"the store copy shares the program's disk (no loop device: {exc})")
            return
        self.store_copy = self.disk.mount / "store"

    def close_helpers(self) -> None:
        if self.redis is not None:
            self.redis.stop()
        if self.disk is not None:
            self.disk.close()


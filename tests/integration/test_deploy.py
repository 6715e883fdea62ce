"""`flashmoe deploy` against a stand-in Docker Engine, and the deployment files themselves.

No Docker engine runs on these machines, so `deploy up|status|down` drive a stand-in engine
(tests/support/docker_standin.py) through the real Docker SDK over a real unix socket. The stand-in
checks every request against the Engine API's published definition (moby's swagger.yaml)
and refuses what it does not allow; what it cannot show is what a real engine then does with
an allowed request (start processes, apply seccomp, mount /dev/shm): docs/deploy.md
says what was run against a real engine and what was not.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

import docker
from flashmoe.deploy import (
    LABEL_PROJECT,
    LABEL_SERVICE,
    DeployError,
    build_context,
    deploy_down,
    deploy_status,
    deploy_up,
    format_status,
    interpolate,
    load_project,
)
from tests.support.docker_standin import DockerStandin, EngineApiSpec

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose.yaml"
CLUSTER = ROOT / "compose.cluster.yaml"
SECCOMP = ROOT / "docker" / "seccomp-io_uring.json"
MOBY = ROOT / "tests" / "data" / "moby"
RUN = "ipc:///run/flashmoe"
CONFIG = ["--config", "/etc/flashmoe/flashmoe.toml"]

# The services' commands, as the deployment brief gives them (plus the config file flag).
COMMANDS = {
    "cache_manager": ["serve-cache", "/store", "--endpoint", f"{RUN}/cache_manager.sock",
                      "--control-endpoint", f"{RUN}/cache_manager.control.sock",
                      "--predictions", f"{RUN}/predictor.sock", *CONFIG],
    "feature_extractor": ["serve-features", "/store", "--events",
                          f"{RUN}/serve.events.sock,{RUN}/replay.events.sock", "--endpoint",
                          f"{RUN}/feature_extractor.sock", "--control-endpoint",
                          f"{RUN}/feature_extractor.control.sock", *CONFIG],
    "predictor": ["serve-predictor", "/store", "--features", f"{RUN}/feature_extractor.sock",
                  "--endpoint", f"{RUN}/predictor.sock", "--control-endpoint",
                  f"{RUN}/predictor.control.sock", "--checkpoint-dir",
                  "/var/lib/flashmoe/predictor", *CONFIG],
    "serve": ["serve-worker", "/store", "--cache", f"{RUN}/cache_manager.sock", "--events",
              f"{RUN}/serve.events.sock", "--predictor-control",
              f"{RUN}/predictor.control.sock", *CONFIG],
    "panel": ["serve-panel", "--runtime-dir", "/run/flashmoe", "--host", "0.0.0.0", "--port",
              "8470"],
}
# Profile `replay`: the trace replay of `flashmoe run`, on an events socket of its own.
REPLAY = ["trace-worker", "--cache", f"{RUN}/cache_manager.sock", "--events",
          f"{RUN}/replay.events.sock", "--loop", *CONFIG]
CONTROLLED = ("cache_manager", "feature_extractor", "predictor")
HEALTH_URL = "http://127.0.0.1:8000/health"


@pytest.fixture(scope="module")
def spec() -> EngineApiSpec:
    return EngineApiSpec()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """The compose file's defaults, whatever the shell running the tests has set."""
    for key in list(os.environ):
        if key.startswith(("FLASHMOE_", "COMPOSE_", "DOCKER_")):
            monkeypatch.delenv(key)


@pytest.fixture
def standin(spec):
    # A short folder of its own: unix socket paths are limited to 107 bytes.
    folder = tempfile.mkdtemp(prefix="fm-docker-")
    server = DockerStandin(Path(folder) / "docker.sock", spec).start()
    try:
        yield server
    finally:
        server.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def client(standin):
    sdk = docker.DockerClient(base_url=standin.base_url)
    try:
        yield sdk
    finally:
        sdk.close()


def creates(standin) -> dict[str, dict]:
    """service -> the body of its (last) POST /containers/create."""
    return {r.body["Labels"][LABEL_SERVICE]: r.body
            for r in standin.requests_to("POST", "/containers/create")}


def up(client, files=COMPOSE, **kwargs):
    lines: list[str] = []
    rows = deploy_up(files, client=client, log=lines.append, **kwargs)
    return rows, lines


# --- up ------------------------------------------------------------------------------------

def test_up_creates_network_volumes_and_containers(standin, client):
    rows, _ = up(client)
    engine = standin.engine
    assert not standin.refused

    (network,) = engine.networks.values()
    assert network["Name"] == "flashmoe_default"
    assert network["Labels"][LABEL_PROJECT] == "flashmoe"
    # Only the volumes the enabled services use: redis-data belongs to the cluster profile.
    assert set(engine.volumes) == {"flashmoe_flashmoe-run", "flashmoe_predictor-checkpoints"}
    assert all(v["Labels"][LABEL_PROJECT] == "flashmoe" for v in engine.volumes.values())

    bodies = creates(standin)
    assert set(bodies) == set(COMMANDS)
    for service, body in bodies.items():
        host = body["HostConfig"]
        assert body["Image"] == "flashmoe:latest"
        assert body["Cmd"] == COMMANDS[service], service
        assert {"FLASHMOE_PROFILE=16gb", "FLASHMOE_STORE__PATH=/store"} <= set(body["Env"])
        assert body["Labels"][LABEL_PROJECT] == "flashmoe"
        assert host["RestartPolicy"] == {"Name": "unless-stopped"}
        assert host["NetworkMode"] == "flashmoe_default"
        assert body["NetworkingConfig"]["EndpointsConfig"]["flashmoe_default"]["Aliases"] \
            == [service]
        assert host["CapDrop"] == ["ALL"] and host["Init"] is True
        assert "no-new-privileges:true" in host["SecurityOpt"]
        mounts = {m["Target"]: m for m in host["Mounts"]}
        assert mounts["/run/flashmoe"]["Type"] == "volume"
        assert mounts["/run/flashmoe"]["Source"] == "flashmoe_flashmoe-run"
        assert body["StopTimeout"] == 20
        health = body["Healthcheck"]
        assert (health["Interval"], health["Timeout"], health["Retries"]) == (30e9, 10e9, 3)
        # Loading a model takes longer than a service's start.
        assert health["StartPeriod"] == (600e9 if service == "serve" else 120e9)
        # start_interval needs Docker Engine 25 (API 1.44): not in the default file.
        assert "StartInterval" not in health
        if service in CONTROLLED:
            assert health["Test"] == ["CMD", "flashmoe", "health",
                                      f"{RUN}/{service}.control.sock"]
        if service != "panel":
            assert mounts["/store"] == {"Type": "bind", "Source": str(ROOT / "store"),
                                        "Target": "/store", "ReadOnly": True}
            assert mounts["/etc/flashmoe/flashmoe.toml"]["Source"] == "/dev/null"

    cache, serve = bodies["cache_manager"]["HostConfig"], bodies["serve"]["HostConfig"]
    assert cache["IpcMode"] == "shareable" and cache["ShmSize"] == 8 * 2**30
    assert serve["IpcMode"] == "container:flashmoe-cache_manager-1"
    assert all("IpcMode" not in bodies[s]["HostConfig"]
               for s in ("feature_extractor", "predictor", "panel"))
    assert cache["Ulimits"] == [{"Name": "memlock", "Soft": -1, "Hard": -1}]
    (seccomp,) = [o for o in cache["SecurityOpt"] if o.startswith("seccomp=")]
    assert json.loads(seccomp[len("seccomp="):]) == json.loads(SECCOMP.read_text())
    assert not any(o.startswith("seccomp=") for s in bodies if s != "cache_manager"
                   for o in bodies[s]["HostConfig"]["SecurityOpt"])
    # The API worker reads the store (read-only, checked above) and no trace.
    assert {m["Target"] for m in serve["Mounts"]} \
        == {"/store", "/run/flashmoe", "/etc/flashmoe/flashmoe.toml"}
    predictor_mounts = {m["Target"]: m for m in bodies["predictor"]["HostConfig"]["Mounts"]}
    assert predictor_mounts["/var/lib/flashmoe/predictor"]["Source"] \
        == "flashmoe_predictor-checkpoints"
    # The API: every address in the container, published on the host's loopback only.
    assert {"FLASHMOE_SERVE__HOST=0.0.0.0", "FLASHMOE_SERVE__PORT=8000"} \
        <= set(bodies["serve"]["Env"])
    assert not any(e.startswith("FLASHMOE_SERVE__") for s in bodies if s != "serve"
                   for e in bodies[s]["Env"])
    assert serve["PortBindings"] == {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "8000"}]}
    assert bodies["serve"]["ExposedPorts"] == {"8000/tcp": {}}
    test = bodies["serve"]["Healthcheck"]["Test"]
    assert test[:3] == ["CMD", "python", "-c"] and HEALTH_URL in test[3]
    panel = bodies["panel"]
    assert panel["HostConfig"]["PortBindings"] == {"8470/tcp": [{"HostIp": "127.0.0.1",
                                                                 "HostPort": "8470"}]}
    assert panel["ExposedPorts"] == {"8470/tcp": {}}

    assert [r.service for r in rows] == ["cache_manager", "feature_extractor", "predictor",
                                         "serve", "panel"]
    assert all(r.state == "running" for r in rows)


def test_up_builds_the_image_from_the_context_less_what_dockerignore_names(standin, client):
    up(client)
    (build,) = standin.engine.builds
    assert build.tags == ["flashmoe:latest"] and build.dockerfile == "docker/Dockerfile"
    tops = {name.split("/")[0] for name in build.files}
    # `COPY . /opt/flashmoe/main/`: the checkout, less .dockerignore's entries.
    assert {"docker", "pyproject.toml", "README.md", "common", "services", "flashmoe",
            "scripts"} <= tops
    assert not tops & {"tests", "results", ".git", ".venv", ".flashmoe"}
    assert "scripts/vendor-assets.sh" in build.files
    assert "docker/wheels/README.md" in build.files
    assert "services/cache_manager/csrc/flashmoe_io.c" in build.files
    assert not [n for n in build.files if "__pycache__" in n or n.endswith((".so", ".pyc"))]
    assert not [n for n in build.files if n.startswith("services/control_panel/static/vendor/")]
    # A second up finds the image and builds nothing.
    up(client)
    assert len(standin.engine.builds) == 1


def test_up_starts_in_dependency_order_and_waits_for_health(standin, client):
    standin.engine.health_inspections = 3
    up(client)
    order = [r.body["Labels"][LABEL_SERVICE]
             for r in standin.requests_to("POST", "/containers/create")]
    assert order.index("cache_manager") < order.index("serve")
    assert order.index("feature_extractor") < order.index("predictor")
    assert order[-1] == "panel"
    assert order.index("predictor") < order.index("serve")
    # The worker (depends_on: service_healthy) was created only after both of its
    # dependencies had been seen healthy.
    worker_at = next(i for i, r in enumerate(standin.requests)
                     if r.template == "/containers/create" and r.body["Labels"][LABEL_SERVICE]
                     == "serve")
    seen_healthy = {r.response["Name"].lstrip("/") for r in standin.requests[:worker_at]
                    if r.template == "/containers/{id}/json"
                    and (r.response["State"].get("Health") or {}).get("Status") == "healthy"}
    assert {"flashmoe-cache_manager-1", "flashmoe-feature_extractor-1"} <= seen_healthy


def test_up_fails_when_a_dependency_is_unhealthy(standin, client):
    standin.engine.unhealthy = {"flashmoe-cache_manager-1"}
    with pytest.raises(DeployError, match="cache_manager.*unhealthy"):
        up(client)
    assert "serve" not in creates(standin)


def test_up_again_keeps_what_is_unchanged_and_recreates_what_changed(standin, client,
                                                                     monkeypatch):
    up(client)
    first = {c["Name"]: c["Id"] for c in standin.engine.containers.values()}
    _, lines = up(client)
    assert {c["Name"]: c["Id"] for c in standin.engine.containers.values()} == first
    assert sum("up to date" in line for line in lines) == 5

    # Only the cache manager's configuration changes; the worker, which joined its IPC
    # namespace (depends_on: restart: true), is restarted, not recreated.
    monkeypatch.setenv("FLASHMOE_SHM_SIZE", "4gb")
    _, lines = up(client)
    now = {c["Name"]: c["Id"] for c in standin.engine.containers.values()}
    assert now["/flashmoe-cache_manager-1"] != first["/flashmoe-cache_manager-1"]
    assert {k: v for k, v in now.items() if "cache_manager" not in k} \
        == {k: v for k, v in first.items() if "cache_manager" not in k}
    assert standin.engine.container("flashmoe-cache_manager-1")["HostConfig"]["ShmSize"] \
        == 4 * 2**30
    restarted = {r.path.split("/")[2] for r in
                 standin.requests_to("POST", "/containers/{id}/restart")}
    assert restarted == {now["/flashmoe-serve-1"]}


def test_cluster_profile_adds_redis_and_the_redis_flag(standin, client):
    up(client, [COMPOSE, CLUSTER], profiles=["cluster"])
    assert standin.engine.pulls == ["redis:7.4-bookworm"]
    bodies = creates(standin)
    order = [r.body["Labels"][LABEL_SERVICE]
             for r in standin.requests_to("POST", "/containers/create")]
    assert order[0] == "redis"
    assert bodies["redis"]["NetworkingConfig"]["EndpointsConfig"]["flashmoe_default"][
        "Aliases"] == ["redis"]
    for service, command in COMMANDS.items():
        assert bodies[service]["Cmd"] == [*command, "--redis", "redis://redis:6379"]
    assert "flashmoe_redis-data" in standin.engine.volumes
    replay = load_project([COMPOSE, CLUSTER], profiles=["cluster", "replay"]).services["trace_worker"]
    assert replay.command == [*REPLAY, "--redis", "redis://redis:6379"]
    assert replay.profiles == ["replay"]
    with pytest.raises(DeployError, match="depends on redis"):
        load_project([COMPOSE, CLUSTER])  # the override without the profile


def test_api_port_and_store_come_from_the_environment(standin, client, monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHMOE_API_PORT", "18000")
    monkeypatch.setenv("FLASHMOE_STORE", str(tmp_path))
    up(client)
    bodies = creates(standin)
    # Another host port, still on loopback; in the container the API keeps port 8000.
    assert bodies["serve"]["HostConfig"]["PortBindings"] \
        == {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": "18000"}]}
    for service in ("cache_manager", "feature_extractor", "predictor", "serve"):
        mounts = {m["Target"]: m for m in bodies[service]["HostConfig"]["Mounts"]}
        assert mounts["/store"] == {"Type": "bind", "Source": str(tmp_path), "Target": "/store",
                                    "ReadOnly": True}, service


def test_replay_profile_adds_the_trace_replay(standin, client):
    up(client, profiles=["replay"])
    bodies = creates(standin)
    assert set(bodies) == {*COMMANDS, "trace_worker"}
    replay = bodies["trace_worker"]
    assert replay["Cmd"] == REPLAY
    host = replay["HostConfig"]
    assert host["IpcMode"] == "container:flashmoe-cache_manager-1"
    assert "PortBindings" not in host
    mounts = {m["Target"]: m for m in host["Mounts"]}
    assert mounts["/store"]["ReadOnly"] and mounts["/opt/flashmoe/shared/traces"]["ReadOnly"]
    assert mounts["/opt/flashmoe/shared/traces"]["Source"] \
        == str((ROOT / ".." / "shared" / "traces").resolve())
    assert "python" in replay["Healthcheck"]["Test"]
    # Each worker binds its own events socket; the feature extractor reads both.
    events = {s: bodies[s]["Cmd"][bodies[s]["Cmd"].index("--events") + 1]
              for s in ("serve", "trace_worker", "feature_extractor")}
    assert events["serve"] != events["trace_worker"]
    assert events["feature_extractor"].split(",") == [events["serve"], events["trace_worker"]]
    assert not standin.refused


def test_up_of_named_services_starts_them_and_their_dependencies(standin, client):
    # The replay without the API worker: naming a service enables its profile.
    rows, _ = up(client, services=["trace_worker", "panel"])
    assert set(creates(standin)) == {"cache_manager", "feature_extractor", "predictor",
                                     "trace_worker", "panel"}
    assert [r.service for r in rows] == ["cache_manager", "feature_extractor", "predictor",
                                         "trace_worker", "panel"]
    with pytest.raises(DeployError, match="no such service: api"):
        up(client, services=["api"])


# --- status and down -------------------------------------------------------------------------

def test_status_reports_each_service(standin, client):
    rows = deploy_status(COMPOSE, client=client)
    assert [(r.service, r.state) for r in rows] == [(s, "missing") for s in
                                                    ("cache_manager", "feature_extractor",
                                                     "predictor", "serve", "panel")]
    up(client)
    client.containers.get("flashmoe-panel-1").stop()
    rows = {r.service: r for r in deploy_status(COMPOSE, client=client)}
    assert rows["panel"].state == "exited" and rows["panel"].exit_code == 0
    assert (rows["cache_manager"].state, rows["cache_manager"].health) == ("running", "healthy")
    assert rows["serve"].container == "flashmoe-serve-1"
    table = format_status(list(rows.values()))
    assert table.splitlines()[0].split() == ["SERVICE", "CONTAINER", "STATE", "HEALTH", "IMAGE"]
    assert "exited (0)" in table


def test_down_removes_containers_and_network_and_keeps_volumes(standin, client):
    up(client)
    removed = deploy_down(COMPOSE, client=client, log=lambda line: None)
    engine = standin.engine
    assert not engine.containers and not engine.networks
    assert set(engine.volumes) == {"flashmoe_flashmoe-run", "flashmoe_predictor-checkpoints"}
    # Dependents first: the panel and the worker go before the cache manager.
    assert removed.index("container flashmoe-serve-1") \
        < removed.index("container flashmoe-cache_manager-1")
    deploy_down(COMPOSE, client=client, volumes=True, log=lambda line: None)
    assert not engine.volumes
    assert not standin.refused


def test_down_leaves_other_projects_alone(standin, client):
    up(client)
    up(client, project="other")
    deploy_down(COMPOSE, project="other", client=client, log=lambda line: None)
    names = {c["Name"] for c in standin.engine.containers.values()}
    assert names == {f"/flashmoe-{s}-1" for s in COMMANDS}


def test_an_unreachable_engine_is_a_deploy_error():
    folder = tempfile.mkdtemp(prefix="fm-docker-")
    try:
        with pytest.raises(DeployError, match="cannot reach the Docker engine"):
            deploy_status(COMPOSE, docker_host=f"unix://{folder}/nothing.sock")
    finally:
        shutil.rmtree(folder)


# --- the stand-in itself ---------------------------------------------------------------------

def _post(client, path: str, body: dict, **params):
    api = client.api
    return api.post(f"{api.base_url}/v{api.api_version}{path}", json=body, params=params)


def test_standin_refuses_what_the_spec_does_not_allow(standin, client):
    ok = _post(client, "/volumes/create", {"Name": "v1", "Labels": {"a": "b"}})
    assert ok.status_code == 201
    cases = [
        # a body field the Engine API does not have
        ("/containers/create", {"Image": "x", "Bogus": 1}, {}, "field 'Bogus'"),
        # a nested one, and a wrong type
        ("/containers/create", {"Image": "x", "HostConfig": {"ShmSize": "8g"}}, {},
         "ShmSize: expected an integer"),
        ("/containers/create", {"Image": "x", "HostConfig": {"Mounts": [{"Type": "nfs"}]}},
         {}, "not one of"),
        # CheckDuplicate left the API in v1.44; the SDK still sends it when asked to
        ("/networks/create", {"Name": "n", "CheckDuplicate": True}, {}, "CheckDuplicate"),
        # a query parameter the operation does not have
        ("/containers/create", {"Image": "x"}, {"bogus": "1"}, "query parameter 'bogus'"),
    ]
    for path, body, params, reason in cases:
        response = _post(client, path, body, **params)
        assert response.status_code == 400, (path, body)
        assert reason in response.json()["message"]
    api = client.api
    assert api.get(f"{api.base_url}/v1.56/no/such/path").status_code == 400
    assert api.put(f"{api.base_url}/v1.56/containers/json").status_code == 400
    assert len(standin.refused) == len(cases) + 2
    assert not standin.engine.containers and not standin.engine.networks
    # What the SDK's own container listing sends: `trunc_cmd` is not in the API definition
    # (the engine ignores it), which is why deploy lists containers with its own GET.
    with pytest.raises(docker.errors.APIError, match="trunc_cmd"):
        client.containers.list(all=True)


def test_standin_enforces_the_engines_own_rules(standin, client):
    up(client)
    api = client.api
    base = f"{api.base_url}/v{api.api_version}"
    assert api.delete(f"{base}/containers/flashmoe-serve-1").status_code == 409  # running
    assert api.delete(f"{base}/networks/flashmoe_default").status_code == 403  # in use
    assert api.delete(f"{base}/volumes/flashmoe_flashmoe-run").status_code == 409
    assert _post(client, "/containers/create", {"Image": "no-such-image"}).status_code == 404
    # The worker cannot join the IPC namespace of a stopped cache manager.
    client.containers.get("flashmoe-serve-1").stop()
    client.containers.get("flashmoe-cache_manager-1").stop()
    response = _post(client, "/containers/flashmoe-serve-1/start", None)
    assert response.status_code == 409 and "non running" in response.json()["message"]


# --- compose parsing -------------------------------------------------------------------------

@pytest.mark.parametrize("text, env, expected", [
    ("${A}", {"A": "1"}, "1"),
    ("${A:-d}", {"A": ""}, "d"),
    ("${A-d}", {"A": ""}, ""),
    ("${A:-${B:-x}}y", {}, "xy"),
    ("$$A", {"A": "1"}, "$A"),
    ("${A:+on}", {"A": "1"}, "on"),
    ("$A/b", {"A": "p"}, "p/b"),
])
def test_interpolation(text, env, expected):
    assert interpolate(text, env, "test") == expected


def test_interpolation_of_a_required_variable():
    with pytest.raises(DeployError, match="STORE"):
        interpolate("${STORE:?set the store folder}", {}, "test")


def test_compose_file_keys_deploy_cannot_honour_are_errors(tmp_path):
    (tmp_path / "compose.yaml").write_text(
        "services:\n  s:\n    image: x\n    devices: [/dev/nvme0n1]\n")
    with pytest.raises(DeployError, match="devices not supported"):
        load_project(tmp_path / "compose.yaml")


def test_yaml_scalars_are_read_as_compose_reads_them(tmp_path):
    (tmp_path / "compose.yaml").write_text(
        "services:\n  s:\n    image: x\n    environment: {A: yes, B: 0700}\n"
        "    ports: ['22:22']\n")
    service = load_project(tmp_path / "compose.yaml").services["s"]
    assert service.environment == {"A": "yes", "B": "0700"}
    assert service.ports == {"22/tcp": [("", "22")]}


def test_build_context_refuses_a_copy_it_cannot_resolve(tmp_path):
    from flashmoe.deploy import Build

    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY missing /x\n")
    with pytest.raises(DeployError, match="matches nothing"):
        build_context(Build(tmp_path))


# --- the seccomp profile -----------------------------------------------------------------------

def test_seccomp_profile_is_mobys_default_plus_exactly_the_io_uring_calls():
    moby = json.loads((MOBY / "seccomp-default.json").read_text())
    ours = json.loads(SECCOMP.read_text())
    uring = {"io_uring_setup", "io_uring_enter", "io_uring_register"}
    # The moby default blocks io_uring by leaving it out (defaultAction is an errno).
    assert moby["defaultAction"] == "SCMP_ACT_ERRNO"
    assert not uring & {n for rule in moby["syscalls"] for n in rule.get("names", [])}
    assert {k: v for k, v in ours.items() if k != "syscalls"} \
        == {k: v for k, v in moby.items() if k != "syscalls"}
    assert ours["syscalls"][:-1] == moby["syscalls"]
    added = ours["syscalls"][-1]
    assert set(added["names"]) == uring and len(added["names"]) == 3
    assert added["action"] == "SCMP_ACT_ALLOW"
    assert set(added) == {"names", "action", "comment"}  # no args, no kernel/cap conditions
    assert "b985e2313a8676e18072b442911fc8f64f17d440" in added["comment"]


def test_moby_files_are_the_recorded_ones():
    """tests/data/moby/README.md names each file's source and sha256; keep them true."""
    import hashlib

    readme = (MOBY / "README.md").read_text()
    for name in ("swagger.yaml", "seccomp-default.json"):
        digest = hashlib.sha256((MOBY / name).read_bytes()).hexdigest()
        assert digest in readme, f"{name} changed without its README entry"
    assert (MOBY / "LICENSE").read_text().startswith("\n                                 Apache")


# --- compose validation with a real compose binary -------------------------------------------

def _check_compose(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(ROOT / "scripts" / "check-compose.sh"), *args],
                            capture_output=True, text=True, timeout=600,
                            check=False)
    if result.returncode == 3:
        pytest.skip(f"no Docker Compose binary: {result.stderr.strip()}")
    return result


def test_compose_files_validate_with_docker_compose():
    result = _check_compose()
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("check-compose: ok:") == 5


def test_check_compose_fails_on_an_invalid_file(tmp_path):
    shutil.copy(CLUSTER, tmp_path / "compose.cluster.yaml")
    (tmp_path / "docker").mkdir()
    shutil.copy(SECCOMP, tmp_path / "docker" / SECCOMP.name)
    (tmp_path / "compose.yaml").write_text(COMPOSE.read_text().replace(
        "predictor-checkpoints:/var", "undeclared:/var", 1))
    result = _check_compose(str(tmp_path))
    assert result.returncode == 1
    assert "undeclared" in result.stderr

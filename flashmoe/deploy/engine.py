"""The engine calls: networks, volumes, images and containers of a project through the Docker
SDK, and the status of its services."""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import re
import shlex
import sys
import tarfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flashmoe.deploy.compose import Build, Project, Resource, Service
from flashmoe.deploy.syntax import DeployError


POLL_S = 0.5
LABEL_PROJECT = "io.flashmoe.project"
LABEL_SERVICE = "io.flashmoe.service"
LABEL_CONFIG_HASH = "io.flashmoe.config-hash"
LABEL_NETWORK = "io.flashmoe.network"
LABEL_VOLUME = "io.flashmoe.volume"


@dataclass
class ServiceStatus:
    service: str
    container: str | None  # None: no container
    state: str  # the engine's State.Status ("running", "exited", ...) or "missing"
    health: str  # State.Health.Status ("healthy", "unhealthy", "starting") or "-"
    image: str
    exit_code: int | None = None
    restarts: int = 0

    @property
    def ok(self) -> bool:
        """Running, and healthy where it has a healthcheck."""
        return self.state == "running" and self.health in ("healthy", "-")


def format_status(rows: Sequence[ServiceStatus]) -> str:
    header = ("SERVICE", "CONTAINER", "STATE", "HEALTH", "IMAGE")
    table = [header] + [(r.service, r.container or "-",
                         r.state + (f" ({r.exit_code})" if r.state == "exited" else "")
                         + (f", {r.restarts} restarts" if r.restarts else ""),
                         r.health, r.image) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in table)


def log_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def engine_client(client, docker_host: str | None) -> Iterator[Any]:
    """The SDK client to use (``client`` as given, else one for ``docker_host`` or the
    environment's DOCKER_HOST), with SDK errors turned into DeployError."""
    from docker.errors import APIError, DockerException, ImageNotFound

    import docker

    own = client is None
    try:
        if own:
            client = (docker.DockerClient(base_url=docker_host) if docker_host
                      else docker.from_env())
    except DockerException as exc:
        where = docker_host or os.environ.get("DOCKER_HOST") or "the default socket"
        raise DeployError(f"cannot reach the Docker engine at {where}: {exc} (give "
                          f"--docker-host URL)") from None
    try:
        yield client
    except ImageNotFound as exc:
        raise DeployError(f"image not found: {exc.explanation}") from None
    except APIError as exc:
        raise DeployError(f"the Docker engine refused a request: {exc.explanation or exc} "
                          f"({exc.response.request.method if exc.response is not None else ''} "
                          f"{exc.response.url if exc.response is not None else ''})") from None
    except DockerException as exc:
        raise DeployError(f"Docker SDK error: {exc}") from None
    finally:
        if own:
            client.close()


def label_filter(**labels: str) -> dict:
    return {"label": [f"{k}={v}" for k, v in labels.items()]}


def _engine_get(client, path: str, params: dict) -> Any:
    """A GET on the Engine API with exactly these query parameters, errors raised as the SDK
    raises them."""
    from docker.errors import create_api_error_from_http_exception
    from requests import HTTPError

    api = client.api
    response = api.get(f"{api.base_url}/v{api.api_version}{path}", params=params,
                       timeout=api.timeout)
    try:
        response.raise_for_status()
    except HTTPError as exc:
        raise create_api_error_from_http_exception(exc) from None
    return response.json()


def project_containers(client, project: str, service: str | None = None) -> list:
    """The project's containers (of one service), stopped ones included. Not through the
    SDK's containers.list: that adds ``trunc_cmd``, a query parameter the Engine API's
    definition does not have."""
    from docker.errors import NotFound

    labels = {LABEL_PROJECT: project, **({LABEL_SERVICE: service} if service else {})}
    summaries = _engine_get(client, "/containers/json",
                            {"all": "1", "filters": json.dumps(label_filter(**labels))})
    containers = []
    for summary in summaries:
        try:
            containers.append(client.containers.get(summary["Id"]))
        except NotFound:
            pass  # removed meanwhile
    return containers


def _existing(collection, res: Resource, kind: str):
    """The engine's network or volume named as ``res``, or None; an external one must exist."""
    from docker.errors import NotFound

    try:
        existing = collection.get(res.name)
    except NotFound:
        existing = None
    if res.external and existing is None:
        raise DeployError(f"{kind} {res.name} is declared external but does not exist "
                          f"(create it first)")
    return existing


def _owner(existing) -> str | None:
    return (existing.attrs.get("Labels") or {}).get(LABEL_PROJECT)


def ensure_network(client, project: Project, net: Resource, log) -> None:
    existing = _existing(client.networks, net, "network")
    if net.external:
        return
    if existing is not None:
        if _owner(existing) != project.name:
            raise DeployError(f"network {net.name} exists and does not belong to project "
                              f"{project.name} (its {LABEL_PROJECT} label: "
                              f"{_owner(existing)!r}); remove it or declare it external")
        return
    client.networks.create(net.name, driver=net.driver or "bridge",
                           options=net.driver_opts or None, internal=net.internal,
                           attachable=net.attachable,
                           labels={**net.labels, LABEL_PROJECT: project.name,
                                   LABEL_NETWORK: net.key})
    log(f"network {net.name}: created")


def ensure_volume(client, project: Project, vol: Resource, log) -> None:
    existing = _existing(client.volumes, vol, "volume")
    if vol.external:
        return
    if existing is not None:
        if _owner(existing) != project.name:
            log(f"warning: volume {vol.name} already exists and was not created by flashmoe "
                f"deploy for project {project.name}: using it as it is")
        return
    client.volumes.create(vol.name, driver=vol.driver or "local",
                          driver_opts=vol.driver_opts or None,
                          labels={**vol.labels, LABEL_PROJECT: project.name,
                                  LABEL_VOLUME: vol.key})
    log(f"volume {vol.name}: created")


_COPY_LINE = re.compile(r"^\s*(COPY|ADD)\s+(.*)$", re.IGNORECASE)
_CONTEXT_SKIP = re.compile(r"(^|/)(__pycache__|\.git|\.venv|.*\.egg-info)(/|$)|\.(pyc|so)$")


def _dockerfile_sources(dockerfile: Path) -> list[str]:
    """The context paths a Dockerfile's COPY/ADD instructions read (not those --from a
    stage)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    sources = []
    for line in text.splitlines():
        match = _COPY_LINE.match(line)
        if match is None:
            continue
        args = match.group(2).strip()
        if args.startswith("["):
            words = json.loads(args)
        else:
            words = shlex.split(args)
        flags = [w for w in words if w.startswith("--")]
        if any(f.startswith("--from") for f in flags):
            continue
        paths = [w for w in words if not w.startswith("--")]
        for source in paths[:-1]:
            if "$" in source or "://" in source:
                raise DeployError(f"{dockerfile}: cannot tell which files `{line.strip()}` "
                                  f"reads; build the image with docker build")
            sources.append(source)
    return sources


def _dockerignore(context: Path) -> list[str]:
    """The context's .dockerignore patterns (comments and blank lines dropped; ``!``
    exceptions are not supported and refused)."""
    path = context / ".dockerignore"
    if not path.is_file():
        return []
    patterns = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("!"):
            raise DeployError(f"{path}: exception patterns ({line}) are not supported by "
                              f"flashmoe deploy; build the image with docker build")
        patterns.append(line.strip("/"))
    return patterns


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Whether ``rel`` (or a folder above it) matches a .dockerignore pattern; a pattern that
    starts with ``**/`` matches below any number of folders."""
    parts = rel.split("/")
    for pattern in patterns:
        tail = pattern
        while tail.startswith("**/"):
            tail = tail[3:]
        starts = range(len(parts)) if tail != pattern else (0,)
        if any(fnmatch.fnmatchcase("/".join(parts[i:j]), tail)
               for i in starts for j in range(i + 1, len(parts) + 1)):
            return True
    return False


def build_context(build: Build) -> io.BytesIO:
    """A tar of the Dockerfile and the context files its COPY/ADD instructions read (never
    caches, virtual environments or compiled objects)."""
    dockerfile = build.context / build.dockerfile
    if not dockerfile.is_file():
        raise DeployError(f"Dockerfile {dockerfile} does not exist")
    ignore = _dockerignore(build.context)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(dockerfile, arcname=build.dockerfile)
        for pattern in _dockerfile_sources(dockerfile):
            pattern = pattern.lstrip("/")
            if pattern.rstrip("/") in ("", "."):  # the whole context, less .dockerignore's
                matches = [build.context]
            else:
                matches = sorted(build.context.glob(pattern)) or []
            if not matches:
                raise DeployError(f"{dockerfile}: COPY source {pattern!r} matches nothing in "
                                  f"{build.context}")
            for path in matches:
                for item in ([path] if path.is_file() else sorted(path.rglob("*"))):
                    rel = item.relative_to(build.context).as_posix()
                    if item.is_file() and not _CONTEXT_SKIP.search(rel) \
                            and not _ignored(rel, ignore):
                        tar.add(item, arcname=rel, recursive=False)
    buf.seek(0)
    return buf


def ensure_image(client, service: Service, rebuild: bool, done: dict[str, str], log) -> str:
    """The image's id, building (``build``) or pulling it when it is missing."""
    from docker.errors import ImageNotFound

    if service.image in done:
        return done[service.image]
    image = None
    if not (rebuild and service.build):
        try:
            image = client.images.get(service.image)
        except ImageNotFound:
            image = None
    if image is None and service.build is not None:
        dockerfile = service.build.context / service.build.dockerfile
        log(f"image {service.image}: building from {dockerfile}")
        image, _ = client.images.build(
            fileobj=build_context(service.build), custom_context=True,
            dockerfile=service.build.dockerfile, tag=service.image, rm=True,
            buildargs=service.build.args or None, target=service.build.target)
        log(f"image {service.image}: built ({image.id})")
    elif image is None:
        repository, tag = _split_image(service.image)
        log(f"image {service.image}: pulling")
        image = client.images.pull(repository, tag=tag)
    done[service.image] = image.id
    return image.id


def _split_image(image: str) -> tuple[str, str]:
    if "@" in image:
        return tuple(image.split("@", 1))  # type: ignore[return-value]
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:
        return image, "latest"
    return name, tag


def container_config(client, project: Project, service: Service) -> dict:
    """The body of the Engine API's POST /containers/create for the service (the labels that
    mark it as the project's included; the config-hash label is added by the caller)."""
    from docker.types import Mount, Ulimit

    api = client.api
    first_network = next(iter(service.networks))
    network_name = project.networks[first_network].name
    ipc = service.ipc
    if ipc and ipc.startswith("service:"):
        ipc = "container:" + project.container_name(ipc[len("service:"):])
    host_config = api.create_host_config(
        mounts=[Mount(target=m["Target"], source=m.get("Source"), type=m["Type"],
                      read_only=m["ReadOnly"],
                      no_copy=m.get("VolumeOptions", {}).get("NoCopy", False),
                      tmpfs_size=m.get("TmpfsOptions", {}).get("SizeBytes"),
                      tmpfs_mode=m.get("TmpfsOptions", {}).get("Mode"))
                for m in service.mounts] or None,
        tmpfs=service.tmpfs or None,
        shm_size=service.shm_size,
        ipc_mode=ipc,
        ulimits=[Ulimit(name=n, soft=s, hard=h) for n, s, h in service.ulimits] or None,
        security_opt=service.security_opt or None,
        cap_add=service.cap_add or None, cap_drop=service.cap_drop or None,
        restart_policy=service.restart if service.restart["Name"] else None,
        port_bindings={port: bindings[0] if len(bindings) == 1 else bindings
                       for port, bindings in service.ports.items()} or None,
        network_mode=network_name,
        init=service.init,
        read_only=service.read_only,
    )
    networking = api.create_networking_config(
        {network_name: api.create_endpoint_config(aliases=service.networks[first_network])})
    healthcheck = dict(service.healthcheck) if service.healthcheck else None
    config = api.create_container_config(
        image=service.image, command=service.command, entrypoint=service.entrypoint,
        environment=[f"{k}={v}" for k, v in sorted(service.environment.items())] or None,
        user=service.user, working_dir=service.working_dir, hostname=service.hostname,
        detach=True, host_config=host_config, networking_config=networking,
        ports=[tuple(p.split("/", 1)) for p in service.ports] or None,
        labels={**service.labels, LABEL_PROJECT: project.name, LABEL_SERVICE: service.name},
        stop_signal=service.stop_signal, stop_timeout=service.stop_timeout_s,
        healthcheck=healthcheck)
    if healthcheck and "StartInterval" in healthcheck:
        # The SDK's Healthcheck type predates StartInterval (API 1.44) and drops it.
        config["Healthcheck"]["StartInterval"] = healthcheck["StartInterval"]
    # The SDK leaves unset fields as null in nested objects (a Mount's Source); the API
    # defines them as strings, objects...: leave them out, as the docker CLI does.
    return _without_none(config)


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def _config_hash(config: dict, image_id: str) -> str:
    """What decides whether a container is recreated: its create request and its image."""
    text = json.dumps({"config": config, "image": image_id}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def container_state(container) -> tuple[str, str]:
    state = container.attrs.get("State") or {}
    return state.get("Status", "unknown"), (state.get("Health") or {}).get("Status", "-")


def wait_for(client, project: Project, service: Service, dep: str, condition: str,
              deadline: float, log) -> None:
    from docker.errors import NotFound

    name = project.container_name(dep)
    if condition == "service_started":
        return
    announced = False
    while True:
        try:
            container = client.containers.get(name)
        except NotFound:
            raise DeployError(f"{service.name} depends on {dep}, whose container {name} is "
                              f"gone") from None
        status, health = container_state(container)
        if condition == "service_healthy":
            if health == "healthy":
                return
            if health == "unhealthy":
                raise DeployError(f"{service.name} needs {dep} healthy; {name} is unhealthy "
                                  f"(see `docker logs {name}`)")
            if health == "-":
                raise DeployError(f"{service.name} needs {dep} healthy but {dep} has no "
                                  f"healthcheck")
        elif condition == "service_completed_successfully" and status in ("exited", "dead"):
            code = (container.attrs.get("State") or {}).get("ExitCode")
            if code == 0:
                return
            raise DeployError(f"{service.name} needs {dep} to complete successfully; {name} "
                              f"exited with status {code}")
        if status in ("exited", "dead") and condition == "service_healthy":
            raise DeployError(f"{service.name} needs {dep} healthy; {name} is {status} "
                              f"(see `docker logs {name}`)")
        if time.monotonic() > deadline:
            raise DeployError(f"{service.name}: {dep} not {condition.split('_', 1)[1]} within "
                              f"the deploy timeout ({name}: {status}, health {health}); "
                              f"raise --timeout")
        if not announced:
            log(f"waiting for {dep} to be {condition.split('_', 1)[1].replace('_', ' ')}")
            announced = True
        time.sleep(POLL_S)


def up_service(client, project: Project, service: Service, image_id: str,
                started: set[str], log) -> None:
    """Create (or recreate on a changed config) and start the service's container."""
    config = container_config(client, project, service)
    config_hash = _config_hash(config, image_id)
    config["Labels"][LABEL_CONFIG_HASH] = config_hash
    name = project.container_name(service.name)
    existing = project_containers(client, project.name, service.name)
    restart_for = [dep for dep, spec in service.depends_on.items()
                   if spec.restart and dep in started]
    for container in existing:
        if container.labels.get(LABEL_CONFIG_HASH) == config_hash and container.name == name:
            status, _ = container_state(container)
            if status == "running" and restart_for:
                container.restart()
                log(f"container {name}: restarted ({', '.join(restart_for)} restarted)")
                started.add(service.name)
            elif status != "running":
                container.start()
                log(f"container {name}: started")
                started.add(service.name)
            else:
                log(f"container {name}: up to date")
            return
        container.stop()
        container.remove()
        log(f"container {container.name}: removed (configuration changed)")
    created = client.api.create_container_from_config(config, name=name)
    client.containers.get(created["Id"]).start()
    log(f"container {name}: created and started")
    started.add(service.name)

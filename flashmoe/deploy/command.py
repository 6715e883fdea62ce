"""`flashmoe deploy up|status|down`: a project's services brought up in dependency order,
listed, or taken down."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from flashmoe.deploy.compose import DEFAULT_COMPOSE_FILE, Project, load_project
from flashmoe.deploy.engine import (LABEL_PROJECT, LABEL_SERVICE, ServiceStatus, container_state,
                                    engine_client, ensure_image, ensure_network, ensure_volume,
                                    label_filter, log_to_stderr, project_containers, up_service,
                                    wait_for)


DEFAULT_TIMEOUT_S = 300.0


def deploy_up(compose_files: str | os.PathLike | Sequence[str | os.PathLike]
              = DEFAULT_COMPOSE_FILE, project: str | None = None, *,
              profiles: Sequence[str] = (), services: Sequence[str] = (), client=None,
              docker_host: str | None = None, build: bool = False, wait: bool = False,
              timeout_s: float = DEFAULT_TIMEOUT_S,
              log: Callable[[str], None] = log_to_stderr) -> list[ServiceStatus]:
    """Create what the compose file describes and start it (``services``: only these and
    their dependencies, each named one enabled whatever its profiles); ``build``: rebuild
    images that have a build section even when present; ``wait``: also wait until every
    service is running and, where it has a healthcheck, healthy. Returns the status rows."""
    model = load_project(compose_files, project, profiles, only=services)
    for warning in model.warnings:
        log(f"warning: {warning}")
    deadline = time.monotonic() + timeout_s
    with engine_client(client, docker_host) as engine:
        used_networks = {key for s in model.services.values() for key in s.networks}
        for key in sorted(used_networks):
            ensure_network(engine, model, model.networks[key], log)
        # Like Compose, only what the enabled services use (redis-data only with `cluster`).
        used_volumes = {m["Source"] for s in model.services.values() for m in s.mounts
                        if m["Type"] == "volume" and m.get("Source")}
        for vol in model.volumes.values():
            if vol.name in used_volumes:
                ensure_volume(engine, model, vol, log)
        images: dict[str, str] = {}
        image_ids = {name: ensure_image(engine, model.services[name], build, images, log)
                     for name in model.order}
        started: set[str] = set()
        for name in model.order:
            service = model.services[name]
            for dep, spec in service.depends_on.items():
                wait_for(engine, model, service, dep, spec.condition, deadline, log)
            for dep in service.implicit_dependencies() - set(service.depends_on):
                wait_for(engine, model, service, dep, "service_started", deadline, log)
            up_service(engine, model, service, image_ids[name], started, log)
        if wait:
            for name in model.order:
                condition = ("service_healthy" if model.services[name].healthcheck
                             and model.services[name].healthcheck["Test"] != ["NONE"]
                             else "service_started")
                wait_for(engine, model, model.services[name], name, condition, deadline, log)
        return _status_rows(engine, model)


def _status_rows(client, model: Project) -> list[ServiceStatus]:
    by_service: dict[str, Any] = {}
    for container in project_containers(client, model.name):
        by_service.setdefault(container.labels.get(LABEL_SERVICE, "?"), container)
    rows = []
    for name in [*model.order, *sorted(set(by_service) - set(model.order))]:
        container = by_service.get(name)
        if container is None:
            service = model.services[name]
            rows.append(ServiceStatus(name, None, "missing", "-", service.image))
            continue
        container.reload()
        status, health = container_state(container)
        state = container.attrs.get("State") or {}
        rows.append(ServiceStatus(
            name, container.name, status, health,
            (container.attrs.get("Config") or {}).get("Image", ""),
            exit_code=state.get("ExitCode") if status == "exited" else None,
            restarts=int(container.attrs.get("RestartCount") or 0)))
    return rows


def deploy_status(compose_files: str | os.PathLike | Sequence[str | os.PathLike]
                  = DEFAULT_COMPOSE_FILE, project: str | None = None, *,
                  profiles: Sequence[str] = (), client=None,
                  docker_host: str | None = None) -> list[ServiceStatus]:
    """One row per service of the compose file (state "missing" when it has no container)
    and per container of the project that the file no longer has."""
    model = load_project(compose_files, project, profiles)
    with engine_client(client, docker_host) as engine:
        return _status_rows(engine, model)


def deploy_down(compose_files: str | os.PathLike | Sequence[str | os.PathLike]
                = DEFAULT_COMPOSE_FILE, project: str | None = None, *,
                profiles: Sequence[str] = (), client=None, docker_host: str | None = None,
                volumes: bool = False, timeout_s: int | None = None,
                log: Callable[[str], None] = log_to_stderr) -> list[str]:
    """Stop and remove the project's containers (dependents first) and networks, and with
    ``volumes`` its volumes; returns what was removed. ``timeout_s``: seconds each container
    gets to stop (default: its stop_grace_period)."""
    model = load_project(compose_files, project, profiles, all_profiles=not profiles)
    removed = []
    with engine_client(client, docker_host) as engine:
        rank = {name: i for i, name in enumerate(model.order)}
        containers = sorted(project_containers(engine, model.name),
                            key=lambda c: -rank.get(c.labels.get(LABEL_SERVICE), len(rank)))
        for container in containers:
            if container_state(container)[0] in ("running", "restarting", "paused"):
                container.stop(timeout=timeout_s)
            container.remove()
            log(f"container {container.name}: removed")
            removed.append(f"container {container.name}")
        for net in engine.networks.list(filters=label_filter(**{LABEL_PROJECT: model.name})):
            net.remove()
            log(f"network {net.name}: removed")
            removed.append(f"network {net.name}")
        if volumes:
            for vol in engine.volumes.list(
                    filters=label_filter(**{LABEL_PROJECT: model.name})):
                vol.remove()
                log(f"volume {vol.name}: removed")
                removed.append(f"volume {vol.name}")
    return removed

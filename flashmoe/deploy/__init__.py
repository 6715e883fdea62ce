"""`flashmoe deploy up|status|down`: compose.yaml's services through the Docker Engine API.

The Docker SDK (``docker`` on PyPI) has no compose, so this package reads the compose file(s)
itself and drives the engine through the SDK: the same services, images, commands,
environment, volumes, shared-memory and IPC modes, ulimits, seccomp profile, healthchecks,
restart policies, ports, networks and profiles as ``docker compose up`` would give them.

- What is read: the Compose specification's top-level ``name``, ``services``, ``volumes`` and
  ``networks`` (``x-*`` extension fields only through YAML anchors), ``${VAR}`` interpolation
  (``:-``, ``-``, ``:?``, ``?``, ``:+``, ``+``, ``$$``; the environment, then ``.env`` next to
  the first file), override files merged as compose merges them, and of a service the keys in
  ``SERVICE_KEYS``. A service key outside that set is an error naming it, never dropped.
- Names follow Docker Compose (``<project>-<service>-1``, ``<project>_<volume>``,
  ``<project>_default``); the labels are FlashMoE's own (``io.flashmoe.*``), so Docker Compose
  does not take these containers for its own, nor this package Compose's.
- ``up`` (of every service the profiles enable, or of the named ones and what they depend on)
  creates the networks and volumes, builds (only the files the Dockerfile copies are
  sent) or pulls missing images, then creates and starts containers in dependency order,
  waiting for ``service_healthy`` / ``service_completed_successfully`` conditions. A container
  whose configuration (or image) changed is recreated; an unchanged one is left running.
- ``status`` lists each service's container, state and health; ``down`` stops and removes the
  project's containers and networks, and its volumes only when asked.

Relative host paths (bind mounts, the seccomp profile, env files, build context) are resolved
against the folder of the first compose file, as Docker Compose does; bind sources must exist
on the engine's host (they are not created, unlike Compose's short volume syntax).

Its modules: ``syntax`` (YAML, interpolation, env files, units), ``compose`` (the project
model read from the compose files), ``engine`` (the Docker SDK calls and the status rows),
``command`` (up, status, down).
"""

from flashmoe.deploy.command import deploy_down, deploy_status, deploy_up
from flashmoe.deploy.compose import DEFAULT_COMPOSE_FILE, Build, Project, Service, load_project
from flashmoe.deploy.engine import (LABEL_PROJECT, LABEL_SERVICE, ServiceStatus, build_context,
                                    format_status)
from flashmoe.deploy.syntax import DeployError, interpolate

__all__ = ["DEFAULT_COMPOSE_FILE", "LABEL_PROJECT", "LABEL_SERVICE", "Build", "DeployError",
           "Project", "Service", "ServiceStatus", "build_context", "deploy_down", "deploy_status",
           "deploy_up", "format_status", "interpolate", "load_project"]

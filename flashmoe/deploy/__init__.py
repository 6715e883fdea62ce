"""`flashmoe deploy up|status|down`: compose.yaml's services through the Docker Engine API.

The Docker SDK (``docker`` on PyPI) has no compose, so this module reads the compose file(s)
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
  does not take these containers for its own, nor this module Compose's.
- ``up`` creates the networks and volumes, builds (only the files the Dockerfile copies are
  sent) or pulls missing images, then creates and starts containers in dependency order,
  waiting for ``service_healthy`` / ``service_completed_successfully`` conditions. A container
  whose configuration (or image) changed is recreated; an unchanged one is left running.
- ``status`` lists each service's container, state and health; ``down`` stops and removes the
  project's containers and networks, and its volumes only when asked.

Relative host paths (bind mounts, the seccomp profile, env files, build context) are resolved
against the folder of the first compose file, as Docker Compose does; bind sources must exist
on the engine's host (they are not created, unlike Compose's short volume syntax).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shlex
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_COMPOSE_FILE = "compose.yaml"
DEFAULT_TIMEOUT_S = 300.0
POLL_S = 0.5

LABEL_PROJECT = "io.flashmoe.project"
LABEL_SERVICE = "io.flashmoe.service"
LABEL_CONFIG_HASH = "io.flashmoe.config-hash"
LABEL_NETWORK = "io.flashmoe.network"
LABEL_VOLUME = "io.flashmoe.volume"

# The service keys this module turns into Engine API fields (see _service).
SERVICE_KEYS = frozenset({
    "build", "cap_add", "cap_drop", "command", "depends_on", "entrypoint", "env_file",
    "environment", "healthcheck", "hostname", "image", "init", "ipc", "labels", "networks",
    "ports", "profiles", "read_only", "restart", "security_opt", "shm_size", "stop_grace_period",
    "stop_signal", "tmpfs", "ulimits", "user", "volumes", "working_dir",
})
TOP_LEVEL_KEYS = frozenset({"name", "services", "volumes", "networks", "version"})
# Service keys whose values replace the base file's in an override file (others merge).
REPLACED_ON_MERGE = frozenset({"command", "entrypoint"})


class DeployError(RuntimeError):
    """The compose file cannot be deployed as written, or the engine refused a step."""


# --- YAML as Compose reads it ------------------------------------------------------------------

class _ComposeLoader(yaml.SafeLoader):
    """YAML 1.2 scalars, as Compose's Go parser reads them: ``yes``/``no``/``on``/``off`` stay
    strings and ``22:22`` is not a base-60 number (PyYAML's YAML 1.1 defaults)."""


_ComposeLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers
            if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int",
                           "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_ComposeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"))
_ComposeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^[-+]?(?:0|[1-9][0-9]*)$"), list("-+0123456789"))
_ComposeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?$"), list("-+0123456789."))


def _load_yaml(path: Path) -> dict:
    try:
        data = yaml.load(path.read_text(), Loader=_ComposeLoader)
    except OSError as exc:
        raise DeployError(f"cannot read compose file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise DeployError(f"compose file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise DeployError(f"compose file {path}: expected a mapping at the top level")
    return data


# --- interpolation -----------------------------------------------------------------------------

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BRACED = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])(.*))?", re.DOTALL)


def interpolate(text: str, env: Mapping[str, str], where: str,
                unset: set[str] | None = None) -> str:
    """Compose's ``${VAR}`` substitution in one string; names of unset variables used without
    a default are added to ``unset`` (Compose warns about them and uses "")."""
    out, i = [], 0
    while i < len(text):
        dollar = text.find("$", i)
        if dollar < 0:
            out.append(text[i:])
            break
        out.append(text[i:dollar])
        nxt = text[dollar + 1:dollar + 2]
        if nxt == "$":
            out.append("$")
            i = dollar + 2
        elif nxt == "{":
            end = _closing_brace(text, dollar + 1, where)
            out.append(_substitute(text[dollar + 2:end], env, where, unset))
            i = end + 1
        elif (match := _NAME.match(text, dollar + 1)) is not None:
            out.append(_lookup(match.group(), env, unset))
            i = match.end()
        else:
            out.append("$")
            i = dollar + 1
    return "".join(out)


def _closing_brace(text: str, open_at: int, where: str) -> int:
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    raise DeployError(f"{where}: unclosed '${{' in {text!r}")


def _lookup(name: str, env: Mapping[str, str], unset: set[str] | None) -> str:
    if name not in env and unset is not None:
        unset.add(name)
    return env.get(name, "")


def _substitute(expr: str, env: Mapping[str, str], where: str,
                unset: set[str] | None) -> str:
    match = _BRACED.fullmatch(expr)
    if match is None:
        raise DeployError(f"{where}: invalid interpolation '${{{expr}}}'")
    name, op, arg = match.groups()
    if op is None:
        return _lookup(name, env, unset)
    value = env.get(name)
    present = value is not None and (value != "" or not op.startswith(":"))
    if op.endswith("-"):
        return value if present else interpolate(arg, env, where, unset)
    if op.endswith("+"):
        return interpolate(arg, env, where, unset) if present else ""
    if not present:  # ? and :?
        raise DeployError(f"{where}: required variable {name} is missing a value: "
                          f"{interpolate(arg, env, where, unset) or 'unset'}")
    return value


def _interpolate_tree(node: Any, env: Mapping[str, str], where: str, unset: set[str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env, where, unset)
    if isinstance(node, list):
        return [_interpolate_tree(v, env, f"{where}[{i}]", unset) for i, v in enumerate(node)]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env, f"{where}.{k}", unset) for k, v in node.items()}
    return node


def parse_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines (``#`` comments, blank lines, ``export``, quoted values)."""
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not _NAME.fullmatch(key):
            raise DeployError(f"{path}:{number}: expected KEY=VALUE, got {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        elif " #" in value:
            value = value.split(" #", 1)[0].rstrip()
        values[key] = value
    return values


# --- units -------------------------------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNIT_NS = {"ns": 1, "us": 1_000, "µs": 1_000, "ms": 1_000_000, "s": 1_000_000_000,
                     "m": 60_000_000_000, "h": 3_600_000_000_000}


def parse_duration_ns(value: str | float, where: str) -> int:
    """Compose durations (``10s``, ``1m30s``, ``500ms``; a bare number is seconds) in ns."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value * 1_000_000_000)
    text = str(value).strip()
    pos, total = 0, 0.0
    while pos < len(text):
        match = _DURATION_PART.match(text, pos)
        if match is None:
            raise DeployError(f"{where}: {value!r} is not a duration (examples: 10s, 1m30s, "
                              f"500ms)")
        total += float(match.group(1)) * _DURATION_UNIT_NS[match.group(2)]
        pos = match.end()
    if not text:
        raise DeployError(f"{where}: empty duration")
    return int(total)


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?", re.IGNORECASE)


def parse_size_bytes(value: str | int, where: str) -> int:
    """Compose byte sizes (``8gb``, ``64m``, ``1024``), in powers of 1024 as Compose reads
    them."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _SIZE.fullmatch(str(value).strip())
    if match is None:
        raise DeployError(f"{where}: {value!r} is not a size (examples: 8gb, 64m, 1024)")
    scale = 1024 ** "bkmgt".index(match.group(2).lower() or "b")
    return int(float(match.group(1)) * scale)


# --- the project model -------------------------------------------------------------------------

@dataclass
class Build:
    context: Path
    dockerfile: str = "Dockerfile"
    args: dict[str, str] = field(default_factory=dict)
    target: str | None = None


@dataclass
class Dependency:
    condition: str = "service_started"
    required: bool = True
    restart: bool = False


@dataclass
class Service:
    """One service of the compose file, in the Engine API's terms."""

    name: str
    image: str
    build: Build | None
    command: list[str] | None
    entrypoint: list[str] | None
    environment: dict[str, str]
    mounts: list[dict[str, Any]]
    tmpfs: dict[str, str]
    shm_size: int | None
    ipc: str | None
    ulimits: list[tuple[str, int, int]]
    security_opt: list[str]  # a seccomp profile already as its JSON contents
    cap_add: list[str]
    cap_drop: list[str]
    healthcheck: dict[str, Any] | None  # Engine API HealthConfig
    restart: dict[str, Any]  # Engine API RestartPolicy
    ports: dict[str, list[tuple[str, str]]]  # "8470/tcp" -> [(host ip, host port)]
    networks: dict[str, list[str]]  # compose network key -> aliases
    depends_on: dict[str, Dependency]
    profiles: list[str]
    init: bool | None = None
    user: str | None = None
    working_dir: str | None = None
    hostname: str | None = None
    read_only: bool | None = None
    stop_timeout_s: int | None = None
    stop_signal: str | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def implicit_dependencies(self) -> set[str]:
        """Services this one cannot start before although depends_on does not say so."""
        if self.ipc and self.ipc.startswith("service:"):
            return {self.ipc[len("service:"):]}
        return set()


@dataclass
class Resource:
    """A network or a volume of the project."""

    key: str  # the compose file's name for it
    name: str  # the engine's name for it
    external: bool = False
    driver: str | None = None
    driver_opts: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    internal: bool = False  # networks only
    attachable: bool | None = None  # networks only


@dataclass
class Project:
    name: str
    workdir: Path
    services: dict[str, Service]  # the services the active profiles enable
    order: list[str]  # dependency order (dependencies first)
    networks: dict[str, Resource]
    volumes: dict[str, Resource]
    compose_files: list[Path]
    warnings: list[str] = field(default_factory=list)

    def container_name(self, service: str) -> str:
        return f"{self.name}-{service}-1"


def normalize_project_name(name: str) -> str:
    """Compose's rule: lowercase letters, digits, ``-`` and ``_``, starting with a letter or
    digit."""
    normal = re.sub(r"[^a-z0-9_-]", "", name.lower()).lstrip("-_")
    if not normal:
        raise DeployError(f"project name {name!r} has no letter or digit left once "
                          f"normalized; give --project")
    return normal


def _as_paths(compose_files: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    if isinstance(compose_files, (str, os.PathLike)):
        return [Path(compose_files)]
    paths = [Path(p) for p in compose_files]
    if not paths:
        raise DeployError("no compose file given")
    return paths


def load_project(compose_files: str | os.PathLike | Sequence[str | os.PathLike]
                 = DEFAULT_COMPOSE_FILE, project: str | None = None,
                 profiles: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 all_profiles: bool = False) -> Project:
    """Read, interpolate and merge the compose file(s) into the services the profiles
    enable (``all_profiles``: every service), in dependency order."""
    paths = [p.resolve() for p in _as_paths(compose_files)]
    workdir = paths[0].parent
    environ = dict(os.environ if env is None else env)
    dotenv = workdir / ".env"
    if dotenv.is_file():
        environ = {**parse_env_file(dotenv), **environ}
    unset: set[str] = set()
    merged: dict[str, Any] = {}
    for path in paths:
        data = _load_yaml(path)
        for key in data:
            if key not in TOP_LEVEL_KEYS and not str(key).startswith("x-"):
                supported = ", ".join(sorted(TOP_LEVEL_KEYS))
                raise DeployError(f"{path}: top-level key {key!r} is not supported by "
                                  f"flashmoe deploy (supported: {supported})")
        data = {k: _interpolate_tree(v, environ, f"{path.name}:{k}", unset)
                for k, v in data.items() if not str(k).startswith("x-")}
        merged = _merge_files(merged, data)
    name = normalize_project_name(project or environ.get("COMPOSE_PROJECT_NAME")
                                  or merged.get("name") or workdir.name)
    active = set(profiles) or {p for p in environ.get("COMPOSE_PROFILES", "").split(",") if p}
    networks = {key: _resource(name, key, spec or {}, "network")
                for key, spec in (merged.get("networks") or {}).items()}
    networks.setdefault("default", Resource("default", f"{name}_default"))
    volumes = {key: _resource(name, key, spec or {}, "volume")
               for key, spec in (merged.get("volumes") or {}).items()}
    all_services = merged.get("services") or {}
    if not isinstance(all_services, dict) or not all_services:
        raise DeployError(f"{paths[0]}: no services")
    services = {}
    for svc_name, spec in all_services.items():
        service = _service(svc_name, spec or {}, name, workdir, environ, volumes, networks)
        if not service.profiles or all_profiles or active & set(service.profiles):
            services[svc_name] = service
    _drop_optional_dependencies(services, all_services)
    project_model = Project(name, workdir, services, _dependency_order(services), networks,
                            volumes, paths)
    project_model.warnings = [f"the {var} variable is not set: defaulting to a blank string"
                              for var in sorted(unset)]
    return project_model


def _merge_files(base: dict, override: dict) -> dict:
    """Compose's merge of an override file: mappings merge key by key; in a service,
    command and entrypoint are replaced, volumes merge by target, environment,
    labels, depends_on and ulimits by key, other sequences are appended to (no duplicates)."""
    out = dict(base)
    for key, value in override.items():
        if key == "services" and isinstance(value, dict):
            services = dict(out.get("services") or {})
            for name, spec in value.items():
                services[name] = _merge_service(services.get(name) or {}, spec or {})
            out["services"] = services
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _merge_service(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        old = out.get(key)
        if old is None or key in REPLACED_ON_MERGE:
            out[key] = value
        elif key in ("environment", "labels"):
            out[key] = {**_key_values(old, key), **_key_values(value, key)}
        elif key == "depends_on":
            out[key] = {**_dependency_specs(old), **_dependency_specs(value)}
        elif key == "volumes":
            merged = {_mount_target(v): v for v in old}
            merged.update({_mount_target(v): v for v in value})
            out[key] = list(merged.values())
        elif isinstance(old, dict) and isinstance(value, dict):
            out[key] = {**old, **value}
        elif isinstance(old, list) and isinstance(value, list):
            out[key] = old + [v for v in value if v not in old]
        else:
            out[key] = value
    return out


def _mount_target(spec: Any) -> str:
    if isinstance(spec, dict):
        return str(spec.get("target"))
    parts = str(spec).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def _resource(project: str, key: str, spec: dict, kind: str) -> Resource:
    where = f"{kind}s.{key}"
    external = spec.get("external", False)
    if isinstance(external, dict):  # the old `external: {name: x}` form
        spec = {**spec, "name": external.get("name", spec.get("name"))}
        external = True
    unknown = set(spec) - {"name", "external", "driver", "driver_opts", "labels", "internal",
                           "attachable"}
    if unknown:
        raise DeployError(f"{where}: {', '.join(sorted(unknown))} not supported by flashmoe "
                          f"deploy")
    name = spec.get("name") or (key if external else f"{project}_{key}")
    return Resource(key, str(name), bool(external), spec.get("driver"),
                    {k: str(v) for k, v in (spec.get("driver_opts") or {}).items()},
                    _key_values(spec.get("labels") or {}, f"{where}.labels"),
                    bool(spec.get("internal", False)), spec.get("attachable"))


def _key_values(value: Any, where: str, env: Mapping[str, str] | None = None) -> dict:
    """A mapping or a list of KEY=VALUE; a bare KEY (or KEY: null) takes its value from
    ``env`` and is left out when it is not set there."""
    items: list[tuple[str, Any]]
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = []
        for entry in value:
            key, sep, val = str(entry).partition("=")
            items.append((key, val if sep else None))
    else:
        raise DeployError(f"{where}: expected a mapping or a list of KEY=VALUE")
    out = {}
    for key, val in items:
        if val is None:
            if env is not None and key in env:
                out[str(key)] = env[key]
            continue
        out[str(key)] = "true" if val is True else "false" if val is False else str(val)
    return out


def _dependency_specs(value: Any) -> dict[str, dict]:
    if isinstance(value, list):
        return {str(name): {"condition": "service_started"} for name in value}
    if isinstance(value, dict):
        return {str(name): dict(spec or {}) for name, spec in value.items()}
    raise DeployError(f"depends_on: expected a list or a mapping, got {value!r}")


def _words(value: Any, where: str) -> list[str] | None:
    """command/entrypoint: a list as it is, a string split as a shell would."""
    if value is None:
        return None
    if isinstance(value, list):
        return [str(v) for v in value]
    try:
        return shlex.split(str(value))
    except ValueError as exc:
        raise DeployError(f"{where}: {exc}") from None


def _service(name: str, spec: dict, project: str, workdir: Path, env: Mapping[str, str],
             volumes: dict[str, Resource], networks: dict[str, Resource]) -> Service:
    where = f"services.{name}"
    if not isinstance(spec, dict):
        raise DeployError(f"{where}: expected a mapping")
    unknown = {k for k in spec if k not in SERVICE_KEYS and not str(k).startswith("x-")}
    if unknown:
        raise DeployError(f"{where}: {', '.join(sorted(unknown))} not supported by flashmoe "
                          f"deploy (supported: {', '.join(sorted(SERVICE_KEYS))}); use "
                          f"docker compose for this file")
    build = _build(spec.get("build"), workdir, where) if spec.get("build") else None
    image = spec.get("image")
    if not image:
        if build is None:
            raise DeployError(f"{where}: needs an image or a build section")
        image = f"{project}-{name}"  # Compose's name for a built image
    environment: dict[str, str] = {}
    for entry in _env_files(spec.get("env_file"), where):
        path = (workdir / entry["path"]).resolve()
        if path.is_file():
            environment.update(parse_env_file(path))
        elif entry.get("required", True):
            raise DeployError(f"{where}.env_file: {path} does not exist (set required: false "
                              f"to make it optional)")
    environment.update(_key_values(spec.get("environment") or {}, f"{where}.environment", env))
    service_networks = spec.get("networks") or ["default"]
    if isinstance(service_networks, list):
        service_networks = {n: None for n in service_networks}
    nets = {}
    for key, net_spec in service_networks.items():
        if key not in networks:
            raise DeployError(f"{where}.networks: network {key!r} is not declared in the "
                              f"top-level networks")
        nets[key] = [name, *((net_spec or {}).get("aliases") or [])]
    return Service(
        name=name, image=str(image), build=build,
        command=_words(spec.get("command"), f"{where}.command"),
        entrypoint=_words(spec.get("entrypoint"), f"{where}.entrypoint"),
        environment=environment,
        mounts=[_mount(v, workdir, volumes, f"{where}.volumes") for v in spec.get("volumes") or []],
        tmpfs=_tmpfs(spec.get("tmpfs"), where),
        shm_size=(parse_size_bytes(spec["shm_size"], f"{where}.shm_size")
                  if spec.get("shm_size") not in (None, "") else None),
        ipc=spec.get("ipc"),
        ulimits=_ulimits(spec.get("ulimits") or {}, where),
        security_opt=[_security_opt(o, workdir, where) for o in spec.get("security_opt") or []],
        cap_add=list(spec.get("cap_add") or []), cap_drop=list(spec.get("cap_drop") or []),
        healthcheck=_healthcheck(spec.get("healthcheck"), where),
        restart=_restart_policy(spec.get("restart", "no"), where),
        ports=_ports(spec.get("ports") or [], where),
        networks=nets,
        depends_on={dep: _dependency(dep_spec, f"{where}.depends_on.{dep}")
                    for dep, dep_spec in _dependency_specs(spec.get("depends_on") or {}).items()},
        profiles=[str(p) for p in spec.get("profiles") or []],
        init=spec.get("init"), user=spec.get("user"), working_dir=spec.get("working_dir"),
        hostname=spec.get("hostname"), read_only=spec.get("read_only"),
        stop_timeout_s=(round(parse_duration_ns(spec["stop_grace_period"],
                                                f"{where}.stop_grace_period") / 1e9)
                        if spec.get("stop_grace_period") is not None else None),
        stop_signal=spec.get("stop_signal"),
        labels=_key_values(spec.get("labels") or {}, f"{where}.labels"),
    )


def _build(spec: Any, workdir: Path, where: str) -> Build:
    if isinstance(spec, str):
        spec = {"context": spec}
    unknown = set(spec) - {"context", "dockerfile", "args", "target"}
    if unknown:
        raise DeployError(f"{where}.build: {', '.join(sorted(unknown))} not supported by "
                          f"flashmoe deploy")
    return Build(context=(workdir / spec.get("context", ".")).resolve(),
                 dockerfile=spec.get("dockerfile", "Dockerfile"),
                 args=_key_values(spec.get("args") or {}, f"{where}.build.args"),
                 target=spec.get("target"))


def _env_files(value: Any, where: str) -> list[dict]:
    if value is None:
        return []
    entries = value if isinstance(value, list) else [value]
    out = []
    for entry in entries:
        if isinstance(entry, str):
            out.append({"path": entry, "required": True})
        elif isinstance(entry, dict) and "path" in entry:
            out.append(entry)
        else:
            raise DeployError(f"{where}.env_file: expected a path or {{path, required}}")
    return out


def _is_host_path(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def _host_path(source: str, workdir: Path) -> str:
    return str((workdir / os.path.expanduser(source)).resolve())


def _mount(spec: Any, workdir: Path, volumes: dict[str, Resource], where: str) -> dict:
    """A short (``SRC:DST[:ro]``) or long volume entry -> an Engine API Mount."""
    if isinstance(spec, str):
        parts = spec.split(":")
        if len(parts) == 1:
            return {"Type": "volume", "Target": parts[0], "ReadOnly": False}
        if len(parts) > 3:
            raise DeployError(f"{where}: {spec!r}: expected SOURCE:TARGET[:MODE]")
        options = parts[2].split(",") if len(parts) == 3 else []
        bad = set(options) - {"ro", "rw"}
        if bad:
            raise DeployError(f"{where}: {spec!r}: mode {','.join(sorted(bad))} not supported "
                              f"by flashmoe deploy (ro, rw)")
        spec = {"type": "bind" if _is_host_path(parts[0]) else "volume", "source": parts[0],
                "target": parts[1], "read_only": "ro" in options}
    unknown = set(spec) - {"type", "source", "target", "read_only", "volume", "tmpfs", "bind"}
    if unknown:
        raise DeployError(f"{where}: {', '.join(sorted(unknown))} not supported by flashmoe "
                          f"deploy")
    kind, source, target = spec.get("type"), spec.get("source"), spec.get("target")
    mount: dict[str, Any] = {"Type": kind, "Target": target,
                             "ReadOnly": bool(spec.get("read_only", False))}
    if kind == "bind":
        mount["Source"] = _host_path(str(source), workdir)
    elif kind == "volume":
        if source:
            if source not in volumes:
                raise DeployError(f"{where}: volume {source!r} is not declared in the "
                                  f"top-level volumes")
            mount["Source"] = volumes[source].name
        if (spec.get("volume") or {}).get("nocopy"):
            mount["VolumeOptions"] = {"NoCopy": True}
    elif kind == "tmpfs":
        tmpfs = spec.get("tmpfs") or {}
        options = {}
        if "size" in tmpfs:
            options["SizeBytes"] = parse_size_bytes(tmpfs["size"], f"{where}.tmpfs.size")
        if "mode" in tmpfs:
            options["Mode"] = int(str(tmpfs["mode"]), 8)
        if options:
            mount["TmpfsOptions"] = options
    else:
        raise DeployError(f"{where}: mount type {kind!r} not supported by flashmoe deploy "
                          f"(bind, volume, tmpfs)")
    return mount


def _tmpfs(value: Any, where: str) -> dict[str, str]:
    entries = [value] if isinstance(value, str) else list(value or [])
    out = {}
    for entry in entries:
        path, _, options = str(entry).partition(":")
        out[path] = options
    return out


def _ulimits(spec: dict, where: str) -> list[tuple[str, int, int]]:
    out = []
    for name, value in spec.items():
        if isinstance(value, dict):
            soft, hard = value.get("soft"), value.get("hard")
        else:
            soft = hard = value
        try:
            out.append((str(name), int(soft), int(hard)))
        except (TypeError, ValueError):
            raise DeployError(f"{where}.ulimits.{name}: expected a number or {{soft, hard}}") \
                from None
    return out


def _security_opt(option: str, workdir: Path, where: str) -> str:
    """``seccomp=FILE`` -> ``seccomp=<the file's JSON, compacted>``: the engine takes the
    profile's contents, not a path (the docker CLI and Compose read the file the same way)."""
    key, sep, value = str(option).partition("=")
    if key == "seccomp" and not sep:
        key, sep, value = str(option).partition(":")
    if key != "seccomp" or value == "unconfined":
        return str(option)
    path = Path(_host_path(value, workdir))
    try:
        profile = json.loads(path.read_text())
    except OSError as exc:
        raise DeployError(f"{where}.security_opt: cannot read seccomp profile {path}: "
                          f"{exc.strerror}") from None
    except ValueError as exc:
        raise DeployError(f"{where}.security_opt: seccomp profile {path} is not JSON: "
                          f"{exc}") from None
    return "seccomp=" + json.dumps(profile, separators=(",", ":"))


def _healthcheck(spec: dict | None, where: str) -> dict | None:
    if spec is None:
        return None
    if spec.get("disable"):
        return {"Test": ["NONE"]}
    test = spec.get("test")
    if isinstance(test, str):
        test = ["CMD-SHELL", test]
    if not test:
        raise DeployError(f"{where}.healthcheck: needs a test (or disable: true)")
    config: dict[str, Any] = {"Test": [str(t) for t in test]}
    for key, api_key in (("interval", "Interval"), ("timeout", "Timeout"),
                         ("start_period", "StartPeriod"), ("start_interval", "StartInterval")):
        if spec.get(key) is not None:
            config[api_key] = parse_duration_ns(spec[key], f"{where}.healthcheck.{key}")
    if spec.get("retries") is not None:
        config["Retries"] = int(spec["retries"])
    unknown = set(spec) - {"test", "interval", "timeout", "start_period", "start_interval",
                           "retries", "disable"}
    if unknown:
        raise DeployError(f"{where}.healthcheck: {', '.join(sorted(unknown))} not supported")
    return config


def _restart_policy(value: Any, where: str) -> dict[str, Any]:
    name, _, retries = str(value).partition(":")
    if name not in ("no", "always", "on-failure", "unless-stopped"):
        raise DeployError(f"{where}.restart: {value!r} is not one of no, always, "
                          f"on-failure[:N], unless-stopped")
    policy: dict[str, Any] = {"Name": "" if name == "no" else name}
    if retries:
        policy["MaximumRetryCount"] = int(retries)
    return policy


_PORT = re.compile(r"(?:(?:(?P<ip>[0-9.]+|\[[0-9a-fA-F:]+\]):)?(?P<host>\d*):)?"
                   r"(?P<container>\d+)(?:/(?P<proto>tcp|udp|sctp))?")


def _ports(entries: list, where: str) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for entry in entries:
        if isinstance(entry, dict):
            key = f"{entry['target']}/{entry.get('protocol', 'tcp')}"
            binding = (str(entry.get("host_ip", "")), str(entry.get("published", "")))
        else:
            match = _PORT.fullmatch(str(entry))
            if match is None:
                raise DeployError(f"{where}.ports: {entry!r}: expected [[IP:]HOST:]CONTAINER"
                                  f"[/PROTOCOL] (ranges are not supported by flashmoe deploy)")
            key = f"{match['container']}/{match['proto'] or 'tcp'}"
            binding = ((match["ip"] or "").strip("[]"), match["host"] or "")
        out.setdefault(key, []).append(binding)
    return out


def _dependency(spec: dict, where: str) -> Dependency:
    condition = spec.get("condition", "service_started")
    if condition not in ("service_started", "service_healthy",
                         "service_completed_successfully"):
        raise DeployError(f"{where}: condition {condition!r} is not one of service_started, "
                          f"service_healthy, service_completed_successfully")
    return Dependency(condition, bool(spec.get("required", True)),
                      bool(spec.get("restart", False)))


def _drop_optional_dependencies(services: dict[str, Service], declared: dict) -> None:
    for service in services.values():
        for dep in list(service.depends_on):
            if dep in services:
                continue
            if dep in declared and not service.depends_on[dep].required:
                del service.depends_on[dep]
            elif dep in declared:
                raise DeployError(f"service {service.name} depends on {dep}, which the active "
                                  f"profiles do not enable (add --profile for it)")
            else:
                raise DeployError(f"service {service.name} depends on undefined service {dep}")
        for dep in service.implicit_dependencies():
            if dep not in services:
                raise DeployError(f"service {service.name} uses ipc of service {dep}, which "
                                  f"is not enabled")


def _dependency_order(services: dict[str, Service]) -> list[str]:
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "visiting":
            raise DeployError(f"dependency cycle: {' -> '.join([*path, name])}")
        state[name] = "visiting"
        service = services[name]
        for dep in sorted(set(service.depends_on) | service.implicit_dependencies()):
            visit(dep, [*path, name])
        state[name] = "done"
        order.append(name)

    for name in services:
        visit(name, [])
    return order


# --- the engine ------------------------------------------------------------------------------

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


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@contextmanager
def _engine(client, docker_host: str | None) -> Iterator[Any]:
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


def _label_filter(**labels: str) -> dict:
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


def _project_containers(client, project: str, service: str | None = None) -> list:
    """The project's containers (of one service), stopped ones included. Not through the
    SDK's containers.list: that adds ``trunc_cmd``, a query parameter the Engine API's
    definition does not have."""
    from docker.errors import NotFound

    labels = {LABEL_PROJECT: project, **({LABEL_SERVICE: service} if service else {})}
    summaries = _engine_get(client, "/containers/json",
                            {"all": "1", "filters": json.dumps(_label_filter(**labels))})
    containers = []
    for summary in summaries:
        try:
            containers.append(client.containers.get(summary["Id"]))
        except NotFound:
            pass  # removed meanwhile
    return containers


def _ensure_network(client, project: Project, net: Resource, log) -> None:
    from docker.errors import NotFound

    try:
        existing = client.networks.get(net.name)
    except NotFound:
        existing = None
    if net.external:
        if existing is None:
            raise DeployError(f"network {net.name} is declared external but does not exist "
                              f"(create it first)")
        return
    if existing is not None:
        owner = (existing.attrs.get("Labels") or {}).get(LABEL_PROJECT)
        if owner != project.name:
            raise DeployError(f"network {net.name} exists and does not belong to project "
                              f"{project.name} (its {LABEL_PROJECT} label: {owner!r}); "
                              f"remove it or declare it external")
        return
    client.networks.create(net.name, driver=net.driver or "bridge",
                           options=net.driver_opts or None, internal=net.internal,
                           attachable=net.attachable,
                           labels={**net.labels, LABEL_PROJECT: project.name,
                                   LABEL_NETWORK: net.key})
    log(f"network {net.name}: created")


def _ensure_volume(client, project: Project, vol: Resource, log) -> None:
    from docker.errors import NotFound

    try:
        existing = client.volumes.get(vol.name)
    except NotFound:
        existing = None
    if vol.external:
        if existing is None:
            raise DeployError(f"volume {vol.name} is declared external but does not exist "
                              f"(create it first)")
        return
    if existing is not None:
        if (existing.attrs.get("Labels") or {}).get(LABEL_PROJECT) != project.name:
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


def build_context(build: Build) -> io.BytesIO:
    """A tar of the Dockerfile and the context files its COPY/ADD instructions read (never
    caches, virtual environments or compiled objects)."""
    dockerfile = build.context / build.dockerfile
    if not dockerfile.is_file():
        raise DeployError(f"Dockerfile {dockerfile} does not exist")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(dockerfile, arcname=build.dockerfile)
        for pattern in _dockerfile_sources(dockerfile):
            matches = sorted(build.context.glob(pattern.lstrip("/"))) or []
            if not matches:
                raise DeployError(f"{dockerfile}: COPY source {pattern!r} matches nothing in "
                                  f"{build.context}")
            for path in matches:
                for item in ([path] if path.is_file() else sorted(path.rglob("*"))):
                    rel = item.relative_to(build.context).as_posix()
                    if item.is_file() and not _CONTEXT_SKIP.search(rel):
                        tar.add(item, arcname=rel, recursive=False)
    buf.seek(0)
    return buf


def _ensure_image(client, service: Service, rebuild: bool, done: dict[str, str], log) -> str:
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


def _container_state(container) -> tuple[str, str]:
    state = container.attrs.get("State") or {}
    return state.get("Status", "unknown"), (state.get("Health") or {}).get("Status", "-")


def _wait_for(client, project: Project, service: Service, dep: str, condition: str,
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
        status, health = _container_state(container)
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


def _up_service(client, project: Project, service: Service, image_id: str,
                started: set[str], log) -> None:
    """Create (or recreate on a changed config) and start the service's container."""
    config = container_config(client, project, service)
    config_hash = _config_hash(config, image_id)
    config["Labels"][LABEL_CONFIG_HASH] = config_hash
    name = project.container_name(service.name)
    existing = _project_containers(client, project.name, service.name)
    restart_for = [dep for dep, spec in service.depends_on.items()
                   if spec.restart and dep in started]
    for container in existing:
        if container.labels.get(LABEL_CONFIG_HASH) == config_hash and container.name == name:
            status, _ = _container_state(container)
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


def deploy_up(compose_files: str | os.PathLike | Sequence[str | os.PathLike]
              = DEFAULT_COMPOSE_FILE, project: str | None = None, *,
              profiles: Sequence[str] = (), client=None, docker_host: str | None = None,
              build: bool = False, wait: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S,
              log: Callable[[str], None] = _stderr) -> list[ServiceStatus]:
    """Create what the compose file describes and start it; ``build``: rebuild images that
    have a build section even when present; ``wait``: also wait until every service is
    running and, where it has a healthcheck, healthy. Returns the status rows."""
    model = load_project(compose_files, project, profiles)
    for warning in model.warnings:
        log(f"warning: {warning}")
    deadline = time.monotonic() + timeout_s
    with _engine(client, docker_host) as engine:
        used_networks = {key for s in model.services.values() for key in s.networks}
        for key in sorted(used_networks):
            _ensure_network(engine, model, model.networks[key], log)
        # Like Compose, only what the enabled services use (redis-data only with `cluster`).
        used_volumes = {m["Source"] for s in model.services.values() for m in s.mounts
                        if m["Type"] == "volume" and m.get("Source")}
        for vol in model.volumes.values():
            if vol.name in used_volumes:
                _ensure_volume(engine, model, vol, log)
        images: dict[str, str] = {}
        image_ids = {name: _ensure_image(engine, model.services[name], build, images, log)
                     for name in model.order}
        started: set[str] = set()
        for name in model.order:
            service = model.services[name]
            for dep, spec in service.depends_on.items():
                _wait_for(engine, model, service, dep, spec.condition, deadline, log)
            for dep in service.implicit_dependencies() - set(service.depends_on):
                _wait_for(engine, model, service, dep, "service_started", deadline, log)
            _up_service(engine, model, service, image_ids[name], started, log)
        if wait:
            for name in model.order:
                condition = ("service_healthy" if model.services[name].healthcheck
                             and model.services[name].healthcheck["Test"] != ["NONE"]
                             else "service_started")
                _wait_for(engine, model, model.services[name], name, condition, deadline, log)
        return _status_rows(engine, model)


def _status_rows(client, model: Project) -> list[ServiceStatus]:
    by_service: dict[str, Any] = {}
    for container in _project_containers(client, model.name):
        by_service.setdefault(container.labels.get(LABEL_SERVICE, "?"), container)
    rows = []
    for name in [*model.order, *sorted(set(by_service) - set(model.order))]:
        container = by_service.get(name)
        if container is None:
            service = model.services[name]
            rows.append(ServiceStatus(name, None, "missing", "-", service.image))
            continue
        container.reload()
        status, health = _container_state(container)
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
    with _engine(client, docker_host) as engine:
        return _status_rows(engine, model)


def deploy_down(compose_files: str | os.PathLike | Sequence[str | os.PathLike]
                = DEFAULT_COMPOSE_FILE, project: str | None = None, *,
                profiles: Sequence[str] = (), client=None, docker_host: str | None = None,
                volumes: bool = False, timeout_s: int | None = None,
                log: Callable[[str], None] = _stderr) -> list[str]:
    """Stop and remove the project's containers (dependents first) and networks, and with
    ``volumes`` its volumes; returns what was removed. ``timeout_s``: seconds each container
    gets to stop (default: its stop_grace_period)."""
    model = load_project(compose_files, project, profiles, all_profiles=not profiles)
    removed = []
    with _engine(client, docker_host) as engine:
        rank = {name: i for i, name in enumerate(model.order)}
        containers = sorted(_project_containers(engine, model.name),
                            key=lambda c: -rank.get(c.labels.get(LABEL_SERVICE), len(rank)))
        for container in containers:
            if _container_state(container)[0] in ("running", "restarting", "paused"):
                container.stop(timeout=timeout_s)
            container.remove()
            log(f"container {container.name}: removed")
            removed.append(f"container {container.name}")
        for net in engine.networks.list(filters=_label_filter(**{LABEL_PROJECT: model.name})):
            net.remove()
            log(f"network {net.name}: removed")
            removed.append(f"network {net.name}")
        if volumes:
            for vol in engine.volumes.list(
                    filters=_label_filter(**{LABEL_PROJECT: model.name})):
                vol.remove()
                log(f"volume {vol.name}: removed")
                removed.append(f"volume {vol.name}")
    return removed

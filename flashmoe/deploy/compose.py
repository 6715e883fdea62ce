"""The compose-file model: the project, its services, volumes and networks as
``load_project`` reads them from one or more files (override files merged as compose merges
them)."""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashmoe.deploy.syntax import (DeployError, interpolate_tree, load_yaml, parse_duration_ns,
                                    parse_env_file, parse_size_bytes)


DEFAULT_COMPOSE_FILE = "compose.yaml"
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
                 all_profiles: bool = False, only: Sequence[str] = ()) -> Project:
    """Read, interpolate and merge the compose file(s) into the services the profiles
    enable (``all_profiles``: every service), in dependency order. ``only``: these services
    and what they depend on, as ``docker compose up SERVICE...`` starts them (a service
    named here is enabled whatever its profiles; its dependencies must be enabled)."""
    paths = [p.resolve() for p in _as_paths(compose_files)]
    workdir = paths[0].parent
    environ = dict(os.environ if env is None else env)
    dotenv = workdir / ".env"
    if dotenv.is_file():
        environ = {**parse_env_file(dotenv), **environ}
    unset: set[str] = set()
    merged: dict[str, Any] = {}
    for path in paths:
        data = load_yaml(path)
        for key in data:
            if key not in TOP_LEVEL_KEYS and not str(key).startswith("x-"):
                supported = ", ".join(sorted(TOP_LEVEL_KEYS))
                raise DeployError(f"{path}: top-level key {key!r} is not supported by "
                                  f"flashmoe deploy (supported: {supported})")
        data = {k: interpolate_tree(v, environ, f"{path.name}:{k}", unset)
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
    unknown = [s for s in only if s not in all_services]
    if unknown:
        raise DeployError(f"no such service: {', '.join(unknown)} (the compose file has "
                          f"{', '.join(all_services)})")
    services = {}
    for svc_name, spec in all_services.items():
        service = _service(svc_name, spec or {}, name, workdir, environ, volumes, networks)
        if (not service.profiles or all_profiles or active & set(service.profiles)
                or svc_name in only):
            services[svc_name] = service
    _drop_optional_dependencies(services, all_services)
    if only:
        services = {s: services[s] for s in _with_dependencies(services, only)}
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


def _with_dependencies(services: dict[str, Service], names: Sequence[str]) -> list[str]:
    """``names`` and every service they depend on, directly or not, in the file's order."""
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            service = services[name]
            todo.extend(set(service.depends_on) | service.implicit_dependencies())
    return [name for name in services if name in wanted]


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

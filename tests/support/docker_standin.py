"""A stand-in for the Docker Engine API, for tests on machines where no Docker engine runs.

An HTTP server on a unix socket that serves the endpoints `flashmoe deploy` drives through the
Docker SDK (images, build, pull, networks, volumes, containers: create, inspect, list, start,
restart, stop, remove), keeping its state in memory. Every request is first checked against
the Engine API's published definition, moby's ``api/swagger.yaml`` (committed under
``tests/data/moby/`` with moby's license; see its README.md for the commit), as
``tests/support/engine_api_spec.py`` reads it: paths, methods, query parameters and JSON
bodies, with no field the schema does not declare: the engine decodes into fixed Go structs
and silently drops unknown fields, which is how a misspelled or retired field would go
unnoticed.

A request that fails a check is answered 400 with the reason (and kept in ``refused``); a
request the spec allows but the stand-in does not implement is answered 501. Header
parameters are not checked: the SDK sends its build context as ``application/tar`` where the
spec's enum says ``application/x-tar``, and the engine reads neither.

Beyond the spec, the stand-in enforces the engine's own rules that a deploy can trip over:
unknown images, networks and containers are 404; a second container or network of one name
is 409; a running container cannot be removed (409), nor a volume in use (409), nor a
network with running containers (403); a container can join another's IPC namespace only
if that one is running with ``IpcMode: shareable``. Healthchecks do not run: a started
container with a healthcheck reports ``starting`` for ``health_inspections`` inspections,
then ``healthy`` (or ``unhealthy`` when its name is in ``unhealthy``).

Run it alone: ``python -m tests.support.docker_standin /tmp/docker.sock``, then
``flashmoe deploy up --docker-host unix:///tmp/docker.sock``.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import secrets
import socketserver
import tarfile
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.support.engine_api_spec import (BOOL_WORDS, Checked, EngineApiSpec, EngineError,
                                           SpecViolation)


# --- the engine's state ------------------------------------------------------------------------

@dataclass
class Request:
    method: str
    path: str  # without the /v1.NN prefix
    template: str | None
    query: dict[str, list[str]]
    body: Any
    status: int = 0
    reason: str = ""
    response: Any = None  # the JSON answer, as sent


@dataclass
class Build:
    tags: list[str]
    dockerfile: str
    files: list[str]  # the context tar's members


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000000Z", time.gmtime())


def _matches_filters(labels: dict, name: str, filters: dict) -> bool:
    for wanted in filters.get("label", []):
        key, sep, value = wanted.partition("=")
        if key not in labels or (sep and labels[key] != value):
            return False
    names = filters.get("name", [])
    return not names or any(n.lstrip("/") in name for n in names)


class Engine:
    """The engine's objects, in memory; methods raise EngineError as the engine answers."""

    def __init__(self, api_version: str) -> None:
        self.api_version = api_version
        self.lock = threading.RLock()
        self.images: dict[str, dict] = {}  # id -> {Id, RepoTags, ...}
        self.containers: dict[str, dict] = {}  # id -> inspect document
        self.networks: dict[str, dict] = {}  # id -> inspect document
        self.volumes: dict[str, dict] = {}  # name -> inspect document
        self.builds: list[Build] = []
        self.pulls: list[str] = []
        self.health_inspections = 1
        self.unhealthy: set[str] = set()
        self._health_seen: dict[str, int] = {}

    # images
    def add_image(self, tag: str) -> dict:
        with self.lock:
            image_id = "sha256:" + hashlib.sha256(f"{tag}{len(self.images)}".encode()).hexdigest()
            for image in self.images.values():
                if tag in image["RepoTags"]:
                    image["RepoTags"].remove(tag)
            full = tag if ":" in tag.rsplit("/", 1)[-1] else f"{tag}:latest"
            image = {"Id": image_id, "RepoTags": [full], "RepoDigests": [], "Created": _now(),
                     "Size": 0, "Config": {}, "Os": "linux", "Architecture": "amd64"}
            self.images[image_id] = image
            return image

    def image(self, ref: str) -> dict:
        with self.lock:
            full = ref if ":" in ref.rsplit("/", 1)[-1] else f"{ref}:latest"
            for image in self.images.values():
                if (full in image["RepoTags"] or image["Id"] == ref
                        or image["Id"].removeprefix("sha256:").startswith(
                            ref.removeprefix("sha256:")) and len(ref) >= 12):
                    return image
        raise EngineError(404, f"No such image: {ref}")

    # networks
    def network(self, ref: str) -> dict:
        with self.lock:
            for net in self.networks.values():
                if ref in (net["Id"], net["Name"]) or (len(ref) >= 12
                                                      and net["Id"].startswith(ref)):
                    return net
        raise EngineError(404, f"network {ref} not found")

    # volumes
    def volume_in_use(self, name: str) -> bool:
        return any(m.get("Type") == "volume" and m.get("Source") == name
                   for c in self.containers.values()
                   for m in c["HostConfig"].get("Mounts", []))

    def create_volume(self, name: str, driver: str = "local", opts: dict | None = None,
                      labels: dict | None = None) -> dict:
        with self.lock:
            if name in self.volumes:
                return self.volumes[name]
            volume = {"Name": name, "Driver": driver, "Mountpoint":
                      f"/var/lib/docker/volumes/{name}/_data", "CreatedAt": _now(),
                      "Labels": labels or {}, "Options": opts or {}, "Scope": "local"}
            self.volumes[name] = volume
            return volume

    # containers
    def container(self, ref: str) -> dict:
        with self.lock:
            for c in self.containers.values():
                if ref in (c["Id"], c["Name"].lstrip("/")) or (len(ref) >= 12
                                                               and c["Id"].startswith(ref)):
                    return c
        raise EngineError(404, f"No such container: {ref}")

    def inspect(self, ref: str) -> dict:
        with self.lock:
            c = self.container(ref)
            health = c["State"].get("Health")
            if health is not None and health["Status"] == "starting" and c["State"]["Running"]:
                seen = self._health_seen.get(c["Id"], 0) + 1
                self._health_seen[c["Id"]] = seen
                if seen > self.health_inspections:
                    health["Status"] = ("unhealthy" if c["Name"].lstrip("/") in self.unhealthy
                                        else "healthy")
            return c

    def start(self, c: dict) -> None:
        with self.lock:
            ipc = c["HostConfig"].get("IpcMode") or "private"
            if ipc.startswith("container:"):
                donor = self.container(ipc.split(":", 1)[1])
                if not donor["State"]["Running"]:
                    raise EngineError(409, f"cannot join IPC of a non running container: "
                                           f"{donor['Name'].lstrip('/')}")
                if donor["HostConfig"].get("IpcMode") != "shareable":
                    raise EngineError(409, f"cannot join IPC of container "
                                           f"{donor['Name'].lstrip('/')}: non-shareable IPC "
                                           f"(hint: use IpcMode:shareable for the donor "
                                           f"container)")
            for mount in c["HostConfig"].get("Mounts", []):
                if mount.get("Type") == "volume" and mount.get("Source"):
                    self.create_volume(mount["Source"])
            c["State"].update(Status="running", Running=True, ExitCode=0, StartedAt=_now(),
                              Pid=1000 + len(self.containers))
            if c["Config"].get("Healthcheck", {}).get("Test", ["NONE"]) != ["NONE"]:
                c["State"]["Health"] = {"Status": "starting", "FailingStreak": 0, "Log": []}
                self._health_seen[c["Id"]] = 0

    def stop(self, c: dict) -> None:
        with self.lock:
            c["State"].update(Status="exited", Running=False, ExitCode=0, Pid=0,
                              FinishedAt=_now())
            c["State"].pop("Health", None)


# --- the HTTP server ---------------------------------------------------------------------------

class _UnixServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class DockerStandin:
    """The stand-in engine on a unix socket; ``base_url`` is what the Docker SDK takes."""

    def __init__(self, socket_path: str | Path, spec: EngineApiSpec | None = None) -> None:
        self.socket_path = Path(socket_path)
        self.spec = spec or EngineApiSpec()
        self.engine = Engine(self.spec.version)
        self.requests: list[Request] = []
        self.refused: list[Request] = []
        self._server: _UnixServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self) -> DockerStandin:
        self.socket_path.unlink(missing_ok=True)
        standin = self

        class Handler(_Handler):
            owner = standin

        self._server = _UnixServer(str(self.socket_path), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="docker-standin")
        self._thread.start()
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    def __enter__(self) -> DockerStandin:  # noqa: PYI034 (not subclassed)
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def requests_to(self, method: str, template: str) -> list[Request]:
        """The accepted requests of one operation, e.g. ("POST", "/containers/create")."""
        return [r for r in self.requests if r.method == method and r.template == template]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: DockerStandin

    def log_message(self, format: str, *args) -> None:  # quiet; requests are recorded
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _reply(self, status: int, payload: Any = None, content_type="application/json",
               raw: bytes | None = None) -> None:
        body = raw if raw is not None else (b"" if payload is None
                                            else json.dumps(payload).encode())
        self.send_response(status)
        if status not in (204, 304):
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if status not in (204, 304) else 0))
        self.send_header("Api-Version", self.owner.spec.version)
        self.end_headers()
        if status not in (204, 304):
            self.wfile.write(body)

    def _handle(self, method: str) -> None:
        owner = self.owner
        body = self._read_body()
        url = urlsplit(self.path)
        path = url.path
        version = re.match(r"/v(\d+)\.(\d+)(/.*)$", path)
        if version:
            path = version.group(3)
        query = parse_qs(url.query, keep_blank_values=True)
        request = Request(method, path, None, query, None)
        if version and (int(version.group(1)), int(version.group(2))) > tuple(
                int(x) for x in owner.spec.version.split(".")):
            request.status = 400
            request.reason = (f"client version {version.group(1)}.{version.group(2)} is too "
                              f"new. Maximum supported API version is {owner.spec.version}")
            owner.refused.append(request)
            self._reply(400, {"message": request.reason})
            return
        try:
            checked = owner.spec.check(method, path, query, body)
        except SpecViolation as exc:
            request.status, request.reason = 400, f"stand-in: refused by the spec: {exc}"
            owner.refused.append(request)
            self._reply(400, {"message": request.reason})
            return
        request.template, request.body = checked.template, checked.body
        owner.requests.append(request)
        route = ROUTES.get((method, checked.template))
        if route is None:
            request.status = 501
            self._reply(501, {"message": f"stand-in: {method} {checked.template} is in the "
                                         f"spec but not implemented here"})
            return
        try:
            with owner.engine.lock:
                status, payload, *rest = route(owner.engine, checked)
        except EngineError as exc:
            request.status, request.reason = exc.status, str(exc)
            self._reply(exc.status, {"message": str(exc)})
            return
        request.status = status
        request.response = None if rest else json.loads(json.dumps(payload))
        if rest:  # a raw body (a JSON-lines progress stream, text)
            self._reply(status, raw=rest[0], content_type=payload)
        else:
            self._reply(status, payload)

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PUT(self) -> None:
        self._handle("PUT")


# --- the operations ----------------------------------------------------------------------------

def _first(q: Checked, name: str, default: str | None = None) -> str | None:
    return q.query.get(name, [default])[0]


def _flag(q: Checked, name: str) -> bool:
    value = _first(q, name)
    return bool(value) and BOOL_WORDS[value]


def _filters(q: Checked) -> dict:
    text = _first(q, "filters")
    if not text:
        return {}
    try:
        filters = json.loads(text)
    except ValueError:
        raise EngineError(400, f"invalid filter: {text!r}") from None
    # Both forms the engine takes: {"label": ["a=b"]} and {"label": {"a=b": true}}.
    return {k: list(v) if isinstance(v, (list, dict)) else [v] for k, v in filters.items()}


def _json_lines(*events: dict) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\r\n" for e in events)


def op_ping(engine: Engine, q: Checked):
    return 200, "text/plain", b"OK"


def op_version(engine: Engine, q: Checked):
    return 200, {"Version": "stand-in", "ApiVersion": engine.api_version,
                 "MinAPIVersion": "1.24", "Os": "linux", "Arch": "amd64",
                 "KernelVersion": "stand-in", "Components": []}


def op_image_inspect(engine: Engine, q: Checked):
    return 200, engine.image(q.path_params["name"])


def op_build(engine: Engine, q: Checked):
    dockerfile = _first(q, "dockerfile") or "Dockerfile"
    try:
        with tarfile.open(fileobj=io.BytesIO(q.body or b""), mode="r:*") as tar:
            files = sorted(m.name for m in tar.getmembers() if m.isfile())
    except tarfile.TarError as exc:
        raise EngineError(400, f"the build context is not a tar: {exc}") from None
    if dockerfile not in files:
        raise EngineError(400, f"Cannot locate specified Dockerfile: {dockerfile}")
    tags = q.query.get("t", [])
    image = engine.add_image(tags[0] if tags else f"stand-in-build-{len(engine.builds)}")
    for tag in tags[1:]:
        image["RepoTags"].append(tag if ":" in tag.rsplit("/", 1)[-1] else f"{tag}:latest")
    engine.builds.append(Build(tags, dockerfile, files))
    short = image["Id"].removeprefix("sha256:")[:12]
    return 200, "application/json", _json_lines(
        {"stream": f"Step 1/1 : stand-in build of {len(files)} files\n"},
        {"aux": {"ID": image["Id"]}},
        {"stream": f"Successfully built {short}\n"},
        *({"stream": f"Successfully tagged {t}\n"} for t in tags))


def op_image_create(engine: Engine, q: Checked):
    source = _first(q, "fromImage")
    if not source:
        raise EngineError(400, "stand-in: only pulls (fromImage) are implemented")
    tag = _first(q, "tag") or "latest"
    ref = f"{source}:{tag}" if ":" not in source.rsplit("/", 1)[-1] else source
    engine.add_image(ref)
    engine.pulls.append(ref)
    return 200, "application/json", _json_lines(
        {"status": f"Pulling from {source}", "id": tag},
        {"status": f"Status: Downloaded newer image for {ref}"})


def op_network_list(engine: Engine, q: Checked):
    filters = _filters(q)
    return 200, [n for n in engine.networks.values()
                 if _matches_filters(n["Labels"], n["Name"], filters)]


def op_network_create(engine: Engine, q: Checked):
    body = q.body
    if any(n["Name"] == body["Name"] for n in engine.networks.values()):
        raise EngineError(409, f"network with name {body['Name']} already exists")
    net_id = secrets.token_hex(32)
    engine.networks[net_id] = {
        "Name": body["Name"], "Id": net_id, "Created": _now(), "Scope": "local",
        "Driver": body.get("Driver", "bridge"), "EnableIPv6": body.get("EnableIPv6", False),
        "Internal": body.get("Internal", False), "Attachable": body.get("Attachable", False),
        "Ingress": False, "IPAM": body.get("IPAM") or {"Driver": "default", "Config": []},
        "Options": body.get("Options") or {}, "Labels": body.get("Labels") or {},
        "Containers": {}}
    return 201, {"Id": net_id, "Warning": ""}


def op_network_inspect(engine: Engine, q: Checked):
    net = engine.network(q.path_params["id"])
    attached = {c["Id"]: {"Name": c["Name"].lstrip("/")} for c in engine.containers.values()
                if c["State"]["Running"] and net["Name"] in
                c["NetworkSettings"]["Networks"]}
    return 200, {**net, "Containers": attached}


def op_network_delete(engine: Engine, q: Checked):
    net = engine.network(q.path_params["id"])
    active = [c["Name"].lstrip("/") for c in engine.containers.values()
              if c["State"]["Running"] and net["Name"] in c["NetworkSettings"]["Networks"]]
    if active:
        raise EngineError(403, f"error while removing network: network {net['Name']} id "
                               f"{net['Id']} has active endpoints ({', '.join(active)})")
    del engine.networks[net["Id"]]
    return 204, None


def op_volume_list(engine: Engine, q: Checked):
    filters = _filters(q)
    return 200, {"Volumes": [v for v in engine.volumes.values()
                             if _matches_filters(v["Labels"], v["Name"], filters)],
                 "Warnings": []}


def op_volume_create(engine: Engine, q: Checked):
    body = q.body or {}
    name = body.get("Name") or secrets.token_hex(32)
    return 201, engine.create_volume(name, body.get("Driver") or "local",
                                     body.get("DriverOpts"), body.get("Labels"))


def op_volume_inspect(engine: Engine, q: Checked):
    name = q.path_params["name"]
    if name not in engine.volumes:
        raise EngineError(404, f"get {name}: no such volume")
    return 200, engine.volumes[name]


def op_volume_delete(engine: Engine, q: Checked):
    name = q.path_params["name"]
    if name not in engine.volumes:
        raise EngineError(404, f"get {name}: no such volume")
    if engine.volume_in_use(name) and not _flag(q, "force"):
        raise EngineError(409, f"remove {name}: volume is in use")
    del engine.volumes[name]
    return 204, None


def _summary(c: dict) -> dict:
    return {"Id": c["Id"], "Names": [c["Name"]], "Image": c["Config"]["Image"],
            "ImageID": c["Image"], "Command": " ".join(c["Config"].get("Cmd") or []),
            "Created": 0, "State": c["State"]["Status"], "Status": c["State"]["Status"],
            "Labels": c["Config"].get("Labels") or {}, "Ports": [], "Mounts": [],
            "HostConfig": {"NetworkMode": c["HostConfig"].get("NetworkMode", "default")},
            "NetworkSettings": {"Networks": c["NetworkSettings"]["Networks"]}}


def op_container_list(engine: Engine, q: Checked):
    filters = _filters(q)
    everything = _flag(q, "all")
    return 200, [_summary(c) for c in engine.containers.values()
                 if (everything or c["State"]["Running"])
                 and _matches_filters(c["Config"].get("Labels") or {}, c["Name"], filters)]


def op_container_create(engine: Engine, q: Checked):
    body = dict(q.body)
    name = _first(q, "name") or f"stand_in_{len(engine.containers)}"
    if not re.fullmatch(r"/?[a-zA-Z0-9][a-zA-Z0-9_.-]+", name):
        raise EngineError(400, f"Invalid container name ({name}), only [a-zA-Z0-9][a-zA-Z0-9_.-] "
                               f"are allowed")
    if any(c["Name"] == "/" + name for c in engine.containers.values()):
        raise EngineError(409, f'Conflict. The container name "/{name}" is already in use')
    image = engine.image(body.get("Image") or "")
    host_config = body.pop("HostConfig", None) or {}
    networking = body.pop("NetworkingConfig", None) or {}
    endpoints = networking.get("EndpointsConfig") or {}
    network_mode = host_config.get("NetworkMode") or "default"
    networks = {}
    for net_name in set(endpoints) | ({network_mode} - {"default", "bridge", "host", "none"}):
        if net_name.startswith("container:"):
            continue
        net = engine.network(net_name)
        networks[net["Name"]] = {"NetworkID": net["Id"],
                                 **(endpoints.get(net_name) or {})}
    ipc = host_config.get("IpcMode") or ""
    if ipc.startswith("container:"):
        engine.container(ipc.split(":", 1)[1])  # must exist (404 otherwise)
    elif ipc not in ("", "private", "shareable", "host", "none"):
        raise EngineError(400, f"invalid IPC mode: {ipc}")
    container_id = secrets.token_hex(32)
    engine.containers[container_id] = {
        "Id": container_id, "Name": "/" + name, "Created": _now(), "Image": image["Id"],
        "Path": (body.get("Entrypoint") or body.get("Cmd") or [""])[0],
        "Args": (body.get("Entrypoint") or [])[1:] + (body.get("Cmd") or []),
        "State": {"Status": "created", "Running": False, "Paused": False,
                  "Restarting": False, "OOMKilled": False, "Dead": False, "Pid": 0,
                  "ExitCode": 0, "Error": "", "StartedAt": "", "FinishedAt": ""},
        "RestartCount": 0, "Config": body, "HostConfig": host_config,
        "NetworkSettings": {"Networks": networks},
        "Mounts": [{"Type": m.get("Type"), "Source": m.get("Source", ""),
                    "Destination": m.get("Target"), "RW": not m.get("ReadOnly", False)}
                   for m in host_config.get("Mounts", [])]}
    return 201, {"Id": container_id, "Warnings": []}


def op_container_inspect(engine: Engine, q: Checked):
    return 200, engine.inspect(q.path_params["id"])


def op_container_start(engine: Engine, q: Checked):
    c = engine.container(q.path_params["id"])
    if c["State"]["Running"]:
        return 304, None
    engine.start(c)
    return 204, None


def op_container_stop(engine: Engine, q: Checked):
    c = engine.container(q.path_params["id"])
    if not c["State"]["Running"]:
        return 304, None
    engine.stop(c)
    return 204, None


def op_container_restart(engine: Engine, q: Checked):
    c = engine.container(q.path_params["id"])
    if c["State"]["Running"]:
        engine.stop(c)
    engine.start(c)
    c["RestartCount"] += 1
    return 204, None


def op_container_delete(engine: Engine, q: Checked):
    c = engine.container(q.path_params["id"])
    if c["State"]["Running"]:
        if not _flag(q, "force"):
            raise EngineError(409, f"cannot remove container {c['Name']}: container is "
                                   f"running: stop the container before removing or force "
                                   f"remove")
        engine.stop(c)
    del engine.containers[c["Id"]]
    return 204, None


ROUTES = {
    ("GET", "/_ping"): op_ping,
    ("GET", "/version"): op_version,
    ("GET", "/images/{name}/json"): op_image_inspect,
    ("POST", "/build"): op_build,
    ("POST", "/images/create"): op_image_create,
    ("GET", "/networks"): op_network_list,
    ("POST", "/networks/create"): op_network_create,
    ("GET", "/networks/{id}"): op_network_inspect,
    ("DELETE", "/networks/{id}"): op_network_delete,
    ("GET", "/volumes"): op_volume_list,
    ("POST", "/volumes/create"): op_volume_create,
    ("GET", "/volumes/{name}"): op_volume_inspect,
    ("DELETE", "/volumes/{name}"): op_volume_delete,
    ("GET", "/containers/json"): op_container_list,
    ("POST", "/containers/create"): op_container_create,
    ("GET", "/containers/{id}/json"): op_container_inspect,
    ("POST", "/containers/{id}/start"): op_container_start,
    ("POST", "/containers/{id}/stop"): op_container_stop,
    ("POST", "/containers/{id}/restart"): op_container_restart,
    ("DELETE", "/containers/{id}"): op_container_delete,
}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket", help="unix socket path to serve on")
    args = parser.parse_args(argv)
    standin = DockerStandin(args.socket).start()
    print(f"Docker Engine API stand-in (spec {standin.spec.version}) on {standin.base_url}",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        standin.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

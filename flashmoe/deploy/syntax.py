"""The compose file's syntax: YAML with its merge keys, ``${VAR}`` interpolation, env files,
durations and sizes."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


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


def load_yaml(path: Path) -> dict:
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


def interpolate_tree(node: Any, env: Mapping[str, str], where: str, unset: set[str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env, where, unset)
    if isinstance(node, list):
        return [interpolate_tree(v, env, f"{where}[{i}]", unset) for i, v in enumerate(node)]
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env, f"{where}.{k}", unset) for k, v in node.items()}
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

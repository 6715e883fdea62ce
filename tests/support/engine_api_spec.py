"""The Docker Engine API's published definition (moby's ``api/swagger.yaml``, committed under
``tests/data/moby/``) as a checker of requests: the Docker stand-in
(``tests/support/docker_standin.py``) checks every request it serves against it.

- the path must be one of the spec's path templates and the method one of that path's
  operations (an optional ``/v1.NN`` prefix is stripped, as the engine does);
- every query parameter must be declared for the operation, with a value of its type and, if
  it has one, in its enum; required ones must be present;
- a JSON body must match the operation's body schema, refs and allOf resolved: types, enums,
  required fields, null only where ``x-nullable``, and no field the schema does not declare.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

SPEC_PATH = Path(__file__).resolve().parents[1] / "data" / "moby" / "swagger.yaml"
BOOL_WORDS = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True,
               "0": False, "f": False, "F": False, "FALSE": False, "false": False,
               "False": False}  # Go's strconv.ParseBool, which the engine uses


class SpecViolation(Exception):
    """The request is not one the Engine API definition allows."""


class EngineError(Exception):
    """An error the engine would answer with (status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# --- the Engine API definition -----------------------------------------------------------------

@dataclass
class Checked:
    template: str
    path_params: dict[str, str]
    query: dict[str, list[str]]
    body: Any  # decoded JSON, raw bytes (binary bodies), or None


class EngineApiSpec:
    """moby's swagger 2.0 definition of the Engine API, as a request checker."""

    def __init__(self, path: Path = SPEC_PATH) -> None:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        self.doc = yaml.load(path.read_text(), Loader=loader)
        self.version: str = str(self.doc["info"]["version"])
        self.definitions: dict = self.doc["definitions"]
        routes = []
        for template in self.doc["paths"]:
            names = re.findall(r"{(\w+)}", template)
            pattern = re.escape(template)
            for name in names:
                pattern = pattern.replace(re.escape("{" + name + "}"), f"(?P<{name}>.+?)")
            routes.append((len(names), -len(template), template, re.compile(pattern + "$")))
        # Literal paths before templated ones: GET /containers/json is not /containers/{id}.
        self.routes = [(t, rx) for _, _, t, rx in sorted(routes)]

    def check(self, method: str, path: str, query: dict[str, list[str]],
              body: bytes) -> Checked:
        template, params, op = self._operation(method, path)
        declared = {p["name"]: p for p in [*self.doc["paths"][template].get("parameters", []),
                                            *op.get("parameters", [])]}
        for name, values in query.items():
            param = declared.get(name)
            if param is None or param["in"] != "query":
                allowed = sorted(n for n, p in declared.items() if p["in"] == "query")
                raise SpecViolation(f"{method} {template}: query parameter {name!r} is not "
                                    f"in the spec (allowed: {', '.join(allowed) or 'none'})")
            for value in values:
                self._check_param_value(param, value, f"{method} {template}?{name}")
        for name, param in declared.items():
            if param["in"] == "query" and param.get("required") and name not in query:
                raise SpecViolation(f"{method} {template}: required query parameter {name!r} "
                                    f"is missing")
        for name, value in params.items():
            self._check_param_value(declared.get(name, {"type": "string"}), value,
                                    f"{method} {template} path {{{name}}}")
        body_param = next((p for p in declared.values() if p["in"] == "body"), None)
        decoded: Any = None
        if body_param is None:
            if body:
                raise SpecViolation(f"{method} {template}: this operation takes no body")
        else:
            schema = self.resolve(body_param.get("schema", {}))
            if schema.get("format") == "binary" or (schema.get("type") == "string"):
                decoded = body
            elif body:
                try:
                    decoded = json.loads(body)
                except ValueError as exc:
                    raise SpecViolation(f"{method} {template}: body is not JSON: {exc}") \
                        from None
                self.validate(decoded, schema, f"{method} {template} body")
            elif body_param.get("required"):
                raise SpecViolation(f"{method} {template}: the body is required")
        return Checked(template, params, query, decoded)

    def _operation(self, method: str, path: str) -> tuple[str, dict[str, str], dict]:
        for template, regex in self.routes:
            match = regex.match(path)
            if match is None:
                continue
            ops = self.doc["paths"][template]
            op = ops.get(method.lower())
            # Another template matching the path may have the method.
            if op is None and any(rx.match(path) and method.lower() in self.doc["paths"][t]
                                  for t, rx in self.routes):
                continue
            if op is None:
                allowed = sorted(m.upper() for m in ops if m != "parameters")
                raise SpecViolation(f"{method} {template}: method not in the spec (allowed: "
                                    f"{', '.join(allowed)})")
            return template, {k: unquote(v) for k, v in match.groupdict().items()}, op
        raise SpecViolation(f"{method} {path}: no such path in the spec")

    def _check_param_value(self, param: dict, value: str, where: str) -> None:
        kind = param.get("type", "string")
        if kind == "boolean" and value not in BOOL_WORDS:
            raise SpecViolation(f"{where}: {value!r} is not a boolean")
        if kind == "integer":
            try:
                int(value)
            except ValueError:
                raise SpecViolation(f"{where}: {value!r} is not an integer") from None
        if "enum" in param and value not in param["enum"]:
            raise SpecViolation(f"{where}: {value!r} is not one of {param['enum']}")

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            schema = self.definitions[schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def _is_object(self, schema: dict) -> bool:
        schema = self.resolve(schema)
        return (schema.get("type") == "object" or "properties" in schema
                or any(self._is_object(part) for part in schema.get("allOf", [])))

    def _object_parts(self, schema: dict) -> tuple[dict, Any, list]:
        """properties, additionalProperties and required of a schema, allOf merged."""
        schema = self.resolve(schema)
        properties = dict(schema.get("properties", {}))
        additional = schema.get("additionalProperties")
        required = list(schema.get("required", []))
        for part in schema.get("allOf", []):
            p, a, r = self._object_parts(part)
            properties.update(p)
            additional = additional if additional is not None else a
            required += r
        return properties, additional, required

    def validate(self, value: Any, schema: dict, where: str) -> None:
        schema = self.resolve(schema)
        if value is None:
            if schema.get("x-nullable"):
                return
            raise SpecViolation(f"{where}: null where the spec wants "
                                f"{schema.get('type', 'a value')}")
        if "enum" in schema and value not in schema["enum"]:
            raise SpecViolation(f"{where}: {value!r} is not one of {schema['enum']}")
        kind = schema.get("type")
        if "allOf" in schema and not self._is_object(schema):
            for part in schema["allOf"]:  # a ref wrapper around a scalar type
                self.validate(value, part, where)
        elif self._is_object(schema):
            if not isinstance(value, dict):
                raise SpecViolation(f"{where}: expected an object, got {type(value).__name__}")
            properties, additional, required = self._object_parts(schema)
            for key, item in value.items():
                if key in properties:
                    self.validate(item, properties[key], f"{where}.{key}")
                elif isinstance(additional, dict):
                    self.validate(item, additional, f"{where}.{key}")
                elif additional is not True and (properties or additional is False):
                    raise SpecViolation(f"{where}: field {key!r} is not in the spec "
                                        f"(known: {', '.join(sorted(properties))})")
            for key in required:
                if key not in value:
                    raise SpecViolation(f"{where}: required field {key!r} is missing")
        elif kind == "array":
            if not isinstance(value, list):
                raise SpecViolation(f"{where}: expected an array, got {type(value).__name__}")
            for i, item in enumerate(value):
                self.validate(item, schema.get("items", {}), f"{where}[{i}]")
        elif kind == "string":
            if not isinstance(value, str):
                raise SpecViolation(f"{where}: expected a string, got {value!r}")
        elif kind == "integer":
            if not isinstance(value, int) or isinstance(value, bool):
                raise SpecViolation(f"{where}: expected an integer, got {value!r}")
            if "minimum" in schema and value < schema["minimum"]:
                raise SpecViolation(f"{where}: {value} is below the minimum "
                                    f"{schema['minimum']}")
        elif kind == "number":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise SpecViolation(f"{where}: expected a number, got {value!r}")
        elif kind == "boolean":
            if not isinstance(value, bool):
                raise SpecViolation(f"{where}: expected a boolean, got {value!r}")

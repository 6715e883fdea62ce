"""The control panel's decisions, free of sockets, threads and HTTP.

- What a page may see of the config: every field of ``common/config.py`` with its value, doc,
  default, range and live flag (``public_fields``), and the JSON Schema of a change
  (``changes_schema``), both generated from the one definition, never a copy of it.
- Whether a change may go to the services: ``validate_changes`` (422: unknown field, a value
  out of its range, named with the range, or not among the choices a running service gives,
  such as the cache manager's policies), ``fixed_refusals`` (409: fields that cannot change
  while running, with the reason) and ``merge_tune_replies`` (409 when no running service
  takes a field live, or one refuses it now).
- What the charts plot: ``Rates`` turns successive stats snapshots of the services into rates
  (hit rate, stall-free rate, SSD MB/s, tokens/s, learner CPU, recall, drifts); ``History``
  keeps the last ``HISTORY_POINTS`` of them.

Definitions (per interval between two snapshots of the cache manager's counters):
  hit rate        (n_hit + n_hit_loading) / (n_hit + n_miss): the expert was resident or
                  already on its way (a prefetch under way), no new demand read;
  stall-free rate n_hit / (n_hit + n_miss): resident when asked for, the request did not wait;
  tokens/s        AccessEvents the feature extractor received (one per decode step) per second.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Mapping, Sequence

from common.config import ConfigError, check_value, describe_fields

HISTORY_POINTS = 600  # ten minutes at one sample a second
PROFILE_REFUSAL = ("the device profile sets defaults when the services start: restart them "
                   "with --profile (or FLASHMOE_PROFILE)")
SERIES = ("hit_rate", "stall_free_rate", "ssd_mb_per_s", "tokens_per_s",
          "learner_cpu_ms_per_token", "recall", "drifts")

Choices = Mapping[str, Sequence[str]]  # field -> the choices a running service gives for it
NO_CHOICES: Choices = {}


def _rows(choices: Choices = NO_CHOICES) -> list[dict[str, Any]]:
    return [{**row, "choices": choices.get(row["key"], row["choices"])}
            for row in describe_fields() if not row["secret"]]


def _value_at(config: Mapping[str, Any], key: str) -> Any:
    section, name = key.split(".", 1)
    return config.get(section, {}).get(name)


def public_fields(config: Mapping[str, Any], choices: Choices = NO_CHOICES
                  ) -> list[dict[str, Any]]:
    """Every non-secret field with its current value in ``config`` (a
    ``FlashMoEConfig.to_dict()``) and its doc, default, range, live flag and choices (those a
    running service gives in ``choices``, e.g. the cache manager's policies)."""
    return [{**row, "choices": list(row["choices"]) if row["choices"] else None,
             "value": _value_at(config, row["key"])} for row in _rows(choices)]


def redact(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` without its secret fields (the panel's token)."""
    secret = {row["key"] for row in describe_fields() if row["secret"]}
    return {section: ({name: value for name, value in values.items()
                       if f"{section}.{name}" not in secret}
                      if isinstance(values, dict) else values)
            for section, values in config.items()}


def _field_schema(row: dict[str, Any]) -> dict[str, Any]:
    types = {"bool": "boolean", "int": "integer", "float": "number", "str": "string",
             "dict": "object"}
    schema: dict[str, Any] = {"type": types[row["type"]], "description": row["doc"],
                              "default": row["default"], "x-live": row["live"]}
    if row["size"]:  # a byte count, or text such as 256K
        schema["type"] = ["integer", "string"]
    if row["choices"]:
        schema["enum"] = list(row["choices"])
    if row["lo"] is not None:
        schema["minimum"] = row["lo"]
    if row["hi"] is not None:
        schema["maximum"] = row["hi"]
    if row["multiple_of"]:
        schema["multipleOf"] = row["multiple_of"]
    if row["fixed_because"]:
        schema["x-fixed-because"] = row["fixed_because"]
    return schema


def changes_schema(choices: Choices = NO_CHOICES) -> dict[str, Any]:
    """JSON Schema of ``{"section.field": value}``: one property per config field (with the
    choices a running service gives in ``choices``)."""
    properties = {row["key"]: _field_schema(row) for row in _rows(choices)}
    properties["profile"] = {"type": "string", "description": "Device profile (fixed while "
                             "running).", "x-live": False}
    return {"type": "object", "properties": properties, "additionalProperties": False}


def _bounds(key: str, choices: Choices) -> dict[str, Any]:
    for row in _rows(choices):
        if row["key"] == key:
            return {"lo": row["lo"], "hi": row["hi"],
                    "choices": list(row["choices"]) if row["choices"] else None}
    return {"lo": None, "hi": None, "choices": None}


def validate_changes(changes: Mapping[str, Any], choices: Choices = NO_CHOICES,
                     unknown: Mapping[str, str] | None = None
                     ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The changes coerced and checked as at start, and one error per bad one (the field,
    the value, its range or choices, and common/config.py's message). A field whose choices a
    running service gives must be one of ``choices``; one in ``unknown`` (field -> why its
    choices are not known, e.g. no cache manager runs) is refused with that reason.
    ``profile`` passes through (``fixed_refusals`` refuses it)."""
    checked, errors = {}, []
    unknown = unknown or {}
    for key, value in changes.items():
        if key == "profile":
            checked[key] = value
            continue
        try:
            good = check_value(key, value, "the control panel")
            if key in unknown:
                raise ConfigError(f"{key} (from the control panel) = {value!r}: its choices "
                                  f"are not known, {unknown[key]}")
            if key in choices and good not in choices[key]:
                raise ConfigError(f"{key} (from the control panel) = {value!r} is not allowed; "
                                  f"choices: {', '.join(choices[key])}")
            checked[key] = good
        except ConfigError as exc:
            errors.append({"field": key, "value": value, **_bounds(key, choices),
                           "message": str(exc)})
    return checked, errors


def fixed_refusals(changes: Mapping[str, Any], config: Mapping[str, Any],
                   arena_slots: int | None) -> dict[str, str]:
    """Valid changes that cannot reach running services, with the reason: the device
    profile, a capacity above the arena's slots, a prefetch window above the prefetch budget,
    and every field that is not live (its ``fixed_because``)."""
    rows = {row["key"]: row for row in describe_fields()}
    refused = {}
    for key, value in changes.items():
        if key == "profile":
            refused[key] = PROFILE_REFUSAL
        elif key == "cache.capacity_experts" and arena_slots is not None and \
                value > arena_slots:
            refused[key] = (f"{key} = {value} is above the arena's {arena_slots} slots: the "
                            f"arena is sized at start, restart the services to grow it")
        elif key == "prefetch.window" and value > (_value_at(config, "prefetch.budget") or 0):
            budget = _value_at(config, "prefetch.budget")
            refused[key] = (f"{key} = {value} is above prefetch.budget = {budget}, the cap "
                            f"set at start: restart with a larger budget first")
        elif not rows[key]["live"]:
            refused[key] = (f"{key} cannot change while the services run: "
                            f"{rows[key]['fixed_because'] or 'restart them to change it'}")
    return refused


def merge_tune_replies(keys: list[str], replies: Mapping[str, Any]) -> \
        tuple[dict[str, list[str]], dict[str, str]]:
    """From each service's answer to a checking TuneReq (a ``TuneRep``, or the text of why
    it did not answer): which services take each key, and the keys refused with why (one a
    service refuses, or one no running service takes live)."""
    takers: dict[str, list[str]] = {key: [] for key in keys}
    refused: dict[str, str] = {}
    without_tuning = sorted(name for name, rep in replies.items()
                            if not isinstance(rep, str) and not rep.supported)
    for name, rep in replies.items():
        if isinstance(rep, str):
            continue
        for key in rep.applied:
            if key in takers:
                takers[key].append(name)
        for key, why in rep.refused.items():
            if key in takers:
                refused[key] = f"{name}: {why}"
    for key in keys:
        if not takers[key] and key not in refused:
            refused[key] = (f"no running service takes {key} live"
                            + (f" (no live tuning yet in: {', '.join(without_tuning)})"
                               if without_tuning else ""))
    return takers, refused


def _delta(now: Mapping[str, Any], before: Mapping[str, Any], key: str) -> float | None:
    """A counter's increase, None when absent or when the service restarted (it went down)."""
    if key not in now or key not in before:
        return None
    change = now[key] - before[key]
    return change if change >= 0 else None


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return top / bottom if top is not None and bottom else None


class Rates:
    """Figures between successive snapshots ``{service: stats}`` (a service that did not
    answer is missing)."""

    def __init__(self) -> None:
        self.last: dict[str, dict] | None = None
        self.last_t = 0.0

    def sample(self, snapshot: Mapping[str, Mapping[str, Any]], now: float) -> dict[str, Any]:
        before, dt = self.last or {}, now - self.last_t if self.last is not None else 0.0
        self.last, self.last_t = {k: dict(v) for k, v in snapshot.items()}, now
        cache, before_cache = snapshot.get("cache_manager", {}), before.get("cache_manager", {})
        extractor = snapshot.get("feature_extractor", {})
        predictor = snapshot.get("predictor", {})
        hits = _delta(cache, before_cache, "n_hit")
        misses = _delta(cache, before_cache, "n_miss")
        loading = _delta(cache, before_cache, "n_hit_loading")
        accesses = hits + misses if hits is not None and misses is not None else None
        events = _delta(extractor, before.get("feature_extractor", {}), "events")
        read = _delta(cache, before_cache, "n_byte_read")
        learner = [v for k, v in predictor.items() if k.startswith("cpu_ms_")]
        if "cpu_ms_per_event" in extractor:
            learner.append(extractor["cpu_ms_per_event"])
        recall = [v for k, v in sorted(predictor.items()) if k.startswith("recall")]
        per_s = (lambda x: x / dt if x is not None and dt > 0 else None)  # noqa: E731
        return {"t": now,
                "hit_rate": _ratio(hits + loading if hits is not None and loading is not None
                                   else None, accesses),
                "stall_free_rate": _ratio(hits, accesses),
                "ssd_mb_per_s": None if per_s(read) is None else per_s(read) / 1e6,
                "tokens_per_s": per_s(events),
                "learner_cpu_ms_per_token": sum(learner) if learner else None,
                "recall": recall[0] if recall else None,
                "drifts": predictor.get("drifts"),
                "policy": cache.get("policy"), "resident": cache.get("resident"),
                "n_slots": cache.get("n_slots")}


class History:
    """The last ``points`` samples, as one list per series (JSON-ready: no NaN)."""

    def __init__(self, points: int = HISTORY_POINTS) -> None:
        self.samples: deque[dict[str, Any]] = deque(maxlen=points)

    def append(self, sample: Mapping[str, Any]) -> None:
        self.samples.append(dict(sample))

    def series(self) -> dict[str, list]:
        def clean(value):
            return None if isinstance(value, float) and not math.isfinite(value) else value

        return {"t": [s["t"] for s in self.samples],
                **{name: [clean(s.get(name)) for s in self.samples] for name in SERIES}}

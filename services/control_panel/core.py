"""The control panel's decisions, free of sockets, threads and HTTP.

- What a page may see of the config: every field of ``common/config.py`` with its value, doc,
  default, range and live flag (``public_fields``), and the JSON Schema of a change
  (``changes_schema``), both generated from the one definition, never a copy of it. No read
  shows a secret: secret fields are left out, and every text the panel serves (config values,
  the services' stats) is scrubbed of the secrets' values and of the credentials of any URL
  (``Redactor``).
- What /metrics exports: each service's stats named, typed and described in ``METRICS``
  (Prometheus conventions: counters end in ``_total``, base units, a written help line; ids
  such as pids are never values); a stat not listed is in /api/stats only.
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
import re
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence
from urllib.parse import urlsplit

from common.config import ConfigError, check_value, describe_fields

HISTORY_POINTS = 600  # ten minutes at one sample a second
ECHO_DEPTH = 8  # levels of a refused request's input echoed back in the refusal
PROFILE_REFUSAL = ("the device profile sets defaults when the services start: restart them "
                   "with --profile (or FLASHMOE_PROFILE)")
SERIES = ("hit_rate", "stall_free_rate", "ssd_mb_per_s", "tokens_per_s",
          "learner_cpu_ms_per_token", "recall", "drifts")

Choices = Mapping[str, Sequence[str]]  # field -> the choices a running service gives for it
NO_CHOICES: Choices = {}
# Fields whose choices only a running service can give (the policies the cache manager runs
# live are fewer than the names the config accepts): without it they have none to offer.
SERVICE_CHOICES = ("cache.policy",)


def _rows(choices: Choices = NO_CHOICES) -> list[dict[str, Any]]:
    return [{**row, "choices": choices.get(row["key"], None if row["key"] in SERVICE_CHOICES
                                           else row["choices"])}
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


REDACTED = "***"
# scheme://userinfo@ : the userinfo (user:password) of any URL in a text
URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^\s/?#@]+@")
# A secret shorter than this is scrubbed only where it is a whole value: scrubbing it inside
# every text would garble the text without hiding anything.
MIN_SCRUBBED_CHARS = 4


def secret_values(config: Mapping[str, Any]) -> set[str]:
    """The secrets a config (``FlashMoEConfig.to_dict()``) holds: its secret fields' values,
    the password of every URL in it, and the first line of the Redis password file when it
    can be read."""
    found = set()
    for row in describe_fields():
        value = _value_at(config, row["key"])
        if not isinstance(value, str) or not value:
            continue
        if row["secret"]:
            found.add(value)
        elif "://" in value:
            try:
                password = urlsplit(value).password
            except ValueError:
                password = None
            if password:
                found.add(password)
    password_file = _value_at(config, "cluster.password_file")
    if isinstance(password_file, str) and password_file:
        try:
            first = Path(password_file).read_text().splitlines()[:1]
        except (OSError, UnicodeDecodeError):
            first = []
        found.update(line.strip() for line in first if line.strip())
    return found


class Redactor:
    """Scrubs secrets from anything JSON-shaped: the known secret values, and the credentials
    of every URL (``redis://:pw@host`` -> ``redis://***@host``)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.lock = threading.Lock()  # the poller adds while requests scrub
        self.secrets: frozenset[str] = frozenset()
        self.add(secrets)

    def add(self, secrets: Iterable[str]) -> None:
        with self.lock:
            self.secrets = self.secrets | {s for s in secrets if s}
            # longest first, so that a secret holding another is replaced whole
            self._long = sorted((s for s in self.secrets if len(s) >= MIN_SCRUBBED_CHARS),
                                key=len, reverse=True)

    def text(self, value: str) -> str:
        if value in self.secrets:
            return REDACTED
        for secret in self._long:
            value = value.replace(secret, REDACTED)
        return URL_CREDENTIALS.sub(lambda m: f"{m.group(1)}{REDACTED}@", value)

    def __call__(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self(k) if isinstance(k, str) else k: self(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self(v) for v in value]
        return value


def clip_depth(value: Any, depth: int = ECHO_DEPTH) -> Any:
    """``value`` with what lies deeper than ``depth`` levels of lists and mappings replaced by
    ``"..."``: a refusal echoes a request's input, which may be nested past what a recursive
    encoder takes."""
    if isinstance(value, Mapping):
        return {k: clip_depth(v, depth - 1) for k, v in value.items()} if depth > 0 else "..."
    if isinstance(value, (list, tuple)):
        return [clip_depth(v, depth - 1) for v in value] if depth > 0 else "..."
    return value


def json_safe(value: Any) -> Any:
    """``value`` as strict JSON can carry it: a non-finite number or bytes (a request's own
    bad input, echoed in its refusal) as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, Mapping):
        return {str(json_safe(k)): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, str):
        return value.encode("utf-8", "replace").decode("utf-8")  # lone surrogates
    return value


def redact(config: Mapping[str, Any], redactor: Redactor | None = None) -> dict[str, Any]:
    """``config`` without its secret fields (the panel's token, passwords, the API key), every
    text scrubbed by ``redactor`` (by default one that knows ``config``'s own secrets)."""
    redactor = redactor or Redactor(secret_values(config))
    secret = {row["key"] for row in describe_fields() if row["secret"]}
    return redactor({section: ({name: value for name, value in values.items()
                                if f"{section}.{name}" not in secret}
                               if isinstance(values, dict) else values)
                     for section, values in config.items()})


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


# --- /metrics ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Metric:
    """How one stat is exported: ``flashmoe_<service>_<name>`` (a counter gets ``_total``
    from the exposition), its help line, and the factor to its base unit (seconds, bytes).
    ``label``: for a family of stats sharing a prefix, the label that holds the rest of the
    key. A stat that is negative has no sample (``-1``: not known yet)."""
    name: str
    kind: str  # "counter" or "gauge"
    help: str
    scale: float = 1.0
    label: str | None = None


def _c(name: str, help_: str, scale: float = 1.0, label: str | None = None) -> Metric:
    return Metric(name, "counter", help_, scale, label)


def _g(name: str, help_: str, scale: float = 1.0, label: str | None = None) -> Metric:
    return Metric(name, "gauge", help_, scale, label)


# Stats every service reports (common/service.py, common/bus.py).
COMMON_METRICS: dict[str, Metric] = {
    "uptime_s": _g("uptime_seconds", "Seconds since the service started."),
    "n_received": _c("received_messages", "Bus messages received."),
    "n_gap": _c("sequence_gaps", "Bus messages missed (gaps in their sequence numbers)."),
    "n_out_of_order": _c("out_of_order_messages", "Bus messages that came out of order."),
    "checkpoints": _c("checkpoints", "Checkpoints of the learned state written."),
}
# Key prefixes that name a family: the rest of the key is the label's value.
PREFIX_METRICS: dict[str, Metric] = {
    "rejected_": _c("rejected_messages", "Messages refused (and counted, never served), by "
                    "reason.", label="reason"),
    "cpu_ms_": _g("cpu_seconds_per_token", "CPU seconds spent per token, by stage.", 1e-3,
                  label="stage"),
}
METRICS: dict[str, dict[str, Metric]] = {
    "cache_manager": {
        "n_hit": _c("hits", "Expert requests found resident."),
        "n_miss": _c("misses", "Expert requests that needed a read from the store."),
        "n_hit_loading": _c("hits_loading", "Expert requests found already on their way "
                            "(a prefetch under way): no new read."),
        "n_acquire": _c("acquires", "Acquire requests from workers (one per layer and "
                        "token)."),
        "n_evict": _c("evictions", "Experts evicted from the arena."),
        "n_load": _c("loads", "Expert loads started (demand and prefetch)."),
        "n_load_failed": _c("failed_loads", "Expert loads that failed (IO error or bad "
                            "checksum)."),
        "n_checksum_error": _c("checksum_errors", "Expert reads whose checksum did not match "
                               "(a read again after a failure counts again)."),
        "n_io_error": _c("io_errors", "Expert reads that the IO engine reported failed (a read "
                         "again after a failure counts again)."),
        "n_read_retry": _c("read_retries", "Failed expert reads read once more before their "
                           "requests get the error."),
        "bad_experts": _g("bad_experts", "Experts whose load failed after its retry, counted "
                          "once per expert and kind of failure (each logged once with its "
                          "store file and offset)."),
        "prefetch_bad_skipped": _c("prefetch_bad_skipped", "Prefetch hints not followed "
                                   "because the expert's last load failed its checksum."),
        "n_byte_read": _c("read_bytes", "Bytes read from the store."),
        "n_byte_loaded": _c("loaded_bytes", "Bytes of experts loaded into the arena."),
        "n_prefetch_hint": _c("prefetch_hints", "Prefetch hints received from workers."),
        "workers_gone": _c("workers_gone", "Workers that disconnected or went silent (their "
                           "pins released)."),
        "requests_cancelled": _c("cancelled_requests", "Acquire requests cancelled before "
                                 "their answer."),
        "predictions": _c("predictions", "Prediction messages received from the "
                          "predictor."),
        "prediction_gaps": _c("prediction_gaps", "Prediction messages missed (gaps in "
                              "their sequence numbers)."),
        "estimates_used": _c("estimates_used", "Evictions decided on the predictor's "
                             "estimate."),
        "prefetch_issued": _c("prefetches_issued", "Prefetch loads started."),
        "prefetch_used": _c("prefetches_used", "Prefetched experts asked for before their "
                            "eviction."),
        "prefetch_wasted": _c("prefetches_wasted", "Prefetched experts evicted unused."),
        "prefetch_failed": _c("prefetches_failed", "Prefetch loads that failed."),
        "prefetch_dropped": _c("prefetches_dropped", "Prefetches dropped (no free slot or "
                               "queue depth)."),
        "prefetch_learned": _c("prefetches_learned", "Prefetches chosen from the predictor's "
                               "estimates."),
        "prefetch_bytes": _c("prefetch_read_bytes", "Bytes read by prefetches."),
        "prefetch_used_bytes": _c("prefetch_used_bytes", "Bytes of prefetched experts asked "
                                  "for before their eviction."),
        "prefetch_wasted_bytes": _c("prefetch_wasted_bytes", "Bytes of prefetched experts "
                                    "evicted unused."),
        "prefetcher_hints": _c("inline_prefetch_hints", "Hints of the inline next-layer "
                               "prefetcher."),
        "resident": _g("resident_experts", "Experts resident in the arena."),
        "loading": _g("loading_experts", "Experts being loaded."),
        "pinned": _g("pinned_experts", "Experts pinned by workers."),
        "prefetch_inflight": _g("prefetches_in_flight", "Prefetch loads in flight."),
        "prefetch_pending": _g("prefetches_pending", "Prefetches waiting for queue depth."),
        "n_slots": _g("arena_slots", "Slots of the arena (its size at start)."),
        "capacity": _g("capacity_experts", "Experts the policy may keep resident (live "
                       "cache.capacity_experts)."),
        "workers": _g("workers", "Workers connected to the cache manager."),
        "engine_direct": _g("io_direct", "1 when the IO engine reads with O_DIRECT (past the "
                            "page cache)."),
        "engine_fixed_buffers": _g("io_fixed_buffers", "1 when the arena's slots are "
                                   "registered io_uring fixed buffers (0: reads go to them "
                                   "unregistered, or the pread engine runs)."),
        "engine_inflight": _g("io_reads_in_flight", "Reads the IO engine has in flight."),
        "estimate_age_ms": _g("estimate_age_seconds", "Age of the predictor's estimate in "
                              "use.", 1e-3),
        "read_p50_us": _g("read_latency_p50_seconds", "Median latency of recent expert "
                          "reads.", 1e-6),
        "read_p99_us": _g("read_latency_p99_seconds", "99th percentile latency of recent "
                          "expert reads.", 1e-6),
    },
    "feature_extractor": {
        "events": _c("events", "Access events received (one per token)."),
        "batches": _c("feature_batches", "Feature batches published."),
        "tokens_seen": _g("tokens_seen", "Tokens in the learned tables (warm-up included)."),
        "variance_kept": _g("pca_variance_kept_ratio", "Share of the features' variance that "
                            "the online PCA keeps."),
        "cpu_ms_per_event": _g("cpu_seconds_per_event", "CPU seconds spent per access "
                               "event.", 1e-3),
    },
    "predictor": {
        "batches": _c("feature_batches", "Feature batches received."),
        "predictions": _c("predictions", "Predictions published."),
        "tokens": _c("tokens", "Tokens learned from."),
        "steps": _c("training_steps", "Training steps taken."),
        "drifts": _c("drifts", "Drift events detected (each starts an elastic update)."),
        "recall_at_k": _g("recall_at_k_ratio", "Share of each token's experts that its "
                          "estimate ranked in the top k."),
    },
}
# The panel's own counters (``Panel.stats_view()["panel"]``).
PANEL_METRICS: dict[str, Metric] = {
    "polls": _c("stats_rounds", "Rounds of stats asked of every service."),
    "tune_applied": _c("changes_applied", "Config changes applied to the services."),
    "tune_refused": _c("changes_refused", "Config changes refused (409: not live, or a "
                       "service refused)."),
    "tune_invalid": _c("changes_invalid", "Config changes refused as invalid (422)."),
    "reapplied": _c("changes_reapplied", "Config values sent again to a restarted service."),
    "uptime_s": _g("uptime_seconds", "Seconds since the panel started."),
}
# Derived figures (``Rates``), over the last stats interval.
RATE_METRICS: dict[str, Metric] = {
    "hit_rate": _g("hit_ratio", "Expert requests resident or already on their way, over the "
                   "last stats interval."),
    "stall_free_rate": _g("stall_free_ratio", "Expert requests resident when asked for, "
                          "over the last stats interval."),
    "ssd_mb_per_s": _g("ssd_read_bytes_per_second", "Bytes read from the store per second, "
                       "over the last stats interval.", 1e6),
    "tokens_per_s": _g("tokens_per_second", "Tokens per second, over the last stats "
                       "interval."),
    "learner_cpu_ms_per_token": _g("learner_cpu_seconds_per_token", "CPU seconds the "
                                   "feature extractor and the predictor spend per token.",
                                   1e-3),
    "recall": _g("prediction_recall_ratio", "The predictor's recall at k."),
}


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def metric_samples(service: str, stats: Mapping[str, Any]
                   ) -> Iterator[tuple[str, Metric, dict[str, str], float]]:
    """The samples of one service's stats: ``(full name, metric, labels, value)`` in base
    units, for every stat ``METRICS``, ``COMMON_METRICS`` or ``PREFIX_METRICS`` describe."""
    table = {**COMMON_METRICS, **METRICS.get(service, {})}
    for key, value in sorted(stats.items()):
        number = _number(value)
        if number is None:
            continue
        metric, labels = table.get(key), {}
        if metric is None:
            prefix = next((p for p in PREFIX_METRICS if key.startswith(p)), None)
            if prefix is None or not key[len(prefix):]:
                continue
            metric, labels = PREFIX_METRICS[prefix], {PREFIX_METRICS[prefix].label:
                                                      key[len(prefix):]}
        if number < 0:  # -1: not known yet; a counter is never below zero
            continue
        yield re.sub(r"\W", "_", f"flashmoe_{service}_{metric.name}"), metric, labels, \
            number * metric.scale

"""The control panel's state and its talks with the services, apart from HTTP and the process.

The panel never touches the hot path: it asks each service's control socket (found as
``<runtime_dir>/<service>.control.sock``, or named with ``--service``) for its stats every
``POLL_S`` on a thread of its own, keeps the derived rates for the charts, and sends live
config changes as ``TuneReq`` messages: first a checking round (nothing changes unless every
key is taken by some service and refused by none), then the real one. What it applied is
kept and sent again to a service that restarted (a new pid) so that a supervisor's restart
does not undo a tuning. The policies ``cache.policy`` may take are the cache manager's to say
(``PoliciesReq``): asked once it answers, and kept. Everything it serves is scrubbed of the
secrets it knows (its own config's, and those of each service's config, asked once per service
start) and of URL credentials (``core.Redactor``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.bus import ServiceUnavailable, policies, residency, service_config, stats, tune
from common.config import FlashMoEConfig

from .core import (History, Rates, Redactor, fixed_refusals, merge_tune_replies,
                   public_fields, redact, secret_values, validate_changes)

log = logging.getLogger("flashmoe.control_panel")
POLL_S = 1.0
CONTROL_TIMEOUT_S = 2.0
CONTROL_SUFFIX = ".control.sock"
# Whose config the panel shows first: the cache manager's has every section the others have.
CONFIG_SOURCES = ("cache_manager", "predictor", "feature_extractor")


@dataclass
class Outcome:
    """What a PUT /api/config comes to: an HTTP status and its JSON body."""
    status: int
    body: dict[str, Any]


def new_token() -> str:
    return secrets.token_urlsafe(18)


class Panel:
    """The panel's state and its talks with the services, apart from HTTP."""

    def __init__(self, config: FlashMoEConfig, runtime_dir: Path | None = None,
                 services: dict[str, str] | None = None, token: str = "") -> None:
        self.config = config  # shown when no service answers
        self.runtime_dir = runtime_dir
        self.named_services = dict(services or {})
        self.token = token or config.panel.token or new_token()
        self.redactor = Redactor({*secret_values(config.to_dict()), self.token})
        self.lock = threading.Lock()  # latest, errors, history, overlay
        self.latest: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        self.rates = Rates()
        self.history = History()
        self.last_sample: dict[str, Any] = {}
        self.overlay: dict[str, Any] = {}  # live changes applied through the panel
        self.taken_by: dict[str, set[str]] = {}  # service -> keys of the overlay it took
        self.pids: dict[str, int] = {}
        self.policies: list[str] | None = None  # the cache manager's answer, once it gave one
        self.counters: Counter = Counter(polls=0, tune_applied=0, tune_refused=0,
                                         tune_invalid=0, reapplied=0)
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the services ------------------------------------------------------------------------

    def endpoints(self) -> dict[str, str]:
        """Control endpoints by service name: the runtime folder's control sockets, then the
        ones named on the command line."""
        found = {}
        if self.runtime_dir is not None and self.runtime_dir.is_dir():
            for path in sorted(self.runtime_dir.glob(f"*{CONTROL_SUFFIX}")):
                found[path.name[:-len(CONTROL_SUFFIX)]] = f"ipc://{path}"
        return {**found, **self.named_services}

    def poll_once(self) -> None:
        """One round of stats from every service, a sample of the rates, and the overlay sent
        again to a service that restarted."""
        snapshot, errors = {}, {}
        endpoints = self.endpoints()
        for name, endpoint in endpoints.items():
            try:
                snapshot[name] = stats(endpoint, timeout_s=CONTROL_TIMEOUT_S)
            except ServiceUnavailable as exc:
                errors[name] = str(exc)
        restarted = [name for name, values in snapshot.items()
                     if name in self.pids and values.get("pid") != self.pids[name]]
        for name, values in snapshot.items():
            if values.get("pid") != self.pids.get(name):  # a service (re)started: its secrets
                self._learn_secrets(endpoints[name])
        with self.lock:
            self.latest, self.errors = snapshot, errors
            self.last_sample = self.rates.sample(snapshot, time.time())
            self.history.append(self.last_sample)
            self.pids.update({name: values["pid"] for name, values in snapshot.items()
                              if "pid" in values})
            self.counters["polls"] += 1
            again = {name: {key: self.overlay[key] for key in self.taken_by.get(name, ())}
                     for name in restarted}
        for name, changes in again.items():
            if changes:
                self._reapply(name, changes)

    def _learn_secrets(self, endpoint: str) -> None:
        try:
            config = service_config(endpoint, timeout_s=CONTROL_TIMEOUT_S)
        except ServiceUnavailable:
            return  # the next start of its pid asks again; URLs are scrubbed meanwhile
        self.redactor.add(secret_values(config))

    def _reapply(self, name: str, changes: dict[str, Any]) -> None:
        try:
            rep = tune(self.endpoints()[name], changes, timeout_s=CONTROL_TIMEOUT_S)
        except (ServiceUnavailable, KeyError) as exc:
            log.warning("%s restarted; the panel's changes could not be sent again: %s",
                        name, exc)
            return
        self.counters["reapplied"] += len(rep.applied)
        log.info("%s restarted; sent the panel's changes again: %s", name,
                 ", ".join(rep.applied) or "none taken")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._poll_loop, name="panel-poller",
                                        daemon=True)
        self._thread.start()

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:  # the poller must outlive one bad round
                log.exception("a stats round failed")
            self._stop.wait(POLL_S)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(CONTROL_TIMEOUT_S * 4)

    def service_choices(self) -> tuple[dict[str, list[str]], dict[str, str]]:
        """Choices that a running service gives (the policies the cache manager can run live,
        asked of it once and kept), and for a field whose choices are not known, why."""
        with self.lock:
            known = self.policies
        if known is None:
            endpoint = self.endpoints().get("cache_manager")
            if endpoint is None:
                return {}, {"cache.policy": "no cache manager is running to give the policy "
                                            "choices"}
            try:
                known = list(policies(endpoint, timeout_s=CONTROL_TIMEOUT_S).choices)
            except ServiceUnavailable as exc:
                return {}, {"cache.policy": f"the cache manager gave no policy choices: {exc}"}
            with self.lock:
                self.policies = known
        return {"cache.policy": known}, {}

    # --- what the API serves -----------------------------------------------------------------

    def stats_view(self) -> dict[str, Any]:
        with self.lock:
            view = {"time": time.time(), "services": dict(self.latest),
                    "unavailable": dict(self.errors), "rates": dict(self.last_sample),
                    "tuned": dict(self.overlay),
                    "panel": {**self.counters, "uptime_s": round(time.time() - self.started, 1)}}
        return self.redactor(view)

    def history_view(self) -> dict[str, list]:
        with self.lock:
            return self.history.series()

    def effective_config(self) -> tuple[dict[str, Any], str]:
        """The config the services run with (asked of one of them, live changes included),
        and where it came from; the panel's own when none answers."""
        endpoints = self.endpoints()
        for name in [*CONFIG_SOURCES, *sorted(set(endpoints) - set(CONFIG_SOURCES))]:
            if name not in endpoints:
                continue
            try:
                config = service_config(endpoints[name], timeout_s=CONTROL_TIMEOUT_S)
            except ServiceUnavailable:
                continue
            with self.lock:
                for key, value in self.overlay.items():
                    section, field = key.split(".", 1)
                    config.setdefault(section, {})[field] = value
            self.redactor.add(secret_values(config))
            return redact(config, self.redactor), name
        return redact(self.config.to_dict(), self.redactor), "panel"

    def config_view(self) -> dict[str, Any]:
        config, source = self.effective_config()
        choices, _ = self.service_choices()
        return {"source": source, "profile": config.get("profile"),
                "fields": public_fields(config, choices), "tuned": self.redactor(self.overlay)}

    def residency_view(self) -> dict[str, Any]:
        """Per layer, which experts are resident and how often each was asked for; or why
        not (a cache manager that does not answer ResidencyReq)."""
        endpoint = self.endpoints().get("cache_manager")
        if endpoint is None:
            return {"available": False, "reason": "no cache manager is running"}
        try:
            rep = residency(endpoint, timeout_s=CONTROL_TIMEOUT_S)
        except ServiceUnavailable as exc:
            return {"available": False, "reason": str(exc)}
        import numpy as np

        shape = (len(rep.layers), rep.experts_per_layer)
        return {"available": True, "layers": list(rep.layers),
                "experts_per_layer": rep.experts_per_layer,
                "resident": np.frombuffer(rep.resident, np.uint8).reshape(shape).tolist(),
                "popularity": np.frombuffer(rep.popularity, np.float32).reshape(shape)
                .round(3).tolist()}

    # --- tuning ------------------------------------------------------------------------------

    def apply(self, changes: dict[str, Any]) -> Outcome:
        """Validate, refuse what cannot change live (409), check with every running service,
        then apply. Nothing changes anywhere unless every key can be applied."""
        checked, errors = validate_changes(changes, *self.service_choices())
        if errors:
            self.counters["tune_invalid"] += 1
            return Outcome(422, {"detail": errors})
        if not checked:
            return Outcome(422, {"detail": [{"field": None, "message": "no changes given"}]})
        config, _ = self.effective_config()
        with self.lock:
            arena = self.latest.get("cache_manager", {}).get("n_slots")
        refused = fixed_refusals(checked, config, arena)
        if refused:
            self.counters["tune_refused"] += 1
            return Outcome(409, {"detail": {"refused": refused}})
        endpoints = self.endpoints()
        replies: dict[str, Any] = {}
        for name, endpoint in endpoints.items():
            try:
                replies[name] = tune(endpoint, checked, check=True, timeout_s=CONTROL_TIMEOUT_S)
            except ServiceUnavailable as exc:
                replies[name] = str(exc)
        if not any(not isinstance(rep, str) for rep in replies.values()):
            return Outcome(503, {"detail": {"unavailable": replies or "no service is running"}})
        takers, refused = merge_tune_replies(list(checked), replies)
        if refused:
            self.counters["tune_refused"] += 1
            return Outcome(409, {"detail": {"refused": refused}})
        applied: dict[str, list[str]] = {key: [] for key in checked}
        failed: dict[str, str] = {}
        for name in sorted({n for names in takers.values() for n in names}):
            mine = {key: value for key, value in checked.items() if name in takers[key]}
            try:
                rep = tune(endpoints[name], mine, timeout_s=CONTROL_TIMEOUT_S)
            except ServiceUnavailable as exc:
                failed[name] = str(exc)
                continue
            for key in rep.applied:
                applied[key].append(name)
            failed.update({f"{name}: {key}": why for key, why in rep.refused.items()})
            with self.lock:
                self.taken_by.setdefault(name, set()).update(rep.applied)
                self.overlay.update({key: mine[key] for key in rep.applied})
        self.counters["tune_applied"] += 1
        log.info("applied %s", ", ".join(f"{k}={v!r} ({'/'.join(applied[k]) or 'nobody'})"
                                         for k, v in checked.items()))
        status = 200 if not failed else 502
        return Outcome(status, {"applied": applied, "failed": failed,
                                "changes": checked})

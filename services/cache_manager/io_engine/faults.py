"""IO fault injection, a declared setting (testing only).

``IOFaults`` names every fault an engine can inject; each is off at 0:

  delay:MS          completions are reported MS ms after they arrive
  short_read:N      every N-th read comes back ``SHORT_READ_BYTES`` short
  submit_error:N    the next submit fails after (at most) N of its reads went out
  stale:N           N forged completions with bad tags (each counted in ``stats["stale"]``
                    and written nowhere)
  eio:N             every N-th expert read completes with EIO (both engines, as reaped)

A live process takes them from ``FMIO_FAULT="kind:param[,kind:param]"`` (``IOFaults.from_env``,
which ``open_engine`` reads when it is given no faults); tests also turn them on and off one by
one with an engine's ``inject_fault``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .base import IOEngineError

log = logging.getLogger(__name__)

FAULT_ENV = "FMIO_FAULT"
SHORT_READ_BYTES = 4096  # what a short_read fault takes off a read


@dataclass(frozen=True)
class IOFaults:
    """The faults to inject into an engine when it opens; 0 = off."""

    delay: int = 0  # ms a completion is held back before it is reported
    short_read: int = 0  # every N-th read comes back SHORT_READ_BYTES short
    submit_error: int = 0  # the next submit fails after at most N of its reads went out
    stale: int = 0  # forged completions with bad tags
    eio: int = 0  # every N-th expert read completes with EIO

    @classmethod
    def parse(cls, spec: str) -> IOFaults:
        """From ``"kind:param[,kind:param]"`` (a later kind overrides an earlier one)."""
        return cls(**dict(parse_fault_spec(spec)))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> IOFaults:
        return cls.parse(environ.get(FAULT_ENV, ""))

    def items(self) -> list[tuple[str, int]]:
        """The faults that are on, as (kind, param)."""
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
                if getattr(self, f.name)]

    def spec(self) -> str:
        return ",".join(f"{kind}:{param}" for kind, param in self.items())

    def arm(self, engine) -> None:
        """Turn the faults on in ``engine``, loudly."""
        if not self.items():
            return
        log.warning("!!! %s=%r: injecting IO faults into the %s engine; reads WILL be delayed, "
                    "short or failed on purpose (testing only) !!!", FAULT_ENV, self.spec(),
                    engine.name)
        for kind, param in self.items():
            engine.inject_fault(kind, param)


FAULT_KINDS = tuple(f.name for f in dataclasses.fields(IOFaults))


def parse_fault_spec(spec: str) -> list[tuple[str, int]]:
    """``"kind:param[,kind:param]"`` -> [(kind, param)]; raises IOEngineError when malformed."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, sep, param = item.partition(":")
        if not sep or kind not in FAULT_KINDS or not param.isdigit():
            raise IOEngineError(f"{FAULT_ENV}: {item!r} is not kind:param with kind one of "
                                f"{', '.join(FAULT_KINDS)} and param an integer >= 0")
        faults.append((kind, int(param)))
    return faults


def check_fault(kind: str, param: int) -> None:
    if kind not in FAULT_KINDS or param < 0:
        raise IOEngineError(f"unknown fault {kind}:{param}; kinds: {', '.join(FAULT_KINDS)}")

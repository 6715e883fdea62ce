"""The flags several commands share, each defined once here, and the helpers that read them.

A command adds a shared flag with ``add_<flag>(parser)`` (a help text of its own where the flag
means something narrower there) and reads it back through the functions below: ``config``
for the effective config, ``traces_dir`` for where the routing traces are (``trace_of`` loads
one from there), ``save`` for the report files.
"""

from __future__ import annotations

import argparse

from common.config import load_config
from flashmoe.reports import write_json

PROFILES = ("8gb", "16gb", "32gb")
SET_HELP = "override one config field (repeatable); see `flashmoe config`"


def csv(kind):
    """An argparse type: a comma-separated list of ``kind``."""
    return lambda text: [kind(x) for x in text.split(",") if x]


def add_set(p: argparse.ArgumentParser, help: str = SET_HELP) -> None:
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help=help)


def add_config_flags(p: argparse.ArgumentParser) -> None:
    """--profile, --config, --set and --redis: what ``config(args)`` reads."""
    p.add_argument("--profile", choices=PROFILES, help="device profile defaults")
    p.add_argument("--config", metavar="FILE", help="TOML or JSON config file")
    add_set(p)
    p.add_argument("--redis", metavar="URL", help="share pattern features with the devices of "
                   "a cluster through this Redis (cluster.redis_url; see `flashmoe config "
                   "--fields` for AUTH and TLS)")


def add_json(p: argparse.ArgumentParser, help: str | None = None,
             required: bool = False) -> None:
    p.add_argument("--json", metavar="FILE", required=required, help=help)


def add_plot(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plot", metavar="FILE.png")


def add_trace(p: argparse.ArgumentParser, default: str = "gptoss20b:eval",
              help: str | None = None) -> None:
    """--trace and the folder it is looked up in, --traces-dir (what ``trace_of`` reads)."""
    p.add_argument("--trace", default=default, help=help)
    add_traces_dir(p)


def add_traces_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--traces-dir", default=None,
                   help="the folder of the full routing traces (default: the traces.dir "
                        "setting, else ../shared/traces beside the checkout)")


def add_warmup(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--warmup", metavar="CKPT", help=help)


def add_quiet(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--quiet", action="store_true", help=help)


def add_device(p: argparse.ArgumentParser) -> None:
    from flashmoe.sim.device_model import DEVICES

    p.add_argument("--device", choices=sorted(DEVICES), default="orin-980pro")


def traces_dir(args) -> str:
    """The full routing traces' folder a command reads: ``--traces-dir``, else the
    ``traces.dir`` setting, else ``../shared/traces`` beside the checkout."""
    from common.traces import find_traces_dir

    if args.traces_dir:
        return str(find_traces_dir(args.traces_dir))
    settings = config(args) if hasattr(args, "profile") else \
        load_config(overrides=list(getattr(args, "set", [])))
    return str(find_traces_dir(None, settings.traces.dir))


def trace_of(args, spec: str | None = None):
    """The routing trace ``spec`` names (default: --trace), from ``traces_dir(args)``."""
    from common.traces import load_trace

    return load_trace(args.trace if spec is None else spec, traces_dir(args))


def overrides(args) -> list[str]:
    """``--set`` items, after the ones the shorthand flags make."""
    return ([f"cluster.redis_url={args.redis}"] if args.redis else []) + list(args.set)


def config(args, store: str | None = None, first: list[str] | None = None):
    """The effective config of --profile, --config, --redis and --set; ``store`` sets
    store.path and ``first`` holds overrides that --set may override in turn."""
    items = [*(first or []), *overrides(args)]
    if store:
        items.insert(0, f"store.path={store}")
    return load_config(profile=args.profile, file=args.config, overrides=items)


def save(args, doc: dict, plot=None) -> None:
    """A report's --json (and, given its plot function, --plot) files, each announced."""
    if args.json:
        write_json(doc, args.json)
        print(f"wrote {args.json}")
    if plot is not None and args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")

"""The flags several commands share, each defined once here, and the helpers that read them.

A command adds a shared flag with ``add_<flag>(parser)`` (a help text of its own where the flag
means something narrower there) and reads it back through the functions below: ``config``
for the effective config, ``traces_dir`` for where the routing traces are (``trace_of`` loads
one from there), ``save`` for the report files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.config import ConfigError, load_config, register_choices
from flashmoe.errors import CheckpointError
from flashmoe.reports import write_json
from services.cache_manager.policies import POLICIES, PolicyError, build_params

PROFILES = ("8gb", "16gb", "32gb")


def check_policy_params(settings) -> None:
    """cache.policy_params must be the chosen policy's parameters: refused where a command
    reads its config, not when the cache manager starts."""
    try:
        build_params(POLICIES[settings.cache.policy], settings.cache.policy_params)
    except PolicyError as exc:
        raise ConfigError(f"cache.policy_params = {settings.cache.policy_params!r}: {exc}") \
            from None


# The policy registry is known here, in the app layer (common/ may not import it): from now on
# cache.policy is checked against it wherever config is read.
register_choices("cache.policy", lambda: POLICIES)
SET_HELP = "override one config field (repeatable); see `flashmoe config`"


def csv(kind):
    """An argparse type: a comma-separated list of ``kind``."""
    return lambda text: [kind(x) for x in text.split(",") if x]


def at_least(low: int):
    """An argparse type: an integer of at least ``low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


positive_int = at_least(1)
non_negative_int = at_least(0)


def non_empty(text: str) -> str:
    """An argparse type: a string that is not empty."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


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
    settings = load_config(profile=args.profile, file=args.config, overrides=items)
    check_policy_params(settings)
    return settings


def save(args, doc: dict, plot=None) -> None:
    """A report's --json (and, given its plot function, --plot) files, each announced."""
    if args.json:
        write_json(doc, args.json)
        print(f"wrote {args.json}")
    if plot is not None and args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")


def check_warmup(folder: str | None, settings, manifest) -> None:
    """Refuse, before any process starts, a ``--warmup`` checkpoint that the learning path
    would refuse: missing, or made for another model's shape or another predictor."""
    if folder is None:
        return
    from flashmoe.sim.learning import warmup_fits

    shape = (len(manifest.moe_layers), manifest.num_experts)
    if not Path(folder).is_dir():
        raise CheckpointError(f"--warmup {folder}: no such folder; make a warm-up checkpoint "
                              f"with `flashmoe warmup --out DIR`, or leave --warmup out")
    if not warmup_fits(folder, settings, shape):
        raise CheckpointError(
            f"--warmup {folder}: not a warm-up checkpoint for this model ({shape[0]} MoE layers x "
            f"{shape[1]} experts) and predictor ({settings.predictor.model}, hidden "
            f"{settings.predictor.lstm_hidden}, {settings.features.pca_components} PCA "
            f"components); make one with `flashmoe warmup --store STORE --text FILE --out DIR`, "
            f"or leave --warmup out")

"""Commands of the system as a whole on this machine: run (the main job), doctor, config."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from common.config import describe_fields
from flashmoe.cli.options import (add_config_flags, add_json, add_trace, add_warmup,
                                  check_warmup, config, positive_int, traces_dir)
from flashmoe.errors import CheckpointError
from flashmoe.reports import write_json


def stopped_early(command: str, exc) -> int:
    """One line for a Ctrl-C or SIGTERM before the services ran; the shell's status for it."""
    print(f"flashmoe {command}: {exc} during start-up; nothing is left running",
          file=sys.stderr)
    return 128 + exc.signum


def instance_refused(command: str, exc) -> int:
    """One line for a home or runtime folder that cannot be this instance's."""
    print(f"flashmoe {command}: error: {exc}", file=sys.stderr)
    return 2


def cmd_run(args) -> int:
    from common.service import Interrupted
    from flashmoe.runtime.launch import HomeInUse, RuntimeDirError
    from flashmoe.runtime.run import format_summary, run
    from flashmoe.runtime.supervisor import SupervisionError

    settings = config(args, first=["cache.policy=flashmoe",
                                   f"cache.capacity_experts={args.capacity}"])
    if args.warmup is not None and not Path(args.warmup).is_dir():
        raise CheckpointError(f"--warmup {args.warmup}: no such folder; make a warm-up "
                              f"checkpoint with `flashmoe warmup --out DIR`, or leave --warmup "
                              f"out")
    try:
        summary = run(settings, Path(args.home), args.store, args.warmup, args.trace,
                      None if args.loop else args.tokens, args.loop, args.token_ms,
                      traces_dir(args), keep_logs=args.keep_logs)
    except (HomeInUse, RuntimeDirError) as exc:
        return instance_refused("run", exc)
    except Interrupted as exc:
        return stopped_early("run", exc)
    except KeyboardInterrupt:  # before run() took the signals over
        return stopped_early("run", Interrupted(2))
    except SupervisionError:
        return 1
    print(format_summary(summary))
    if args.json:
        write_json(summary, args.json)
    return 0


def cmd_serve(args) -> int:
    from common.service import Interrupted
    from flashmoe.runtime.launch import HomeInUse, RuntimeDirError
    from flashmoe.runtime.serve import check_store, serve
    from flashmoe.runtime.supervisor import SupervisionError

    first = ["cache.policy=flashmoe"]
    if args.capacity is not None:
        first.append(f"cache.capacity_experts={args.capacity}")
    settings = config(args, first=first)
    with check_store(args.store) as store:  # a user's mistake is one line before any start
        check_warmup(args.warmup, settings, store.manifest)
    try:
        serve(settings, args.store, Path(args.home), args.warmup, keep_logs=args.keep_logs)
    except (HomeInUse, RuntimeDirError) as exc:
        return instance_refused("serve", exc)
    except Interrupted as exc:
        return stopped_early("serve", exc)
    except KeyboardInterrupt:
        return stopped_early("serve", Interrupted(2))
    except SupervisionError:
        return 1
    return 0


def cmd_doctor(args) -> int:
    from flashmoe.runtime.doctor import FAIL, doctor, format_checks

    checks = doctor(config(args), args.store)
    print(format_checks(checks))
    return 1 if any(c.verdict == FAIL for c in checks) else 0


def cmd_config(args) -> int:
    if args.fields:
        for row in describe_fields():
            bounds = (f"choices {row['choices']}" if row["choices"] else
                      f"[{row['lo']}, {row['hi']}]" if row["lo"] is not None else "")
            print(f"{row['key']:<28} {row['default']!s:<10} {bounds:<24} {row['doc']}")
        return 0
    print(json.dumps(config(args).to_dict(), indent=2))
    return 0


def add_keep_logs(p) -> None:
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the runtime folder (logs, config) after a clean exit; it is "
                        "always kept after a failure")


def register(sub) -> None:
    p = sub.add_parser("run", help="the whole system as supervised local processes (the main "
                                   "job)")
    p.add_argument("--home", default=".flashmoe/run",
                   help="where the store and warm-up made on first use are kept")
    p.add_argument("--store", help="a store (default: a synthetic gpt-oss-20b one, made once)")
    add_warmup(p, help="warm-up checkpoint (default: made once)")
    add_trace(p, default=None, help="the routing the worker replays (default: gpt-oss-20b's "
                                    "eval split, the full one when found, else the sample)")
    p.add_argument("--tokens", type=positive_int, default=300, help="decode steps to run")
    p.add_argument("--loop", action="store_true", help="go on until Ctrl-C or SIGTERM")
    p.add_argument("--capacity", type=positive_int, default=192,
                   help="experts the cache holds (default 192: 25%% of gpt-oss-20b's)")
    p.add_argument("--token-ms", type=float, default=0.0,
                   help="a decode step lasts at least this long (a model's pace)")
    add_json(p, help="write the summary")
    add_keep_logs(p)
    add_config_flags(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("serve", help="serve a converted model through an OpenAI-compatible "
                                     "API, the learned cache live")
    p.add_argument("store", help="a store made by `flashmoe convert`")
    p.add_argument("--home", default=".flashmoe/serve",
                   help="where each store's learned state is kept (the store is only read)")
    add_warmup(p, help="a warm-up checkpoint of this model (`flashmoe warmup --store STORE "
                       "--text FILE`); default: the state kept under --home, else cold")
    p.add_argument("--capacity", type=positive_int,
                   help="experts the cache holds (cache.capacity_experts)")
    add_keep_logs(p)
    add_config_flags(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("doctor", help="check io_uring, O_DIRECT, memlock, /dev/shm, the kernel "
                                      "and the SSD's power state; each with a fix")
    p.add_argument("store", nargs="?", help="the store to check (O_DIRECT, the arena's size)")
    add_config_flags(p)
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("config", help="print the effective config (or --fields: every field)")
    p.add_argument("--fields", action="store_true")
    add_config_flags(p)
    p.set_defaults(func=cmd_config)

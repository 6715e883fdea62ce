"""Commands that make and check stores and models: convert, synth-store, verify,
make-tiny-model, build-helper."""

from __future__ import annotations

import argparse
import sys

from common.config import check_value, load_config
from common.model_families import FAMILIES
from flashmoe.cli.options import add_config_flags, add_quiet, positive_int
from flashmoe.errors import UsageError


def _store_config(args):
    """The config of a command that writes a store: --block-size and --parallelism over
    --set, each refused in the words of the flag the user typed."""
    config = load_config(profile=args.profile, file=args.config, overrides=list(args.set))
    if args.block_size is not None:
        config.store.block_size = check_value("store.block_size", args.block_size,
                                              f"--block-size {args.block_size}")
    if args.parallelism is not None:
        config.store.parallelism = check_value("store.parallelism", args.parallelism,
                                               f"--parallelism {args.parallelism}")
    return config


def cmd_convert(args) -> int:
    from flashmoe.tools.convert import check_target, convert_checkpoint

    config = _store_config(args)
    check_target(args.hf_dir, args.store, force=args.force)
    manifest = convert_checkpoint(args.hf_dir, args.store, block_size=config.store.block_size,
                                  parallelism=config.store.parallelism,
                                  show_progress=not args.quiet)
    _add_copies(args.store, args.precisions, args.quiet)
    total = sum(e.nbytes for e in manifest.experts)
    print(f"{args.store}: {manifest.model_family}, {len(manifest.moe_layers)} MoE layers x "
          f"{manifest.num_experts} experts, {total / 2**20:.1f} MiB of experts in "
          f"{len(manifest.block_crc)} blocks of {manifest.block_size // 1024} KiB over "
          f"{manifest.parallelism} stripes")
    return 0


def cmd_synth_store(args) -> int:
    from flashmoe.tools.synth_store import DEFAULT_SCALE, check_synth_target, synth_store

    config = _store_config(args)
    scale = DEFAULT_SCALE if args.scale is None else args.scale
    if not 0 < scale <= 1:
        raise UsageError(f"--scale {scale}: must be in (0, 1]")
    check_synth_target(args.store, force=args.force)
    store = synth_store(args.store, args.shape, scale, config.store.block_size,
                        config.store.parallelism, seed=args.seed, show_progress=not args.quiet)
    store.close()
    _add_copies(args.store, args.precisions, args.quiet)
    total = sum(e.nbytes for e in store.manifest.experts)
    print(f"{args.store}: {args.shape} at scale {scale}, {len(store.keys())} experts of "
          f"{store.manifest.max_expert_bytes / 1e6:.2f} MB, {total / 1e9:.2f} GB in all")
    return 0


def _add_copies(store_path: str, precisions: list[str], quiet: bool) -> None:
    """Write the precision copies asked for that the store does not have yet."""
    from flashmoe.tools.store_writer import add_copies

    written = add_copies(store_path, precisions, show_progress=not quiet)
    if written:
        print(f"{store_path}: {', '.join(written)} copies written")


def _precisions(text: str) -> list[str]:
    from common.store import COPY_PRECISIONS

    out = [p.strip() for p in text.split(",") if p.strip()]
    for p in out:
        if p not in ("bf16", "native", *COPY_PRECISIONS):
            raise argparse.ArgumentTypeError(f"{p!r}: precisions are bf16 (native), "
                                             f"{', '.join(COPY_PRECISIONS)}")
    return out


def cmd_verify(args) -> int:
    from tqdm import tqdm

    from common.store import ExpertStore

    store = ExpertStore.open(args.store)
    total = sum(e.nbytes for e in store.manifest.experts)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=args.quiet) as bar:
        for error in store.verify(progress=bar.update):
            print(f"{args.store}: {error}", file=sys.stderr)
            return 1
    copies = "".join(f", {p} copy {len(c.manifest.block_crc)} blocks OK"
                     for p, c in store.copies.items())
    print(f"{args.store}: {len(store.manifest.block_crc)} blocks OK{copies}")
    return 0


def cmd_make_tiny_model(args) -> int:
    from flashmoe.tools.tiny_models import build_tiny_model

    if args.top_k > args.experts:
        raise UsageError(f"--top-k {args.top_k}: a token cannot route to more experts than "
                         f"the {args.experts} there are (--experts)")
    out = build_tiny_model(args.family, args.out, seed=args.seed, layers=args.layers,
                           experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                           expert_intermediate=args.expert_intermediate)
    print(out)
    return 0


def cmd_build_helper(args) -> int:
    from common.cbuild import BuildError
    from services.cache_manager.io_engine import build_helper
    from services.inference_worker import quantized
    from services.predictor import fast_infer

    # the predictor's fused inference (without it, the numpy path runs) and the worker's
    # INT8/INT4 products (without them, dequantize-then-product in torch)
    for helper in (fast_infer, quantized):
        try:
            print(helper.build(force=args.force))
        except BuildError as exc:
            print(f"warning: {exc}", file=sys.stderr)
    print(build_helper(force=args.force))
    return 0


def _add_layout_flags(p: argparse.ArgumentParser, block_help: str) -> None:
    p.add_argument("--block-size", help=block_help)
    p.add_argument("--parallelism", type=int, help="stripe files (default: store.parallelism)")
    p.add_argument("--force", action="store_true",
                   help="write into a folder that is not empty (replacing a store there)")
    p.add_argument("--precisions", type=_precisions, default=["bf16"],
                   help="the experts' precisions to store: bf16 (the native experts, always) "
                        "plus int8 and/or int4 copies (cache.precision), e.g. bf16,int8,int4; "
                        "an existing store gets the copies it lacks")


def register(sub) -> None:
    p = sub.add_parser("convert", help="HF MoE checkpoint folder -> block-striped expert store")
    p.add_argument("hf_dir")
    p.add_argument("store")
    _add_layout_flags(p, "bytes per block, e.g. 256K (default: store.block_size of the "
                         "profile/config)")
    add_quiet(p, help="no progress bar")
    add_config_flags(p)
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("synth-store", help="a store of random bf16 experts in a real model's "
                                           "shape (for trace-driven runs)")
    p.add_argument("store")
    p.add_argument("--shape", default="gpt-oss-20b", help="gpt-oss-20b, or gpt-oss-tiny (tests)")
    p.add_argument("--scale", type=float, default=None,
                   help="multiplies each expert's intermediate size (default 0.21: ~8 GB for "
                        "gpt-oss-20b)")
    _add_layout_flags(p, "bytes per block (default: store.block_size)")
    p.add_argument("--seed", type=int, default=0)
    add_quiet(p, help="no progress bar")
    add_config_flags(p)
    p.set_defaults(func=cmd_synth_store)

    p = sub.add_parser("verify", help="check every block's checksum; non-zero on the first bad")
    p.add_argument("store")
    add_quiet(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("make-tiny-model", help="save a random-weight MoE model (no download)")
    p.add_argument("family", choices=tuple(FAMILIES))
    p.add_argument("out")
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--experts", type=positive_int, default=8)
    p.add_argument("--top-k", type=positive_int, default=2)
    p.add_argument("--hidden", type=positive_int, default=64)
    p.add_argument("--expert-intermediate", type=positive_int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("build-helper", help="compile the C helpers: the io_uring engine's, "
                       "the predictor's fused inference and the worker's INT8/INT4 products")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_build_helper)

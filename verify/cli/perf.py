"""Subcommands that measure rather than verify: `profile`, `bench`, `comm`, `scaling`, `train`.

Progress goes to stderr (relayed from rank 0 through a file in the run folder), results to
stdout: tables, or one JSON document with `--json`.

Registered through `verify.cli.EXTENSIONS`. Like the rest of the CLI this module only parses
and prints: the measuring functions live in `profiling`, `bench`, `comm` and `training`, and
return result dataclasses. Exit codes: 0 the run finished (whatever the numbers), 1 a rank
failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json

from verify.cli import EXIT_FAULT, EXIT_PASS, _is_reporting_rank, _positive_float, _positive_int
from verify.cli import impl_help as _impl_help


def _nonneg_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{name} must be >= 0, got {value}")
        return value

    return parse


def _float_list(name: str):
    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be comma-separated numbers, got {text!r}"
            ) from None
        if not values or any(not v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"{name} must be positive numbers, got {text!r}")
        return values

    return parse


def _int_list(name: str):
    def parse(text: str) -> tuple[int, ...]:
        values = _float_list(name)(text)
        if any(v != int(v) for v in values):
            raise argparse.ArgumentTypeError(f"{name} must be whole numbers, got {text!r}")
        return tuple(int(v) for v in values)

    return parse


def _common(p: argparse.ArgumentParser, *, world_size: int = 2) -> None:
    p.add_argument("--world-size", type=_positive_int("--world-size"), default=world_size)
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cuda if every rank can have a GPU (NCCL), else cpu (gloo)",
    )
    p.add_argument("--out", default="profiles", help="folder for run folders (default: profiles)")
    p.add_argument("--timeout", type=_positive_float("--timeout"), default=1800.0, help="seconds")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def register(sub) -> None:
    from verify.perf.profiling import DEFAULT_MODEL_M, DEFAULT_PROFILE_BUCKET_MB

    p = sub.add_parser("profile", help="profile variants; traces for TensorBoard / Perfetto")
    p.add_argument("--impl", required=True, help=_impl_help() + ", or all")
    _common(p)
    p.add_argument(
        "--steps", type=_positive_int("--steps"), default=3, help="profiled (active) steps"
    )
    p.add_argument("--warmup", type=_nonneg_int("--warmup"), default=1)
    p.add_argument("--wait", type=_nonneg_int("--wait"), default=1)
    p.add_argument(
        "--model-size",
        type=_positive_float("--model-size"),
        default=DEFAULT_MODEL_M,
        help="millions of transformer parameters",
    )
    p.add_argument("--local-batch", type=_positive_int("--local-batch"), default=4)
    p.add_argument(
        "--bucket-mb", type=_positive_float("--bucket-mb"), default=DEFAULT_PROFILE_BUCKET_MB
    )
    p.set_defaults(run=cmd_profile)
    register_measurements(sub)


def cmd_profile(args: argparse.Namespace) -> int:
    from verify.perf.profiling import ProfileOptions, format_profile, run_profile

    options = ProfileOptions(
        impl=args.impl,
        world_size=args.world_size,
        wait=args.wait,
        warmup=args.warmup,
        active=args.steps,
        model_size_m=args.model_size,
        local_batch=args.local_batch,
        bucket_mb=args.bucket_mb,
        device=args.device,
        out=args.out,
        timeout_s=args.timeout,
        progress=True,  # to stderr: --json output stays clean
    )
    return _finish(args, run_profile(options), format_profile)


def _impls(text: str) -> tuple[str, ...]:
    from verify.perf.profiling import all_variants

    return tuple(all_variants()) if text == "all" else tuple(v for v in text.split(",") if v)


def register_measurements(sub) -> None:
    from impls.registry import DEFAULT_BUCKET_MB
    from verify.perf.bench import BenchOptions
    from verify.perf.comm import CommOptions

    b = BenchOptions()
    p = sub.add_parser("bench", help="step time of every variant vs torch-ddp / torch-zero")
    _common(p)
    p.add_argument("--impls", default="all", help="comma-separated variants (default: all)")
    p.add_argument("--model-size", type=_positive_float("--model-size"), default=b.model_size_m)
    p.add_argument("--local-batch", type=_positive_int("--local-batch"), default=b.local_batch)
    p.add_argument("--bucket-mb", type=_positive_float("--bucket-mb"), default=b.bucket_mb)
    p.add_argument("--warmup", type=_positive_int("--warmup"), default=b.warmup)
    p.add_argument("--repeats", type=_positive_int("--repeats"), default=b.repeats)
    p.add_argument(
        "--sweep-mb",
        type=_float_list("--sweep-mb"),
        default=b.sweep_mb,
        help="bucket sizes of the sweep, comma-separated (default: 1,4,25,64)",
    )
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--sweep-repeats", type=_positive_int("--sweep-repeats"), default=5)
    p.set_defaults(run=cmd_bench)

    c = CommOptions()
    p = sub.add_parser("comm", help="collective bandwidth, alpha-beta fit, best bucket size")
    _common(p)
    p.add_argument(
        "--world-sizes", type=_int_list("--world-sizes"), default=c.world_sizes, help="2,3,4"
    )
    p.add_argument("--min-kb", type=_positive_float("--min-kb"), default=c.min_bytes / 1024)
    p.add_argument(
        "--max-mb", type=_positive_float("--max-mb"), default=c.max_bytes / 2**20, help="64"
    )
    p.add_argument("--repeats", type=_positive_int("--repeats"), default=c.repeats)
    p.add_argument("--model-size", type=_positive_float("--model-size"), default=c.model_size_m)
    p.set_defaults(run=cmd_comm)

    p = sub.add_parser("scaling", help="throughput at world sizes 1..N")
    _common(p)
    p.add_argument("--impl", default="bucketed", help=_impl_help())
    p.add_argument("--model-size", type=_positive_float("--model-size"), default=10.0)
    p.add_argument("--local-batch", type=_positive_int("--local-batch"), default=4)
    p.add_argument("--bucket-mb", type=_positive_float("--bucket-mb"), default=DEFAULT_BUCKET_MB)
    p.add_argument("--repeats", type=_positive_int("--repeats"), default=8)
    p.add_argument("--threads-per-rank", type=_positive_int("--threads-per-rank"), default=None)
    p.set_defaults(run=cmd_scaling)

    p = sub.add_parser("train", help="train end to end; loss curves vs a single process")
    _common(p)
    p.add_argument("--impl", required=True, help=_impl_help() + "; comma-separated, or all")
    p.add_argument("--steps", type=_positive_int("--steps"), default=200)
    p.add_argument("--local-batch", type=_positive_int("--local-batch"), default=8)
    p.add_argument(
        "--model-size",
        type=_positive_float("--model-size"),
        default=None,
        help="millions of parameters (default: a tiny GPT)",
    )
    p.add_argument("--lr", type=_positive_float("--lr"), default=3e-3)
    p.add_argument("--bucket-mb", type=_positive_float("--bucket-mb"), default=DEFAULT_BUCKET_MB)
    p.set_defaults(run=cmd_train)


def _finish(args, result, formatter) -> int:
    if _is_reporting_rank():
        print(
            json.dumps(result.to_dict(), indent=2, default=str) if args.json else formatter(result)
        )
    return EXIT_PASS if result.ok else EXIT_FAULT


def cmd_bench(args: argparse.Namespace) -> int:
    from verify.perf.bench import BenchOptions, format_bench, run_bench

    options = BenchOptions(
        variants=_impls(args.impls),
        world_size=args.world_size,
        model_size_m=args.model_size,
        local_batch=args.local_batch,
        bucket_mb=args.bucket_mb,
        warmup=args.warmup,
        repeats=args.repeats,
        sweep_mb=() if args.no_sweep else args.sweep_mb,
        sweep_repeats=args.sweep_repeats,
        device=args.device,
        out=args.out,
        timeout_s=args.timeout,
        progress=True,  # to stderr: --json output stays clean
    )
    return _finish(args, run_bench(options), format_bench)


def cmd_comm(args: argparse.Namespace) -> int:
    from verify.perf.comm import CommOptions, format_comm, run_comm

    options = CommOptions(
        world_sizes=args.world_sizes,
        min_bytes=int(args.min_kb * 1024),
        max_bytes=int(args.max_mb * 2**20),
        repeats=args.repeats,
        model_size_m=args.model_size,
        device=args.device,
        out=args.out,
        timeout_s=args.timeout,
        progress=True,  # to stderr: --json output stays clean
    )
    return _finish(args, run_comm(options), format_comm)


def cmd_scaling(args: argparse.Namespace) -> int:
    from verify.perf.scaling import ScalingOptions, format_scaling, run_scaling

    options = ScalingOptions(
        impl=args.impl,
        max_world_size=args.world_size,
        model_size_m=args.model_size,
        local_batch=args.local_batch,
        bucket_mb=args.bucket_mb,
        repeats=args.repeats,
        threads_per_rank=args.threads_per_rank,
        device=args.device,
        out=args.out,
        timeout_s=args.timeout,
        progress=True,  # to stderr: --json output stays clean
    )
    return _finish(args, run_scaling(options), format_scaling)


def cmd_train(args: argparse.Namespace) -> int:
    from verify.perf.train import TrainOptions, format_training, run_training

    options = TrainOptions(
        impls=_impls(args.impl),
        world_size=args.world_size,
        steps=args.steps,
        local_batch=args.local_batch,
        model_size_m=args.model_size,
        lr=args.lr,
        bucket_mb=args.bucket_mb,
        device=args.device,
        out=args.out,
        timeout_s=args.timeout,
        progress=True,  # to stderr: --json output stays clean
    )
    return _finish(args, run_training(options), format_training)

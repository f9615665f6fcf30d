"""The CUDA/NCCL paths: every implementation on GPUs, one per rank. Skipped without CUDA.

On CPU machines this file still checks the guard: asking for NCCL or `--device cuda` without
enough GPUs is a one-line usage error (exit 2), never an attempt to use CUDA.
"""

import json

import pytest
import torch

from benchmarks import audit_cost, tracer_cost
from tests.test_gpu_checks import on_gpus
from verify.checks.matrix import MatrixOptions, run_matrix
from verify.cli import main


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_every_impl_is_consistent_on_gpus(world):
    """Every built-in and reference, on NCCL at one rank and at two on the GPUs there are
    (`on_gpus`), following the registry's claims as on CPU ranks: a model an implementation
    refuses (ZeRO-3 and FSDP2: parameters unused on some ranks; ZeroRedundancyOptimizer:
    several dtypes) is "not claimed", never a failure, and everything else passes."""
    rows = ("world-1",) if world == 1 else ("world-2", "unused-everywhere", "mixed")
    options = MatrixOptions(impls=("all",), rows=rows, checks=("consistency",), **on_gpus(world))
    result = run_matrix(options)
    assert result.passed, {c: r.detail for c, r in result.results.items() if r.failed}
    statuses = {c: r.status for c, r in result.results.items()}
    assert set(statuses.values()) <= {"pass", "not claimed"}, statuses
    if world == 2:
        for impl in ("zero3", "torch-fsdp"):
            assert statuses[(impl, "unused-everywhere", "consistency")] == "not claimed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only guard")
def test_cuda_over_gloo_without_a_gpu_is_a_usage_error(tmp_path, capsys):
    """`--device cuda --backend gloo` needs one GPU, whatever the world size: without one it
    is refused in one line before any rank starts, by every command that takes a device."""
    out = ["--out", str(tmp_path)]
    for argv in (
        ["consistency", "--impl", "bucketed"],
        ["equivalence", "--impl", "bucketed"],
        ["matrix", "--impl", "zero1", "--rows", "world-2"],
        ["hang", "--impl", "bucketed", *out],
        ["bench", "--world-size", "2", *out],
        ["profile", "--impl", "flat", *out],
    ):
        assert main([*argv, "--device", "cuda", "--backend", "gloo"]) == 2, argv
        err = capsys.readouterr().err
        assert "--device cuda --backend gloo needs a GPU" in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only guard")
def test_nccl_on_cpu_ranks_is_a_usage_error(capsys):
    assert main(["consistency", "--impl", "bucketed", "--device", "cpu", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "--backend nccl carries CUDA tensors only" in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only guard")
def test_nccl_without_gpus_is_a_usage_error(capsys):
    assert main(["consistency", "--impl", "bucketed", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "backend nccl needs one GPU per rank" in err and err.count("\n") == 1


# --- the measurement commands on GPUs ----------------------------------------
# Each runs at world size 1 on one GPU (a lone NCCL rank: every collective must get a CUDA
# tensor, which is what broke `bench --device cuda --world-size 1`), and at 2 where there are
# two GPUs. bench-audit and bench-tracer (the scripts benchmarks/audit_cost.py and
# tracer_cost.py) compare ranks, so they need two.

_TINY = ["--model-size", "0.5"]
_PERF_RUNS = {
    "profile": ["--impl", "bucketed", "--wait", "0", "--warmup", "1", "--steps", "1", *_TINY],
    "bench": [
        "--impls",
        "bucketed,zero1,torch-ddp",
        "--warmup",
        "1",
        "--repeats",
        "2",
        "--sweep-mb",
        "1",
        "--sweep-repeats",
        "1",
        *_TINY,
    ],
    "scaling": ["--repeats", "2", *_TINY],
    "train": ["--impl", "bucketed,zero1", "--steps", "3"],
    "bench-audit": ["--repeats", "2", *_TINY],
    "bench-tracer": ["--repeats", "1"],
}


_COMPARE_RANKS = ("bench-audit", "bench-tracer")  # no one-rank run: nothing to compare


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("command", "world"),
    [(c, w) for c in [*_PERF_RUNS, "comm"] for w in (1, 2) if w > 1 or c not in _COMPARE_RANKS],
)
def test_every_measurement_runs_on_gpus(command, world, tmp_path, capsys):
    """At one rank on NCCL; at two on the GPUs there are (`on_gpus`: gloo on one GPU)."""
    if command == "comm":
        args = ["--world-sizes", str(world), "--max-mb", "4", "--repeats", "2", *_TINY]
    else:
        args = [*_PERF_RUNS[command], "--world-size", str(world)]
    if command not in _COMPARE_RANKS:
        args += ["--out", str(tmp_path)]
    backend = on_gpus(world)["backend"]
    args += ["--device", "cuda", "--backend", backend, "--json"]
    scripts = {"bench-audit": audit_cost.main, "bench-tracer": tracer_cost.main}  # benchmarks/
    code = scripts[command](args) if command in scripts else main([command, *args])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["verdict"] == "pass", doc.get("failure")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only guard")
def test_device_cuda_without_gpus_is_a_usage_error(tmp_path, capsys):
    assert main(["bench", "--device", "cuda", "--world-size", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--device cuda needs one GPU per rank" in err and err.count("\n") == 1


# --- GPU memory, per variant, measured alone -------------------------------------------------


@pytest.mark.gpu
def test_bench_memory_of_a_variant_is_its_own(tmp_path):
    """CUDA's allocated bytes count every live tensor of the process: a variant's are measured
    with no other variant alive, within 5% of the same variant benched alone."""
    from verify.perf.bench import BenchOptions, run_bench

    def bench(variants):
        options = BenchOptions(
            variants=variants, world_size=1, device="cuda", model_size_m=0.5, warmup=1,
            repeats=1, sweep=False, bandwidth_repeats=1, out=str(tmp_path),
        )  # fmt: skip
        result = run_bench(options)
        assert result.ok, result.failure
        return result.memory[0]

    together = bench(("bucketed", "zero1", "torch-ddp", "torch-zero"))
    alone = bench(("zero1",))
    for phase, m in alone["zero1"].items():
        assert together["zero1"][phase]["allocated"] == pytest.approx(m["allocated"], rel=0.05)


@pytest.mark.gpu
def test_the_gpu_timeline_shows_the_bucket_launches(tmp_path):
    """On a GPU the launches happen on autograd's device thread: the timeline keeps them
    (item 15)."""
    from verify.perf import traces
    from verify.perf.profiling import ProfileOptions, run_profile

    options = ProfileOptions(
        impl="bucketed", world_size=2, wait=0, warmup=1, active=1, model_size_m=0.5,
        out=str(tmp_path), device="cuda", backend=on_gpus(2)["backend"],
    )  # fmt: skip
    result = run_profile(options)
    assert result.ok, result.failure
    found = traces.find_traces(result.trace_dirs["bucketed"])
    rows = dict(traces.timeline(traces.load_trace(found["rank0"])))
    assert any(".launch[" in name for _, _, name in rows.get("sync ranges", [])), rows

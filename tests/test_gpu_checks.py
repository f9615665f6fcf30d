"""The checks on GPUs: every check command at world size 1 on NCCL, and at world size 2 on
two GPUs with NCCL or, where there is one GPU, on that GPU with gloo carrying the CUDA tensors
(`--device cuda --backend gloo`, `verify/launching/gpus.py`). Skipped without CUDA (gpu-marked).

Every collective the tool itself issues (the audit's all-gathers, the reference's and the
shard check's object exchanges, the checkpoint round trip's broadcast, the usage maps) must
use the rank's device: a CPU tensor on an NCCL group fails ("No backend type associated with
device type cpu").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verify.checks.consistency import ConsistencyOptions, check_consistency
from verify.checks.detection import run_detection
from verify.checks.equivalence import EquivalenceOptions, check_equivalence
from verify.checks.hang import HangOptions, as_expected, check_hang
from verify.checks.matrix import MatrixOptions, run_matrix
from verify.hints import kinds

ROOT = Path(__file__).resolve().parents[1]
WORLDS = [1, 2]


def on_gpus(n: int) -> dict:
    """The placement keywords for `n` ranks on the GPUs there are: NCCL, one GPU each, where
    there are `n`; else gloo with every rank's tensors on the GPU(s) there are."""
    if torch.cuda.device_count() >= n:
        return {"backend": "nccl"}
    return {"backend": "gloo", "device": "cuda"}


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_consistency_and_equivalence_on_gpus(world):
    where = on_gpus(world)
    for impl in ("bucketed", "zero1", "torch-ddp", "torch-zero"):
        c = check_consistency(ConsistencyOptions(impl=impl, world_size=world, **where))
        assert c.passed, c.headline + (c.failure or "")
        e = check_equivalence(
            EquivalenceOptions(impl=impl, world_size=world, workload="transformer", **where)
        )
        assert e.passed, e.headline + (e.failure or "")
    s = check_equivalence(
        EquivalenceOptions(impl="overlap", world_size=world, sanitize=True, **where)
    )
    assert s.passed, s.headline + (s.failure or "")


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_matrix_and_faults_on_gpus(world):
    """Every cell passes but one, which holds on a GPU only: PyTorch's ZeroRedundancyOptimizer,
    loading a checkpoint whose tensors are on the CPU (as the round trip's broadcast leaves
    them) into parameters on a GPU, copies each state tensor of its shard to the GPU twice
    (`load_state_dict`: into the inner optimizer's state, and again, through
    `Optimizer.load_state_dict`, into its own `.state`, never used after). On CPU parameters
    both are the loaded tensor itself. Seen on one H100 with torch 2.11: state bytes per rank
    [8192, 3648] against 5920 unsharded."""
    rows = ("world-1", "world-2", "round-trip", "no-sync")
    options = MatrixOptions(impls=("zero1", "torch-zero"), rows=rows, **on_gpus(world))
    result = run_matrix(options)
    copied = ("torch-zero", "round-trip", "shard")
    failed = {c: r for c, r in result.results.items() if r.failed}
    assert set(failed) <= {copied}, failed
    if world >= 2:
        found = result.results[copied].findings
        assert [f.kind for f in found] == [kinds.STATE_COPIED], result.results[copied].detail
        assert "at .state[param " in found[0].message and "at .optim.state[param " in (
            found[0].message
        )
    if world >= 2:
        faults = run_detection(("faulty:no-divide",), **on_gpus(world))
        assert faults.passed


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_hang_on_gpus(world, tmp_path):
    result = check_hang(
        HangOptions(impl="bucketed", world_size=world, out=str(tmp_path), **on_gpus(world))
    )
    assert result.verdict == "pass", result.diagnosis.text()


# --- what a careful read said would break on GPUs, each pinned -----------------------

STALL_S = 5.0


@pytest.mark.gpu
def test_every_hang_scenario_on_nccl(tmp_path):
    """Every `hang:*` scenario runs on NCCL (the finite flag on the GPU: item 1) and is called
    from the trace. A skipped collective is a HANG within the stall timeout + 2 s: a traced
    rank's NCCL waits block (item 8), so the rank behind it waits in that collective instead
    of spinning in a later host sync, seen as computing, until the deadline. A size, dtype or
    root mismatch is undefined behaviour on NCCL (item 13): it hangs or completes with wrong
    numbers, and either way the diagnosis names the mismatch and the last rank from the
    trace, not from a backend error."""
    from impls.faulty.hang_scenarios import SCENARIOS

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL across GPUs: needs 2 (test_every_hang_scenario_on_one_gpu covers one)")
    undefined = ("hang:shape-mismatch", "hang:bucket-order", "hang:broadcast-source")
    for name, (_, _, expected) in SCENARIOS.items():
        options = HangOptions(
            impl=name, world_size=2, backend="nccl", stall_timeout_s=STALL_S, out=str(tmp_path)
        )
        d = check_hang(options).diagnosis
        if expected == "ok":
            assert d.verdict == "ok", (name, d.text())
        elif name in undefined:
            assert d.verdict in ("hang", "desync") and d.culprit == 1, (name, d.text())
        else:
            assert d.verdict == expected and d.culprit == 1, (name, d.text())
        if name == "hang:skip-collective":
            assert d.detection_s is not None and d.detection_s <= STALL_S + 2, d.text()


@pytest.mark.gpu
def test_every_hang_scenario_on_one_gpu(tmp_path):
    """Two gloo ranks on one GPU with CUDA work in flight: every `hang:*` scenario gets the
    verdict it gets on CPU ranks (`as_expected`), a skipped collective within the stall
    timeout + 2 s."""
    from verify.checks.hang import run_scenarios

    options = HangOptions(
        scenarios=True, world_size=2, backend="gloo", device="cuda", stall_timeout_s=STALL_S,
        out=str(tmp_path),
    )  # fmt: skip
    for result in run_scenarios(options).results:
        d = result.diagnosis
        assert as_expected(result), (result.options.impl, d.text())
        if result.options.impl == "hang:skip-collective":
            assert d.detection_s is not None and d.detection_s <= STALL_S + 2, d.text()


def _sanitized_overlap(ctx):
    from impls.overlap import OverlapDDP
    from verify.sanitize import Sanitizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(ctx.device)
    ddp = OverlapDDP(model)
    with Sanitizer(rank=ctx.rank) as san:
        for _ in range(2):
            ddp(torch.randn(4, 8, device=ctx.device)).sum().backward()
            ddp.finish_gradient_synchronization()
            san.end_step()
    return san.stats.tracked, len(list(model.parameters()))


@pytest.mark.gpu
def test_the_sanitizer_tracks_the_all_reduces_gradient_hooks_launch_on_cuda():
    """On CUDA autograd runs the hooks on a device thread; the sanitizer runs the backward
    passes it starts on the caller's (item 3): every per-gradient all-reduce is tracked."""
    from verify.launching import launch

    run = launch(_sanitized_overlap, world_size=2, **on_gpus(2))
    assert run.ok, run.summary()
    for tracked, params in run.values:
        assert tracked >= 2 * params, (tracked, params)


@pytest.mark.gpu
def test_device_bugs_are_faults_and_faults_resync_on_gpus():
    """A staging buffer made on the CPU (item 2) no longer crashes: the race is caught. The
    resync after a mismatch broadcasts AdamW's CPU `step` through the GPU (item 12). On NCCL,
    a wrapper that all-reduces a CPU tensor is a fault with its line (item 6), not a usage
    error (gloo carries CPU tensors: nothing to find there)."""
    where = on_gpus(2)
    caught = run_detection(("faulty:shared-staging-buffer",), **where)
    assert caught.passed
    from verify.launching import launch

    run = launch(_resync_of_cpu_state, world_size=2, **where)
    assert run.ok, run.summary()
    assert run.values == [(0.0, 0.0)] * 2, run.values
    if where["backend"] == "nccl":
        cpu_flag = check_consistency(
            ConsistencyOptions(
                impl="tests/fixtures/user_classes.py:CpuFlagDDP", world_size=2, backend="nccl"
            )
        )
        assert cpu_flag.verdict == "fault" and "user_classes.py" in (cpu_flag.failure or "")


def _resync_of_cpu_state(ctx):
    """The consistency check's resync of a mismatched AdamW `step` (a CPU tensor) and an
    `exp_avg` (on the GPU): both take rank 0's value."""
    from verify.checks.audit import TensorDiff
    from verify.checks.consistency import _resync

    named = {
        "optim:w.step": torch.tensor(float(ctx.rank)),
        "optim:w.exp_avg": torch.full((3,), float(ctx.rank), device=ctx.device),
    }
    found = [TensorDiff(name, (1,), 0, 1.0, 1, 1, (0,), at="after step 1") for name in named]
    _resync(named, found, torch.distributed.group.WORLD)
    step, exp_avg = named.values()
    return float(step), float(exp_avg.max().cpu())


def _device_of(ctx):
    return str(ctx.device)


@pytest.mark.gpu
def test_launches_side_by_side_use_different_gpus():
    """Rank r is no longer always cuda:r (item 14): two world-size-1 launches at once get two
    GPUs."""
    from concurrent.futures import ThreadPoolExecutor

    from verify.launching import launch

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL across GPUs: needs 2")
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: launch(_device_of, world_size=1, backend="nccl"), [0, 1]))
    devices = {run.values[0] for run in runs if run.ok}
    assert len(devices) == 2 or not all(r.ok for r in runs), [r.summary() for r in runs]


@pytest.mark.gpu
def test_a_gloo_hang_on_a_cuda_build_keeps_the_gloo_flight_recorder(tmp_path):
    """A CUDA build has NCCL's flight recorder too; a gloo hang's dump comes from gloo's
    (item 9), with the scenario's collectives in it (not only the tool's barrier after
    init, its first entry on gloo: verify/launching/rank.py)."""
    result = check_hang(
        HangOptions(impl="hang:deadlock", world_size=2, stall_timeout_s=3, out=str(tmp_path))
    )
    assert result.diagnosis.verdict == "hang", result.diagnosis.text()
    dumps = [Path(p).read_text() for k, p in result.files.items() if "flight_recorder" in k]
    assert len(dumps) == 2 and all("gloo:all_reduce" in d for d in dumps), dumps

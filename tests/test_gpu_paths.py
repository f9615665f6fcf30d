"""The CUDA/NCCL paths, checked where there is no GPU.

Each test pins one thing a `--backend nccl` / `--device cuda` run depends on, with what a CPU
machine has: the `meta` device stands in for a GPU where only placement matters (a tensor
made "on the CPU" by mistake shows as a CPU tensor beside meta ones), the GPU count and
`torch.cuda.is_available()` are patched where only the count matters (the only mocks: CUDA),
torchrun's variables are set for the multi-node refusal, and NCCL's error phrases are the
real strings (c10d's own, raised here by a real group whose only backend is for CUDA
tensors, as NCCL's is, handed a CPU tensor). tests/test_gpu.py and tests/test_gpu_checks.py
run the same paths on GPUs.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

from impls.bucketed import Bucket
from impls.faulty.hang_scenarios import nonfinite_count
from impls.faulty.race_faults import ReusesStagingBuffer
from verify.checks.consistency import ConsistencyOptions
from verify.launching import gpus, launch, needs_cuda, torchrun
from verify.launching.rank_job import BLOCKING_WAIT_ENV, block_nccl_waits, group_kwargs
from verify.options import launch_knobs
from verify.perf import traces
from verify.perf.bench import BenchOptions
from verify.perf.collectives import memcpy_name
from verify.replica_audit.fingerprint import fingerprint
from verify.sanitize import Sanitizer
from verify.training.interface import distributed
from verify.watching.capture import flight_recorder_dump

META = torch.device("meta")


@pytest.fixture
def gpus_visible(monkeypatch):
    """Pretend this machine has `n` GPUs (only the count and availability are read)."""

    def have(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return have


# --- the faulty catalogue hands collectives tensors on the model's device (items 1, 2) -------


def test_the_finite_flag_is_counted_on_the_gradients_device():
    params = [nn.Parameter(torch.zeros(3, device=META)) for _ in range(2)]
    for p in params:
        p.grad = torch.zeros(3, device=META)
    flag = nonfinite_count(params)
    assert (flag.device, flag.shape, flag.dtype) == (META, (1,), torch.float32)
    cpu = [nn.Parameter(torch.zeros(2)) for _ in range(3)]
    for p, g in zip(cpu, ([0.0, 1.0], [float("nan"), 0.0], [float("inf"), 2.0]), strict=True):
        p.grad = torch.tensor(g)
    assert nonfinite_count(cpu).tolist() == [2.0]  # the value the old host-side count gave


def test_the_shared_staging_buffer_is_made_where_the_buckets_are():
    ddp = ReusesStagingBuffer.__new__(ReusesStagingBuffer)
    nn.Module.__init__(ddp)
    ddp.buckets = [Bucket([nn.Parameter(torch.zeros(n, device=META))]) for n in (3, 5)]
    staging = ddp._staging_for(ddp.buckets[0])
    assert staging.device == META and staging.numel() == 3 and ddp._staging.numel() == 5


# --- the sanitizer sees the all-reduces a GPU's autograd thread would launch (item 3) ---------


def test_a_sanitized_backward_runs_its_hooks_on_the_calling_thread():
    """On a GPU autograd runs a device's nodes on a thread of its own, where the sanitizer
    would not see the hooks' all-reduces; the sanitizer turns that off for the backward passes
    it starts (on a CPU the hooks run on the caller's thread either way)."""
    seen = []
    x = torch.ones(3, requires_grad=True)
    x.register_hook(lambda g: seen.append(torch._C._is_multithreading_enabled()))
    with Sanitizer(rank=0) as san:
        (x * 2).sum().backward()  # armed: every backward of the first optimizer step is
        (x * 3).sum().backward()  # (a no_sync() micro-step issues none: `switch.py`)
    (x * 4).sum().backward()  # the sanitizer is gone: autograd's threads as usual
    assert seen == [False, False, True] and san.stats.armed_backwards == 2


# --- bench's memory per variant is that variant's alone (item 4) -----------------------------


def _resident_bytes(device=None) -> int:
    """What CUDA's allocator would count as allocated, played by this process's resident
    memory: everything live, the variant's tensors and any other's."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _memory_beside_a_big_tensor(ctx, options):
    from verify.perf import bench_memory

    bench_memory.allocated_bytes = _resident_bytes
    other = torch.ones(32 << 20)  # 128 MiB held by someone else (another variant, once)
    memory, _ = bench_memory.memory_alone(ctx, options)
    return memory, other.numel() * 4


def test_bench_counts_a_variants_memory_from_what_was_allocated_before_it():
    options = BenchOptions(variants=("bucketed",), model_size_m=0.5, device="cpu", world_size=1)
    run = launch(_memory_beside_a_big_tensor, world_size=1, args=(options,))
    assert run.ok, run.summary()
    memory, other = run.values[0]
    assert set(memory) == {"bucketed"}
    for phase, m in memory["bucketed"].items():
        assert 0 <= m["allocated"] < other, (phase, m)  # the other tensor is not counted


# --- the CPU suite on a host with GPUs (item 5) ----------------------------------------------


def test_a_measurement_defaults_to_cuda_where_every_rank_has_a_gpu(gpus_visible, tmp_path):
    """Why the CPU tests of the measurements say `device="cpu"` (tests/test_bench.py,
    test_profile.py, test_sanitize_cli.py): on a host with two GPUs the default is cuda."""
    gpus_visible(2)
    assert BenchOptions(world_size=2, out=str(tmp_path)).backend == "nccl"
    assert BenchOptions(world_size=2, out=str(tmp_path), device="cpu").backend == "gloo"


# --- a CPU tensor handed to a collective on NCCL is a fault (item 6) --------------------------


def _cpu_tensor_on_a_cuda_only_group(ctx):
    group = dist.new_group(backend="cuda:gloo")  # a backend for CUDA tensors only, as NCCL's
    try:
        dist.all_reduce(torch.ones(1), group=group)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_cpu_tensor_handed_to_an_nccl_group_is_a_fault_of_the_class():
    run = launch(_cpu_tensor_on_a_cuda_only_group, world_size=1)
    assert run.ok, run.summary()
    message = run.values[0]  # c10d's words, as on an NCCL group
    assert message == "No backend type associated with device type cpu", message
    assert distributed(RuntimeError(message))
    aten = "Expected all tensors to be on the same device, but found at least two devices, "
    assert distributed(RuntimeError(aten + "cuda:0 and cpu!"))
    assert not distributed(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))


# --- torchrun over several nodes: this node's GPUs for this node's ranks (item 7) -------------


def test_torchrun_over_two_nodes_needs_a_gpu_per_local_rank(gpus_visible, monkeypatch, tmp_path):
    torchrun_env = dict(RANK="9", WORLD_SIZE="16", LOCAL_WORLD_SIZE="8", MASTER_ADDR="n0")
    for key, value in torchrun_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("DDP_VERIFY_SPAWNED", raising=False)
    gpus_visible(8)
    assert torchrun.local_ranks(16) == 8
    ConsistencyOptions(impl="bucketed", world_size=16, backend="nccl")
    assert BenchOptions(world_size=16, out=str(tmp_path), device="cuda").device_type == "cuda"
    assert BenchOptions(world_size=16, out=str(tmp_path)).device_type == "cuda"
    gpus_visible(4)
    with pytest.raises(ValueError, match="8 ranks here, 4 GPU"):
        ConsistencyOptions(impl="bucketed", world_size=16, backend="nccl")
    with pytest.raises(ValueError, match="8 ranks here, 4 GPU"):
        BenchOptions(world_size=16, out=str(tmp_path), device="cuda")
    monkeypatch.delenv("MASTER_ADDR")  # not under torchrun: every rank is on this machine
    assert torchrun.local_ranks(16) == 16


def _set_device(index: int) -> None:
    """What `torch.cuda.set_device(index)` raises past the last GPU (torch 2.11's words)."""
    raise RuntimeError(
        "CUDA error: invalid device ordinal\nGPU device may be out of range, do you have enough GPUs?"
    )


def test_more_ranks_than_gpus_is_a_usage_error_naming_the_call(gpus_visible, monkeypatch):
    """A script giving each rank its own GPU, started with more ranks here than GPUs (two on
    one, as the GPU run of the CPU suite did): in the rank past the last GPU, one line naming
    the call, how many ranks can run, and the rehearsal. A wrong index with GPUs enough, in a
    rank a GPU exists for, or under a backend the script chose for CPU ranks, is a crash."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    gpus_visible(1)
    try:
        _set_device(1)
    except RuntimeError as exc:
        needs = needs_cuda.classify(exc, "nccl")
        assert needs_cuda.classify(exc, "gloo") is None  # CPU ranks binding a GPU: a crash
        monkeypatch.setenv("LOCAL_RANK", "0")  # rank 0 asking for cuda:1: the script's bug
        assert needs_cuda.classify(exc) is None
        monkeypatch.setenv("LOCAL_RANK", "1")
        gpus_visible(2)
        assert needs_cuda.classify(exc) is None
    line = needs.message("gloo")
    assert needs.where.endswith(f"test_gpu_paths.py:{_set_device.__code__.co_firstlineno + 2}")
    said = (
        ": `raise RuntimeError(` needs a GPU for each rank, and this machine has 1 GPU for 2 "
        "ranks: start at most 1 rank here, or run the script where each rank has a GPU, or "
        "rehearse it on CPU ranks as it is with --on-cpu"
    )
    assert said in line and line.endswith("--on-cpu") and "\n" not in line, line


# --- a traced NCCL rank's waits end when its collectives do (item 8) --------------------------


def test_traced_ranks_block_in_nccl_waits_and_nowhere_else(gpus_visible, monkeypatch, tmp_path):
    monkeypatch.delenv(BLOCKING_WAIT_ENV, raising=False)
    gpus_visible(0)
    for backend in ("gloo", "cpu:gloo", None):  # None on a machine without a GPU: gloo
        block_nccl_waits(backend)
        assert BLOCKING_WAIT_ENV not in os.environ, backend
    block_nccl_waits("nccl")
    assert os.environ[BLOCKING_WAIT_ENV] == "1"
    monkeypatch.setenv(BLOCKING_WAIT_ENV, "0")  # the user's choice stands
    block_nccl_waits("cpu:gloo,cuda:nccl")
    assert os.environ[BLOCKING_WAIT_ENV] == "0"
    monkeypatch.delenv(BLOCKING_WAIT_ENV)
    gpus_visible(2)
    block_nccl_waits(None)  # torch's default backend on a GPU machine includes NCCL
    assert os.environ[BLOCKING_WAIT_ENV] == "1"
    # Checks ask for it; measurements keep NCCL's own waits (their timings would change).
    check = ConsistencyOptions(impl="bucketed", world_size=2)
    assert launch_knobs(check)["nccl_blocking_wait"] is True
    measure = BenchOptions(world_size=2, out=str(tmp_path), device="cpu")
    assert launch_knobs(measure)["nccl_blocking_wait"] is False


# --- the flight recorder of the backend that ran (item 9) -------------------------------------


def test_the_flight_recorder_dump_is_the_backends_own():
    ours = torch._C._distributed_c10d
    assert flight_recorder_dump(ours, "gloo") is ours._dump_fr_trace_json
    cuda_build = SimpleNamespace(_dump_nccl_trace_json=object(), _dump_fr_trace_json=object())
    assert flight_recorder_dump(cuda_build, "nccl") is cuda_build._dump_nccl_trace_json
    assert flight_recorder_dump(cuda_build, "gloo") is cuda_build._dump_fr_trace_json


# --- the audit's fingerprints stay on the device until one copy (item 10) ---------------------


def test_a_fingerprint_is_made_on_the_tensors_device():
    assert fingerprint(torch.zeros(1000, device=META)).device == META  # no host copy
    assert fingerprint(torch.zeros(100_000, device=META)).device == META  # the row-sum path
    assert fingerprint(None).device.type == "cpu"


# --- NCCL communicators made before "up" (item 11) --------------------------------------------


def test_an_nccl_group_is_made_with_its_gpu_and_a_gloo_one_as_before():
    gpu = torch.device("cuda", 3)  # a device object: nothing touches CUDA
    assert group_kwargs("nccl", gpu) == {"device_id": gpu}
    assert group_kwargs("gloo", torch.device("cpu")) == {}


# --- launches side by side spread their ranks over the GPUs (item 14) -------------------------


def test_launches_side_by_side_take_the_least_used_gpus():
    taken = [gpus.take(n, 8) for n in (1, 2, 4)]  # the matrix's world sizes, at once
    assert taken == [[0], [1, 2], [3, 4, 5, 6]]
    assert gpus.take(2, 8) == [7, 0]  # then the least used, the lowest first
    for chosen in taken:
        gpus.give_back(chosen)
    assert gpus.take(2, 2) == [1, 0]  # GPU 0 still holds the launch above
    with pytest.raises(ValueError, match="3 ranks need as many GPUs, 2 visible"):
        gpus.take(3, 2)
    gpus.give_back([7, 0])
    gpus.give_back([1, 0])


def test_gloo_ranks_share_the_gpus_there_are(gpus_visible):
    """`--device cuda --backend gloo`: ranks beyond the GPUs share them, spread evenly, the
    least used first; NCCL still takes distinct GPUs; the placement is checked before any
    rank starts, in one line."""
    one = gpus.take(3, 1, shared=True)
    assert one == [0, 0, 0]
    gpus.give_back(one)
    side_by_side = [gpus.take(n, 2, shared=True) for n in (2, 3)]
    assert side_by_side == [[0, 1], [0, 1, 0]]
    for chosen in side_by_side:
        gpus.give_back(chosen)
    with pytest.raises(ValueError, match="2 ranks need as many GPUs, 1 visible"):
        gpus.take(2, 1)  # NCCL
    gpus_visible(1)
    gpus.check("cuda", "gloo")  # one GPU is enough for any number of gloo ranks
    with pytest.raises(ValueError, match="--backend nccl carries CUDA tensors only"):
        gpus.check("cpu", "nccl")
    gpus_visible(0)
    with pytest.raises(ValueError, match="--device cuda --backend gloo needs a GPU"):
        gpus.check("cuda", "gloo")
    options = ConsistencyOptions(impl="bucketed", world_size=4, device="cpu")
    assert launch_knobs(options)["device"] == "cpu"


# --- the profile's timeline on a GPU (item 15) ------------------------------------------------


def test_the_timeline_keeps_launch_ranges_from_the_autograd_thread():
    events = [
        dict(ph="X", name="ProfilerStep#1", ts=0, dur=100, tid=1),
        dict(ph="X", name="backward", ts=10, dur=50, tid=1, cat="user_annotation"),
        dict(ph="X", name="BucketedDDP.launch[0]", ts=20, dur=5, tid=7, cat="user_annotation"),
        dict(ph="X", name="BucketedDDP.wait[0]", ts=70, dur=5, tid=1, cat="user_annotation"),
    ]
    rows = dict(traces.timeline({"traceEvents": events}))
    assert [name for _, _, name in rows["sync ranges"]] == [
        "BucketedDDP.launch[0]",
        "BucketedDDP.wait[0]",
    ]
    assert memcpy_name("cpu") == "memcpy (1 core)" and "GPU" in memcpy_name("cuda")

"""The profiler harness: real traces from real ranks, the numbers read back from them, and a
real TensorBoard serving them.

One profile of every variant (the tiny GPT, 2 ranks, 2 active steps) is written once per
test run and shared by every xdist worker; the tests read it. Interval arithmetic and the
trace analysis are also checked on synthetic traces whose answers are known exactly. Nothing here asserts a time: the
machine is shared, so only relations that hold by construction are checked (exposed <=
communication <= step, compute <= step), plus counts and bytes, which are exact.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest

from tests.processes import descendants, listeners, once_per_session
from verify import runs
from verify.perf import issued, traces
from verify.perf.base import all_variants
from verify.perf.profiling import ProfileOptions, run_profile

BUCKET_MB = 0.02  # several buckets even in the tiny GPT (0.1M parameters)


@pytest.fixture(scope="session")
def profiled(tmp_path_factory):
    """The profile, written once for the whole run (`once_per_session`)."""

    def profile(out):
        options = ProfileOptions(
            impl="all", world_size=2, wait=0, warmup=1, active=2, model_size_m=None,
            bucket_mb=BUCKET_MB, out=str(out), timeout_s=300,
            device="cpu",  # about the CPU: a host with GPUs would default to cuda
        )  # fmt: skip
        os.makedirs(out, exist_ok=True)
        result = run_profile(options)
        assert result.ok, result.failure
        return result

    return once_per_session(tmp_path_factory, "profile", profile)


# --- synthetic traces: exact answers --------------------------------------------------------


def test_interval_arithmetic():
    a = traces.union([(0, 10), (5, 12), (20, 30), (30, 31), (40, 40)])
    assert a == [(0, 12), (20, 31)]
    assert traces.measure(a) == 23
    assert traces.subtract(a, [(2, 3), (11, 25)]) == [(0, 2), (3, 11), (25, 31)]
    assert traces.clip(a, 5, 22) == [(5, 12), (20, 22)]


def _x(name, ts, dur, tid, cat="cpu_op", **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "cat": cat,
            "args": args}  # fmt: skip


def test_analysis_of_a_synthetic_cpu_trace():
    """Step 0..100 us on thread 1. Compute: ops at 0-40 and 60-80 (a c10d op at 40-45 is not
    compute). Communication on gloo thread 2: 30-50 and 45-70 (union 30-70 = 40 us). Exposed:
    30-70 minus compute = 40-60 = 20 us."""
    events = [
        _x("ProfilerStep#3", 0, 100, 1, cat="user_annotation"),
        _x("aten::mm", 0, 40, 1),
        _x("aten::add", 10, 5, 1),  # nested: counted once
        _x("c10d::allreduce_", 40, 5, 1),
        _x("aten::mul", 60, 20, 1),
        _x("forward", 0, 30, 1, cat="user_annotation"),
        _x("gloo:all_reduce", 30, 20, 2, cat="user_annotation",
           **{"Input Dims": [[256]], "Input type": ["float"]}),
        _x("gloo:broadcast", 45, 25, 2, cat="user_annotation",
           **{"Input Dims": [[[8, 8], [4]]], "Input type": ["c10::BFloat16"]}),
        _x("gloo:all_reduce", 150, 10, 2, cat="user_annotation"),  # after the step
    ]  # fmt: skip
    (m,) = traces.analyze({"traceEvents": events}, rank=1)
    assert (m.rank, m.step, m.step_ms) == (1, 3, 0.1)
    assert m.compute_ms == pytest.approx(0.060)
    assert m.comm_ms == pytest.approx(0.040)
    assert m.exposed_ms == pytest.approx(0.020)
    assert m.overlap == pytest.approx(0.5)
    assert m.collectives == 2
    assert m.bytes == 256 * 4 + (64 + 4) * 2
    assert m.phases_ms["forward"] == pytest.approx(0.030)


def test_collectives_issued_are_named_by_their_operator_and_placed_by_phase():
    """gloo runs a reduce-scatter as an all-reduce of the whole buffer (its range reads
    gloo:all_reduce); the dispatcher's operator names the call, and the training thread's
    phase range open when it started (on any thread: a GPU's autograd thread) places it."""
    assert issued.kind("c10d::_allgather_base_") == "all_gather"
    assert issued.kind("c10d::allgather_into_tensor_coalesced_") == "all_gather"
    assert issued.kind("c10d::_reduce_scatter_base_") == "reduce_scatter"
    assert issued.kind("_c10d_functional::reduce_scatter_tensor") == "reduce_scatter"
    assert issued.kind("c10d::allreduce_") == "all_reduce"
    assert issued.kind("c10d::barrier") == "barrier"
    assert issued.kind("_c10d_functional::wait_tensor") is None
    assert issued.kind("aten::all_gather") is None and issued.kind("gloo:all_reduce") is None
    events = [
        _x("ProfilerStep#1", 0, 100, 1, cat="user_annotation"),
        _x("forward", 0, 30, 1, cat="user_annotation"),
        _x("backward", 30, 40, 1, cat="user_annotation"),
        _x("c10d::_allgather_base_", 2, 1, 1),
        _x("c10d::_allgather_base_", 32, 1, 1),
        _x("c10d::_reduce_scatter_base_", 50, 1, 9),  # autograd's thread, inside backward
        _x("gloo:all_reduce", 51, 10, 2, cat="user_annotation"),  # its wire range: not counted
        _x("c10d::allreduce_", 80, 1, 1),  # outside every phase
        _x("c10d::allreduce_", 120, 1, 1),  # after the step
    ]  # fmt: skip
    (m,) = traces.analyze({"traceEvents": events})
    assert m.issued == {
        "all_gather": {"forward": 1, "backward": 1},
        "reduce_scatter": {"backward": 1},
        "all_reduce": {issued.OTHER: 1},
    }
    assert issued.mean([m.issued, {}]) == {
        "all_gather": {"forward": 0.5, "backward": 0.5},
        "reduce_scatter": {"backward": 0.5},
        "all_reduce": {issued.OTHER: 0.5},
    }
    lanes = dict(traces.timeline({"traceEvents": events}))
    assert [name for _, _, name in lanes["issued"]] == [
        "all_gather", "all_gather", "reduce_scatter", "all_reduce"
    ]  # fmt: skip


def test_analysis_of_a_synthetic_gpu_trace():
    """With kernels present, compute and communication come from the device timeline."""
    events = [
        _x("ProfilerStep#0", 0, 100, 1, cat="user_annotation"),
        _x("nccl:all_reduce", 5, 1, 1, cat="user_annotation",
           **{"Input Dims": [[10]], "Input type": ["float"]}),
        _x("sm80_gemm", 10, 50, 7, cat="kernel"),
        _x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 40, 8, cat="kernel"),
    ]  # fmt: skip
    (m,) = traces.analyze({"traceEvents": events})
    assert (m.compute_ms, m.comm_ms, m.exposed_ms) == pytest.approx((0.050, 0.040, 0.020))
    assert (m.collectives, m.bytes) == (1, 40)


def test_a_gpu_trace_counts_each_step_and_collective_once():
    """The profiler draws the host's ranges a second time on the GPU's streams
    (`gpu_user_annotation`, at GPU time, here lagging into the next step): a world-size-1
    NCCL profile of flat read 0.5 all-reduces a step (four steps, two of them the copies,
    empty), and gloo carrying CUDA tensors 2 (each range and its copy). One step, one each;
    gloo's worker-thread range is its communication."""
    events = [
        _x("ProfilerStep#0", 0, 100, 1, cat="user_annotation"),
        _x("ProfilerStep#0", 2, 90, 7, cat="gpu_user_annotation"),
        _x("c10d::allreduce_", 30, 2, 1, cat="cpu_op"),
        _x("gloo:all_reduce", 31, 20, 3, cat="user_annotation",
           **{"Input Dims": [[10]], "Input type": ["float"]}),
        _x("gloo:all_reduce", 101, 1, 8, cat="gpu_user_annotation",
           **{"Input Dims": [[10]], "Input type": ["float"]}),
        _x("sm80_gemm", 10, 30, 7, cat="kernel"),
    ]  # fmt: skip
    (m,) = traces.analyze({"traceEvents": events})
    assert (m.collectives, m.bytes) == (1, 40)
    assert (m.compute_ms, m.comm_ms, m.exposed_ms) == pytest.approx((0.030, 0.020, 0.011))
    assert m.issued == {"all_reduce": {"other": 1}}


def test_run_folders_are_never_reused(tmp_path):
    first = runs.new_run_dir(tmp_path, "bucketed", 2, "cpu")
    second = runs.new_run_dir(tmp_path, "bucketed", 2, "cpu")
    assert first != second and first.is_dir() and second.is_dir()
    assert re.fullmatch(r"bucketed_2xcpu_\d{8}-\d{6}(-\d+)?", first.name)
    assert runs.new_run_dir(tmp_path, "my/ddp.py:MyDDP", 2, "cpu").name.startswith(
        "my-ddp.py-MyDDP_2xcpu_"
    )


# --- a real profile -------------------------------------------------------------------------


def test_every_rank_writes_a_trace_with_the_ranges(profiled):
    assert profiled.run_dir.name.startswith("all_2xcpu_")
    meta = json.loads((profiled.run_dir / "metadata.json").read_text())
    assert {"command", "date", "options", "machine", "threads", "machine_line"} <= meta.keys()
    assert meta["machine"]["torch"] and meta["machine"]["cores"]
    assert "per rank" in meta["threads"] and meta["threads"] in profiled.machine
    assert set(profiled.trace_dirs) == set(all_variants())
    for impl, folder in profiled.trace_dirs.items():
        found = traces.find_traces(folder)
        assert set(found) == {"rank0", "rank1"}, (impl, found)
        names = {e.get("name") for e in traces.load_trace(found["rank1"])["traceEvents"]}
        assert {"forward", "backward", "optimizer_step", "gloo:all_reduce"} <= names, impl
        assert {"ProfilerStep#1", "ProfilerStep#2"} <= names  # the 2 active steps
        if impl in ("naive", "flat", "overlap", "bucketed", "zero1"):
            assert "grad_sync" in names
        if impl in ("overlap", "bucketed", "zero1"):
            prefix = "OverlapDDP" if impl == "overlap" else "BucketedDDP"
            assert {f"{prefix}.launch[0]", f"{prefix}.wait[0]"} <= names, impl
        if impl == "zero1":
            assert {"zero1.step", "zero1.sync_params", "gloo:broadcast"} <= names
        if impl in ("zero3", "torch-fsdp"):  # parameter sharding: gathers and scatters
            gather, scatter = "c10d::_allgather_base_", "c10d::_reduce_scatter_base_"
            assert {"gloo:all_gather", gather, scatter} <= names, impl


def test_summary_numbers_are_consistent(profiled):
    by_impl = {s.impl: s for s in profiled.summaries}
    for s in profiled.summaries:
        assert (s.ranks, s.steps) == (2, 2), s
        assert 0 <= s.exposed_ms <= s.comm_ms + 1e-9 <= s.step_ms + 1e-9, s
        assert 0 < s.compute_ms <= s.step_ms, s
        assert s.collectives >= 1 and s.bytes > 0, s
    # Every DDP variant moves the same gradient bytes (plus the built-ins' usage map);
    # ZeRO-1 adds one broadcast of every parameter.
    grads = by_impl["torch-ddp"].bytes
    for impl in ("naive", "flat", "overlap", "bucketed"):
        assert grads <= by_impl[impl].bytes <= grads + 4096, impl
    assert by_impl["zero1"].bytes == pytest.approx(2 * by_impl["bucketed"].bytes, rel=0.01)
    # Counts are exact: naive/overlap one per gradient + usage map, flat 1 + usage map.
    assert by_impl["flat"].collectives == 2
    assert by_impl["naive"].collectives == by_impl["overlap"].collectives > 10
    assert by_impl["naive"].exposed_ms == pytest.approx(by_impl["naive"].comm_ms, rel=0.05)
    # Where the sharded rungs communicate, by the phase each collective was issued in. ZeRO-3
    # and FSDP2 gather every unit before its forward and again in backward (the unit was freed
    # after forward), and reduce-scatter each unit's gradients once, during backward, as the
    # unit's gradients are complete (zero3 then all-reduces the usage flags once in grad_sync).
    # ZeRO-2 reduce-scatters buckets during backward and broadcasts the owners' parameters in
    # the optimizer step. DDP gathers nothing.
    assert by_impl["zero3"].issued["all_reduce"] == {"grad_sync": 1}, by_impl["zero3"].issued
    for impl, scatter_phase in (("zero3", "backward"), ("torch-fsdp", "backward")):
        issued = by_impl[impl].issued
        assert set(issued["reduce_scatter"]) == {scatter_phase}, (impl, issued)
        units = issued["reduce_scatter"][scatter_phase]
        assert units >= 2 and issued["all_gather"]["forward"] == units, (impl, issued)
        assert 1 <= issued["all_gather"]["backward"] <= units, (impl, issued)
    zero2 = by_impl["zero2"].issued
    assert zero2["reduce_scatter"].get("backward", 0) >= 1 and "all_gather" not in zero2, zero2
    assert zero2["broadcast"] == {"optimizer_step": 2}, zero2  # one per rank
    assert set(by_impl["bucketed"].issued) == {"all_reduce"}
    written = json.loads((profiled.run_dir / "summary.json").read_text())
    assert [s["impl"] for s in written["summaries"]] == list(all_variants())
    assert written["verdict"] == "pass"


# --- TensorBoard ----------------------------------------------------------------------------


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


# Two of the runs, one of ours and PyTorch's: every variant's trace is written by the same
# profiler, and the plugin parses each run in a process of its own (~2 s of CPU a run).
TENSORBOARD_RUNS = ("bucketed", "torch-ddp")


def test_tensorboard_lists_the_runs_and_ranks(profiled, tmp_path):
    """A real TensorBoard on loopback, a port the OS picks, on a copy of two runs of the
    `--impl all` folder; the profiler plugin's own HTTP API must list each as a run and both
    ranks as its workers. Then it is stopped, with every process it started (its own
    session), whatever happened."""
    pytest.importorskip(
        "tensorboard", reason="needs the profile extra: pip install -e '.[profile]'"
    )
    pytest.importorskip("torch_tb_profiler", reason="needs the profile extra (torch-tb-profiler)")
    logdir = tmp_path / "logdir"
    for run in TENSORBOARD_RUNS:
        shutil.copytree(profiled.run_dir / run, logdir / run)
    log = tmp_path / "tensorboard.log"
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
             "--host", "127.0.0.1", "--port", "0", "--reload_interval", "1"],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        port = None
        while port is None and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            m = re.search(r"http://127\.0\.0\.1:(\d+)/", log.read_text())
            port = m and int(m.group(1))
            time.sleep(0.2)
        assert port, "TensorBoard did not print its address:\n" + log.read_text()[-2000:]
        # It, and the data server it may start, listen on loopback only (test_listening.py).
        served = listeners({proc.pid} | descendants(proc.pid))
        assert served and all(x.loopback for x in served), served
        base = f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler"
        expected = set(TENSORBOARD_RUNS)
        runs: dict = {}
        while time.monotonic() < deadline:
            runs = _get(f"{base}/runs")
            if expected <= set(runs["runs"]) and not runs["loading"]:
                break
            time.sleep(0.5)
        assert expected <= set(runs.get("runs", [])), runs
        for run in expected:
            q = urllib.parse.quote(run)
            views = _get(f"{base}/views?run={q}")
            assert views, run
            workers = _get(f"{base}/workers?run={q}&view={urllib.parse.quote(views[0])}")
            assert set(workers) == {"rank0", "rank1"}, (run, workers)
    finally:
        _stop_session(proc)


def _stop_session(proc: subprocess.Popen) -> None:
    """SIGTERM TensorBoard's whole session (it and any loader it started), SIGKILL after 15 s,
    then check that nothing of it is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=15)
            break
        except subprocess.TimeoutExpired:
            continue
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # anyone left in the session?
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail("TensorBoard left processes behind")

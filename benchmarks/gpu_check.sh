#!/usr/bin/env bash
# The GPU checks of one device session, as one script (issue 32 item 6): the gpu-marked
# tests, then the whole CPU suite beside `bench --device cuda` at one rank (NCCL) and at two
# ranks sharing the GPU (gloo), and the one matrix whose output docs/certification.md quotes.
#
#   bash benchmarks/gpu_check.sh tests|rest|all [OUT]    # logs into OUT ($OUT, else /tmp/gpu_check)
#
# Written for a machine with one GPU and 16 cores whose python3 holds a CUDA torch, pytest,
# pytest-xdist and pytest-timeout (the device machines here), run from the repository root.
# Two calls of under 10 minutes each: `tests` (the gpu-marked tests: 32 of them, 18 done in
# 230 s at 6 at a time on one H100) and `rest`. Each part has its own time limit and logs
# every test as it ends (-v), so what ran survives a part that overruns. Timings from `rest`
# are taken beside the CPU suite: they prove the paths run, not their speed. `all` is both in
# one call of under 10 minutes (a session lent 15 minutes of device time has one such call,
# its start included): the gpu-marked tests alone first, then `rest` with shorter limits.
set -u
what=${1:?say tests or rest}
out=${2:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 CI=true
py=python3

part() {  # part NAME SECONDS COMMAND...: run it under a limit, log into $out/NAME.log
    local name=$1 limit=$2
    shift 2
    local s=$SECONDS
    echo "+ $*" >"$out/$name.log"
    timeout -k 10 "$limit" "$@" >>"$out/$name.log" 2>&1
    echo "[$name] exit $? in $((SECONDS - s)) s" | tee -a "$out/$name.log"
}

{
    date
    nvidia-smi -L
    echo "cores: $(nproc)"
    $py -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
} >"$out/machine.txt" 2>&1

gpu_limit=540 suite_limit=420
[[ $what == all ]] && gpu_limit=310 suite_limit=250
if [[ $what != rest ]]; then  # the gpu-marked tests, several at a time, alone on the machine
    part gpu_tests $gpu_limit $py -m pytest -p no:cacheprovider -m gpu -n 8 -v -rfEs --timeout 280
    [[ $what == tests ]] && exit
fi

# the CPU suite on most cores, and meanwhile the measurements, the matrix and the script paths
part cpu_suite $suite_limit $py -m pytest -p no:cacheprovider -m "not gpu" -n 12 -v -rfEs \
    --timeout 240 &
part bench_ws1 60 $py -m verify bench --device cuda --world-size 1 --out /tmp/gpu_bench --no-sweep
part bench_ws2 60 $py -m verify bench --device cuda --backend gloo --world-size 2 --out /tmp/gpu_bench --no-sweep
part zero_round_trip 40 $py -m verify matrix --impl torch-zero --rows round-trip --device cuda --backend gloo
# a CUDA script under torchrun (the launcher form), then recorded and run again against its
# recording (the same training: the comparison's verdict on CUDA tensors); one log, as what
# comes back from a device call is at most 8 files
cuda_script() {
    local script="tests/fixtures/audit_cuda.py gloo" runs=/tmp/gpu_runs
    $py -m verify audit --out $runs -- $py -m torch.distributed.run --nproc_per_node 2 $script
    echo "[launcher form] exit $?"
    $py -m verify audit --nproc 2 --out $runs --record /tmp/gpu_rec -- $script
    echo "[recorded] exit $?"
    $py -m verify audit --nproc 2 --out $runs --against /tmp/gpu_rec -- $script
    echo "[against the recording] exit $?"
}
export -f cuda_script
export py
part cuda_script 100 bash -c cuda_script
wait

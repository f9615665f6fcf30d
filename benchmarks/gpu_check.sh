#!/usr/bin/env bash
# The GPU checks of one device session, as one script (issue 32 item 6): the gpu-marked
# tests, then the whole CPU suite beside `bench --device cuda` at one rank (NCCL) and at two
# ranks sharing the GPU (gloo), and the one matrix whose output docs/certification.md quotes.
#
#   bash benchmarks/gpu_check.sh tests|rest [OUT]    # logs into OUT ($OUT, else /tmp/gpu_check)
#
# Written for a machine with one GPU and 16 cores whose python3 holds a CUDA torch, pytest,
# pytest-xdist and pytest-timeout (the device machines here), run from the repository root.
# Two calls of under 10 minutes each: `tests` (the gpu-marked tests: 32 of them, 18 done in
# 230 s at 6 at a time on one H100) and `rest`. Each part has its own time limit and logs
# every test as it ends (-v), so what ran survives a part that overruns. Timings from `rest`
# are taken beside the CPU suite: they prove the paths run, not their speed.
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

if [[ $what == tests ]]; then  # the gpu-marked tests, several at a time
    part gpu_tests 540 $py -m pytest -p no:cacheprovider -m gpu -n 6 -v -rfEs --timeout 300
    exit
fi

# the CPU suite on most cores, and meanwhile the measurements and the matrix
part cpu_suite 420 $py -m pytest -p no:cacheprovider -m "not gpu" -n 12 -v -rfEs --timeout 400 &
part bench_ws1 100 $py -m verify bench --device cuda --world-size 1 --out /tmp/gpu_bench --no-sweep
part bench_ws2 100 $py -m verify bench --device cuda --backend gloo --world-size 2 --out /tmp/gpu_bench --no-sweep
part zero_round_trip 60 $py -m verify matrix --impl torch-zero --rows round-trip --device cuda --backend gloo
wait

"""The tool measuring itself: a maintainer's scripts, not a user's commands.

Each script runs one measurement of the tool's own costs with the flags, `--help`, `--json`,
bad-input line (exit 2) and report it had as a `python -m verify` command; the measurements
themselves are here too (`bench_*.py` over `costs.py`: their ranks are started by the one
launcher, which imports them by name), their reports in `text_costs.py`.
benchmarks/README.md lists them.

    audit_cost.py     the per-step audit against an all-gather and a training step
                      (`--script-audit`: `audit --nproc`'s step hooks)   was `bench-audit`
    tracer_cost.py    the collective tracer against a training step      was `bench-tracer`
    sanitize_cost.py  --sanitize against a training step (`--matrix`: against a whole
                      certification matrix)                              was `bench-sanitize`

The user's own measurements (profile, bench, comm, scaling, train) stay commands.
"""

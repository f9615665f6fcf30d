"""The user's measurements: what the variants cost. Every step is trained by the one trainer
(`verify/training/trainer.py`), every rank started by the one launcher. The commands' rows are
in the CLI's table (`verify/cli/commands.py`); the tool's own costs are measured by a
maintainer's scripts, outside the product (`benchmarks/`, over `base.py` here). A run function
returns its result and writes its run folder's JSON and charts, the CLI prints the report and
keeps it as `.txt` (`verify/cli/text_perf.py`, `text_bench.py`).

    base.py          what they share: options base, run folder, verdict, progress from rank 0
    timing.py        the slowest rank's time, interleaved rounds, paired ratios, decisions
    profiling.py     profile: torch.profiler traces      traces.py   reading them back
    bench.py         bench: the launch and the rank      bench_result.py  its result, the bars
    bandwidth.py     bench's bucket all-reduce bandwidth bar
    comm.py          comm: collective bandwidth          collectives.py  the pieces bench shares
    alphabeta.py     the cost model: bus bandwidth, the alpha-beta fit, the best bucket
    scaling.py       scaling: throughput at world sizes 1..N
    train.py         train: loss curves against a single process
    bench_memory.py  bench's memory per rank, against 1/N (the memory check's measure)
    issued.py        the collectives a traced step issued, by kind and phase
    charts.py        the PNGs
"""

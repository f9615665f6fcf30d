"""What `--on-cpu` (verify/oncpu/) adds to a training step, run by the maintainer's script
`python benchmarks/on_cpu_cost.py` (benchmarks/README.md), not by a timed test. One launch
of two CPU ranks over gloo; in each, one GPT-style model under DDP takes the same step two ways, the arms taking turns every round, the order rotating (`costs.take_turns`):

- plain: the step as a hand-edited CPU copy writes it (`x.to("cpu")`, CPU autocast in
  bfloat16), the rehearsal not installed;
- on-cpu: the step as the CUDA script writes it (`x.to(f"cuda:{local_rank}")`,
  `torch.autocast("cuda", bfloat16)`, `require_backward_grad_sync` on the last of two
  micro-steps, `torch.cuda.synchronize()`), run under the rehearsal, which maps each call
  and counts it at its line, as in a rank of `audit --nproc N --on-cpu`.

Every sample is the slowest rank's (`timing.timed_with_cpu`). The ratio on-cpu / plain of
wall time is paired per round with a 95% interval (`timing.paired`) and decided against the
goal, at most 1.02 (`timing.decide`); the same ratio of the ranks' CPU time is printed beside
it, as the tracer's benchmark does: on a machine shared with other work the wall times
swing with the load, the CPU time a step takes much less.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from benchmarks.costs import goal_bar, run_cost, take_turns
from verify.launching import RankContext
from verify.options import knob
from verify.perf.base import Measured, MeasureOptions
from verify.perf.timing import Ratio, paired, timed_with_cpu

GOAL = 1.02


@dataclass(frozen=True, kw_only=True)
class OnCpuBenchOptions(MeasureOptions):
    """The model's width and the rounds; always two CPU ranks over gloo (a rehearsal is a
    CPU run)."""

    width: int = knob(128, "the model's width (two MLP blocks, a tied head)", minimum=8)
    repeats: int = knob(30, "interleaved rounds of the two arms", minimum=2)
    world_size: int = knob(2, "ranks to start (collectives need two)", minimum=2)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device_type != "cpu":
            raise ValueError(
                "--on-cpu runs on CPU ranks: its cost is measured there (--device cpu)"
            )


@dataclass(frozen=True)
class OnCpuBenchResult(Measured):
    """Every round's two step times, and how many call sites the rehearsal mapped."""

    options: OnCpuBenchOptions
    verdict: str
    plain_s: tuple[float, ...] = ()
    on_cpu_s: tuple[float, ...] = ()
    plain_cpu_s: tuple[float, ...] = ()  # the same steps' CPU time (the slowest rank's)
    on_cpu_cpu_s: tuple[float, ...] = ()
    sites_mapped: int = 0
    machine: str = ""
    torch_version: str = ""
    failure: str | None = None

    def bar(self) -> tuple[str, Ratio, float, str]:
        """(what, on-cpu / plain paired per round, goal, decision)."""
        return goal_bar("on-cpu / plain step", self.on_cpu_s, self.plain_s, GOAL)

    @property
    def cpu_ratio(self) -> Ratio:
        """on-cpu / plain of the steps' CPU time, paired per round."""
        return paired(list(self.on_cpu_cpu_s), list(self.plain_cpu_s))

    def to_dict(self) -> dict:
        d = {**asdict(self), "ok": self.ok}
        if self.ok:
            what, r, goal, decided = self.bar()
            d["bar"] = {"what": what, **r.to_dict(), "goal": goal, "decision": decided}
            d["cpu_ratio"] = self.cpu_ratio.to_dict()
        return d


def run_on_cpu_bench(options: OnCpuBenchOptions) -> OnCpuBenchResult:
    return run_cost(options, on_cpu_bench_on_rank, OnCpuBenchResult)


def on_cpu_bench_on_rank(ctx: RankContext, options: OnCpuBenchOptions) -> dict:
    """Plain and rehearsed steps of one model, interleaved (module docstring)."""
    width = options.width
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from verify import oncpu

    torch.manual_seed(0)
    vocab, block, B = 256, 64, 8

    class Net(nn.Module):  # embedding, two pre-norm MLP blocks, a tied head
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block, width)
            self.blocks = nn.ModuleList(
                nn.Sequential(
                    nn.LayerNorm(width),
                    nn.Linear(width, 4 * width),
                    nn.GELU(),
                    nn.Linear(4 * width, width),
                )  # fmt: skip
                for _ in range(2)
            )
            self.head = nn.Linear(width, vocab, bias=False)
            self.wte.weight = self.head.weight

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
            for b in self.blocks:
                x = x + b(x)
            return F.cross_entropy(self.head(x).reshape(-1, vocab), targets.reshape(-1))

    model = DDP(Net())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(ctx.rank)
    data = [torch.randint(vocab, (B, block + 1), generator=gen) for _ in range(2)]

    def step(device: str, device_type: str) -> None:
        opt.zero_grad(set_to_none=True)
        for micro, buf in enumerate(data):
            x, y = buf[:, :-1].to(device), buf[:, 1:].to(device)
            model.require_backward_grad_sync = micro == len(data) - 1
            with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
                loss = model(x, y) / len(data)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device_type == "cuda":
            torch.cuda.synchronize()

    cpu = ctx.device
    rehearsal, sites = None, 0
    cpu_times: dict[str, list[float]] = {"plain": [], "on-cpu": []}

    def arm(rehearsed: bool) -> float:
        nonlocal rehearsal, sites
        if rehearsed and rehearsal is None:
            rehearsal = oncpu.install(None, ctx.rank)
        elif not rehearsed and rehearsal is not None:
            rehearsal.remove()
            rehearsal = None
        spec = (f"cuda:{ctx.local_rank}", "cuda") if rehearsed else ("cpu", "cpu")
        seconds, cpu_s = timed_with_cpu(lambda: step(*spec), cpu)
        cpu_times["on-cpu" if rehearsed else "plain"].append(cpu_s)
        if rehearsal is not None:
            sites = max(sites, len(rehearsal.ledger.counts))
        return seconds

    arm(False), arm(True)  # warm-up: allocations, the reducer's buckets
    arms = {"plain": lambda: arm(False), "on-cpu": lambda: arm(True)}
    for times in cpu_times.values():
        times.clear()  # the warm-up's
    samples = take_turns(ctx, arms, options.repeats, "on-cpu cost", every=10)
    if rehearsal is not None:
        rehearsal.remove()
    return {"plain_s": tuple(samples["plain"]), "on_cpu_s": tuple(samples["on-cpu"]),
            "plain_cpu_s": tuple(cpu_times["plain"]), "on_cpu_cpu_s": tuple(cpu_times["on-cpu"]),
            "sites_mapped": sites}  # fmt: skip

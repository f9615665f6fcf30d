"""`python benchmarks/on_cpu_cost.py`: what `--on-cpu` (verify/oncpu/) adds to a training step.

A maintainer's measurement of the tool itself (benchmarks/README.md), not a timed test. One
launch of two CPU ranks over gloo; in each, one GPT-style model under DDP takes the same
step two ways, the arms taking turns every round, the order rotating (`timing.interleave`):

- plain: the step as a hand-edited CPU copy writes it (`x.to("cpu")`, CPU autocast in
  bfloat16), the rehearsal not installed;
- on-cpu: the step as the CUDA script writes it (`x.to(f"cuda:{local_rank}")`,
  `torch.autocast("cuda", bfloat16)`, `require_backward_grad_sync` on the last of two
  micro-steps, `torch.cuda.synchronize()`), run under the rehearsal, which maps each call
  and counts it at its line, as in a rank of `audit --nproc N --on-cpu`.

Every sample is the slowest rank's (`timing.timed`). The ratio on-cpu / plain is paired per
round with a 95% interval (`timing.paired`) and decided against the goal, at most 1.02
(`timing.decide`). Exit 0 when the ranks finished (a missed goal is reported, not an
error), 1 when a rank failed, 2 for bad input.

    python benchmarks/on_cpu_cost.py --rounds 30 --width 128
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a file: the checkout it sits in is the one measured
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL = 1.02


def on_rank(ctx, width: int, rounds: int) -> dict:
    """Plain and rehearsed steps of one model, interleaved (module docstring)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from verify import oncpu
    from verify.perf.timing import interleave, timed

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

    cpu = torch.device("cpu")
    rehearsal, sites = None, 0

    def arm(rehearsed: bool) -> float:
        nonlocal rehearsal, sites
        if rehearsed and rehearsal is None:
            rehearsal = oncpu.install(None, ctx.rank)
        elif not rehearsed and rehearsal is not None:
            rehearsal.remove()
            rehearsal = None
        spec = (f"cuda:{ctx.local_rank}", "cuda") if rehearsed else ("cpu", "cpu")
        seconds = timed(lambda: step(*spec), cpu)
        if rehearsal is not None:
            sites = max(sites, len(rehearsal.ledger.counts))
        return seconds

    arm(False), arm(True)  # warm-up: allocations, the reducer's buckets
    samples = interleave({"plain": lambda: arm(False), "on-cpu": lambda: arm(True)}, rounds)
    if rehearsal is not None:
        rehearsal.remove()
    return {"plain_s": samples["plain"], "on_cpu_s": samples["on-cpu"], "sites_mapped": sites}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/on_cpu_cost.py",
                                     description=__doc__.splitlines()[0])  # fmt: skip
    parser.add_argument("--rounds", type=int, default=30, help="paired rounds (default 30)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.width < 8:
        print(f"{parser.prog}: error: --rounds must be >= 2 and --width >= 8", file=sys.stderr)
        return 2
    import statistics

    from verify import runs
    from verify.launching import launch
    from verify.perf.timing import decide, paired

    run = launch(on_rank, world_size=2, args=(args.width, args.rounds), timeout_s=1800)
    if not run.ok:
        print(f"on-cpu cost: the ranks failed: {run.summary()}", file=sys.stderr)
        return 1
    got = run.values[0]
    ratio = paired(got["on_cpu_s"], got["plain_s"])
    verdict = decide(ratio, GOAL)
    machine = runs.describe_machine(runs.machine_info(), run.threads)
    if args.json:
        print(json.dumps({**got, "ratio": ratio.value, "low": ratio.low, "high": ratio.high,
                          "goal": GOAL, "decision": verdict, "machine": machine}))  # fmt: skip
        return 0
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f} ms"  # noqa: E731
    print(f"on-cpu cost: 2 ranks, GPT-style step (width {args.width}), {args.rounds} paired rounds")
    print(f"  plain step (CPU copy)  {ms(got['plain_s'])} median")
    print(f"  --on-cpu step          {ms(got['on_cpu_s'])} median ({got['sites_mapped']} call sites mapped)")  # fmt: skip
    print(f"  on-cpu / plain         {ratio.value:.4f} (95% {ratio.low:.4f}-{ratio.high:.4f}), "
          f"goal <= {GOAL}: {verdict}")  # fmt: skip
    print(f"  machine: {machine}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`audit --against` on a fresh nanoGPT-style script (written here): the precision the forward
ran in (bf16 autocast), ZeRO-1 against plain AdamW, and a run whose own replicas diverge
(docs/compare.md).

Real runs over gloo, shared by the module (`fresh`): two recordings (1 rank x 4 micro-steps
under bf16 autocast; 2 ranks x 2 in float32 with plain AdamW), then five runs against them,
two or three at a time. `fresh_problems` is the same set of verdicts for the hog window
(tests/test_load.py), and `test_the_verdicts_hold_idle` its idle run.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from verify.checks.script_audit import AuditOptions, check_audit
from verify.cli.text_compare import audit as audit_text

# A small GPT trained the way nanoGPT's train.py trains one, written fresh: DDP when launched
# on several processes, accumulation with the all-reduce decided per micro-step, bf16
# autocast around the forward (the backward outside it), AdamW with a no-decay group, or
# ZeRO-1 over AdamW with the no-decay group added after construction.
GPT = """
import argparse
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--accum", type=int, default=4)  # micro-steps per step on each process
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--bf16", action="store_true")
parser.add_argument("--zero", action="store_true")
parser.add_argument("--nodecay-lr", type=float, default=1e-3)
parser.add_argument("--no-div", action="store_true")  # forgets loss / accum
parser.add_argument("--sync-first", action="store_true")  # all-reduces micro-step 0, not the last
args = parser.parse_args()

ddp = int(os.environ.get("WORLD_SIZE", 1)) > 1
if ddp:
    dist.init_process_group("gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
ctx = torch.autocast("cpu", dtype=torch.bfloat16) if args.bf16 else nullcontext()
V, T, D = 64, 16, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(D)
        self.attn = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D, bias=False)
        self.ln_2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D, bias=False)
        self.out = nn.Linear(4 * D, D, bias=False)

    def forward(self, x):
        q, k, v = self.attn(self.ln_1(x)).split(D, dim=2)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.out(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Embedding(T, D)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


torch.manual_seed(1337)
raw = GPT()
model = DDP(raw) if ddp else raw
decay = [p for p in raw.parameters() if p.dim() >= 2]
nodecay = [p for p in raw.parameters() if p.dim() < 2]
if args.zero:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    opt = ZeroRedundancyOptimizer(decay, optimizer_class=torch.optim.AdamW, lr=1e-3,
                                  betas=(0.9, 0.95), weight_decay=0.1)
    opt.add_param_group({"params": nodecay, "weight_decay": 0.0, "lr": args.nodecay_lr})
else:
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": nodecay, "weight_decay": 0.0, "lr": args.nodecay_lr}],
                            lr=1e-3, betas=(0.9, 0.95))

data = torch.randint(0, V, (args.steps, 8, T + 1), generator=torch.Generator().manual_seed(0))
per = 8 // (world * args.accum)  # sequences a micro-step: the global batch is always 8
for step in range(args.steps):
    mine = data[step, rank::world]  # every world-th sequence of the step's batch is mine
    for micro in range(args.accum):
        xy = mine[micro * per:(micro + 1) * per]
        if ddp:
            sync = micro == 0 if args.sync_first else micro == args.accum - 1
            model.require_backward_grad_sync = sync
        with ctx:
            loss = model(xy[:, :-1], xy[:, 1:])
            if not args.no_div:
                loss = loss / args.accum
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}")
"""

RUNS_ON_ONE_WORKER = pytest.mark.xdist_group("compare-fresh")


def _audit(script: str, *args: str, nproc: int, out: str, **flags):
    return check_audit(AuditOptions(script=(script, *args), nproc=nproc, out=out,
                                    console="none", **flags))  # fmt: skip


def fresh_runs(base: Path) -> dict:
    """The recordings, then every run against them (module docstring): name -> result."""
    script, out = base / "gpt.py", str(base / "runs")
    script.write_text(GPT)
    bf16, plain = str(base / "rec_bf16"), str(base / "rec_plain")
    gpt = str(script)
    with ThreadPoolExecutor(2) as pool:
        recorded = {
            "rec_bf16": pool.submit(_audit, gpt, "--accum", "4", "--bf16", nproc=1, out=out,
                                    record=bf16),
            "rec_plain": pool.submit(_audit, gpt, "--accum", "2", nproc=2, out=out,
                                     record=plain),
        }  # fmt: skip
        done = {k: f.result() for k, f in recorded.items()}
    against = {
        "bf16": (("--bf16",), bf16),
        "bf16_no_div": (("--bf16", "--no-div"), bf16),
        "zero": (("--zero",), plain),
        "zero_lr": (("--zero", "--nodecay-lr", "0.002"), plain),
        "diverged": (("--sync-first",), plain),
    }
    with ThreadPoolExecutor(3) as pool:
        futures = {
            k: pool.submit(_audit, gpt, "--accum", "2", *flags, nproc=2, out=out, against=rec)
            for k, (flags, rec) in against.items()
        }
        done |= {k: f.result() for k, f in futures.items()}
    return done


def problems_of(done: dict) -> list[str]:
    """What is wrong with the verdicts of `fresh_runs` (empty: none)."""
    problems = [f"{k}: {done[k].verdict}" for k in ("rec_bf16", "rec_plain")
                if done[k].verdict != "pass"]  # fmt: skip
    expected = {"bf16": ("pass", None), "bf16_no_div": ("fault", "loss"),
                "zero": ("pass", None), "zero_lr": ("fault", "param_groups[1].lr"),
                "diverged": ("fault", "wte.weight")}  # fmt: skip
    for k, (verdict, name) in expected.items():
        c = done[k].comparison
        first = c and c.first
        if done[k].verdict != verdict or c is None or (first.name if first else None) != name:
            problems.append(f"{k}: {done[k].verdict}, first departure {first}")
    c = done["zero"].comparison
    if c is not None and not c.bitwise:
        problems.append(f"zero: compared within a tolerance ({c.mode_reason}), not bitwise")
    return problems


def fresh_problems(base: Path) -> list[str]:
    """The module's verdicts, for the hog window (tests/test_load.py)."""
    base.mkdir(parents=True, exist_ok=True)
    return problems_of(fresh_runs(base))


@pytest.fixture(scope="session")
def fresh(tmp_path_factory):
    return fresh_runs(tmp_path_factory.mktemp("compare_fresh"))


@pytest.mark.under_load
@RUNS_ON_ONE_WORKER
def test_the_verdicts_hold_idle(fresh):
    assert not problems_of(fresh), "\n".join(problems_of(fresh))


@RUNS_ON_ONE_WORKER
def test_bf16_autocast_one_rank_against_two_agrees_within_bf16s_tolerance(fresh):
    """1 rank x 4 micro-steps against 2 x 2, the forward under bf16 autocast: the micro-
    batches hold other sequences, so each one's bf16 matmul outputs round differently;
    float32's tolerance (2.4e-4) calls that a departure at step 0, bfloat16's (4 x 2^-8 x
    sqrt(j + 1): tolerance.py) does not. The recording says it ran under autocast."""
    run = fresh["bf16"]
    c = run.comparison
    assert run.verdict == "pass", c.first
    assert "autocast to bfloat16 in both runs" in c.mode_reason
    manifest = json.loads((Path(run.options.against) / "manifest.json").read_text())
    assert manifest["autocast"] == ["bfloat16"]
    ratio, _, limit, _ = c.closest
    assert limit > 0.015 and ratio < 1


@RUNS_ON_ONE_WORKER
def test_a_loss_not_divided_under_autocast_departs_at_step_0_with_its_hint(fresh):
    """The bug is 2x the loss, far outside bfloat16's tolerance: caught, and its hint (by the
    departure's kind and numbers) says what to do, in the text and in --json."""
    run = fresh["bf16_no_div"]
    first = run.comparison.first
    assert run.verdict == "fault" and (first.step, first.name) == (0, "loss")
    assert first.numbers["micro_steps"] == 2
    assert "not divided by the accumulation steps" in first.hint
    assert f"  what it usually means: {first.hint}" in audit_text(run).splitlines()
    assert run.to_dict()["comparison"]["first"]["hint"] == first.hint


@RUNS_ON_ONE_WORKER
def test_zero_against_plain_adamw_agrees_bitwise_and_names_both_optimizers(fresh):
    """ZeroRedundancyOptimizer with a group added by add_param_group exposes that group with
    only the keys it was given until its first step: the settings read are the ones its
    local AdamW applies, so they equal plain AdamW's."""
    run = fresh["zero"]
    c = run.comparison
    assert run.verdict == "pass", c.first
    assert c.bitwise and c.compared_steps == 4
    note = "the optimizers differ: AdamW in the recording, ZeroRedundancyOptimizer over AdamW " \
           "in this run"  # fmt: skip
    assert note in c.notes and f"note: {note}" in audit_text(run).splitlines()


@RUNS_ON_ONE_WORKER
def test_zero_with_another_lr_in_its_added_group_departs_at_that_setting(fresh):
    first = fresh["zero_lr"].comparison.first
    assert fresh["zero_lr"].verdict == "fault"
    assert (first.step, first.name) == (0, "param_groups[1].lr")
    assert "0.001 in the recording, 0.002 in this run" in first.what


@RUNS_ON_ONE_WORKER
def test_a_run_whose_replicas_diverge_still_prints_its_comparison(fresh):
    """The buggy accumulation (the all-reduce at the first micro-step, not the last) against
    a recording of the fixed run: the audit's divergence, then the comparison, and the
    verdict is the divergence's (exit 1)."""
    run = fresh["diverged"]
    assert run.verdict == "fault" and run.comparison.departs
    lines = audit_text(run).splitlines()
    at = lines.index("REPLICAS DIVERGED: first at gradients before step 0 (AdamW)")
    rest = lines[at + 1 :]
    assert rest[0] == f"against {run.options.against}:"
    assert rest[1].startswith("aligned: from step 0") and rest[2].startswith("compared: bitwise")
    assert any(line.startswith("FIRST DEPARTURE: step 0, gradients before step 0") for line in rest)
    assert "verdict: fault: the replicas diverged (above), whatever the comparison found" in rest

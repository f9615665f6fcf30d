"""`python -m verify train`: end-to-end training, with each implementation's loss curve drawn
beside the single-process curve of the same data.

The data is a synthetic language the model can actually learn: sequences walked through a fixed
random Markov chain in which every token has `BRANCHING` possible successors, so the loss falls
from ln(vocab) towards ln(BRANCHING) (the chain's entropy, when successors are distinct).
Each rank reads its part of every epoch through `torch.utils.data.DistributedSampler` (one
shuffled permutation, rank r taking every N-th index from r), exactly as a real job splits data.

The single-process reference reads, at every step, the union of all ranks' batches of that
step, so it sees the same global batch; its mean loss is the mean of the ranks' mean losses
(equal local batches). A correct data-parallel implementation therefore follows the reference
curve up to float rounding (different summation order in the all-reduce), which grows slowly
over steps because training amplifies tiny differences: the report gives the largest gap.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from verify import runs
from verify.launching import RankContext, launch
from verify.perf import charts
from verify.training.workloads import GPT, GPTConfig

BRANCHING = 4
REFERENCE = "single process"


class MarkovText(Dataset):
    """`size` sequences of `seq_len + 1` tokens from a seeded random Markov chain."""

    def __init__(self, vocab: int, seq_len: int, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(vocab, (vocab, BRANCHING), generator=g)
        choice = torch.randint(BRANCHING, (size, seq_len), generator=g)
        tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (size,), generator=g)
        for t in range(seq_len):
            tokens[:, t + 1] = successors[tokens[:, t], choice[:, t]]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[i, :-1], self.tokens[i, 1:]


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    impls: tuple[str, ...] = ("bucketed",)
    world_size: int = 2
    steps: int = 200
    local_batch: int = 8
    model_size_m: float | None = None  # None: the tiny GPT (256 tokens, 2 layers, 64 wide)
    lr: float = 3e-3
    bucket_mb: float = 25.0
    examples: int = 8192
    seed: int = 0
    log_every: int = 25
    device: str | None = None
    out: str = runs.DEFAULT_OUT
    timeout_s: float = 3600.0
    progress: bool = False

    def __post_init__(self) -> None:
        from impls.registry import resolve

        for name in ("world_size", "steps", "local_batch", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.examples < self.world_size * self.local_batch:
            raise ValueError("examples must fill at least one global batch")
        for name in self.impls:
            resolve(name)

    @property
    def config(self) -> GPTConfig:
        return (
            GPTConfig() if self.model_size_m is None else GPTConfig.with_params(self.model_size_m)
        )


@dataclass(frozen=True)
class TrainResult:
    options: TrainOptions
    ok: bool
    losses: dict = field(default_factory=dict)  # name -> loss per step (global-batch mean)
    seconds: dict = field(default_factory=dict)  # name -> wall time of the training loop
    run_dir: str | None = None
    machine: str = ""
    failure: str | None = None
    notes: tuple[str, ...] = ()

    def max_gap(self, name: str) -> float:
        return max(abs(a - b) for a, b in zip(self.losses[name], self.losses[REFERENCE]))

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "options"}
        d["options"] = dataclasses.asdict(self.options)
        if self.ok:
            d["max_gap_to_single_process"] = {
                n: self.max_gap(n) for n in self.losses if n != REFERENCE
            }
        return d


def run_training(options: TrainOptions) -> TrainResult:
    device = options.device or runs.default_device(options.world_size)
    impls = options.impls
    name = "train-" + ("+".join(impls) if len(impls) <= 3 else f"{len(impls)}-impls")
    run_dir = runs.new_run_dir(options.out, name, options.world_size, device)
    meta = runs.write_metadata(run_dir, dataclasses.asdict(options))
    machine = runs.describe_machine(meta["machine"])
    backend = runs.backend_for(device)
    losses, seconds = {}, {}
    progress = runs.Progress(run_dir / "progress.log" if options.progress else None)
    for names, ws in [((REFERENCE,), 1), (options.impls, options.world_size)]:
        with runs.relay_progress(progress):
            run = launch(
                _rank_main,
                world_size=ws,
                args=(options, names, progress),
                timeout_s=options.timeout_s,
                backend=backend,
            )
        if not run.ok:
            return TrainResult(
                options, False, losses, seconds, str(run_dir), machine, run.summary()
            )
        for n, (curve, s) in run.values[0].items():
            losses[n], seconds[n] = curve, s
    result = TrainResult(options, True, losses, seconds, str(run_dir), machine)
    steps = list(range(1, options.steps + 1))
    chart = charts.loss_curves(run_dir / "loss.png", steps, losses, REFERENCE)
    result = dataclasses.replace(result, notes=tuple(n for n in [chart.note] if n))
    runs.write_json(run_dir / "train.json", result.to_dict())
    (run_dir / "train.txt").write_text(format_training(result) + "\n")
    return result


def _rank_main(ctx: RankContext, options: TrainOptions, names: tuple[str, ...], progress) -> dict:
    # The same thread budget per process in both launches (the launcher gives a lone rank
    # every core; OpenMP threads spinning on tiny GPT ops next to other load cost 10x).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // options.world_size))
    cfg = options.config
    data = MarkovText(cfg.vocab_size, cfg.block_size, options.examples, options.seed)
    out = {}
    for name in names:
        out[name] = _train(ctx, options, name, data, progress)
    return out


def _batches(ctx: RankContext, options: TrainOptions, data: Dataset, reference: bool):
    """Endless (inputs, targets) of this rank, or of all ranks concatenated (reference)."""
    ranks = range(options.world_size) if reference else [ctx.rank]
    samplers = [
        DistributedSampler(
            data,
            num_replicas=options.world_size,
            rank=r,
            shuffle=True,
            seed=options.seed,
            drop_last=True,
        )
        for r in ranks
    ]
    loaders = [
        DataLoader(data, batch_size=options.local_batch, sampler=s, drop_last=True)
        for s in samplers
    ]
    epoch = 0
    while True:
        for s in samplers:
            s.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for parts in zip(*loaders):
            yield (
                torch.cat([p[0] for p in parts]).to(ctx.device),
                torch.cat([p[1] for p in parts]).to(ctx.device),
            )
        epoch += 1


def _train(ctx: RankContext, options: TrainOptions, name: str, data: Dataset, progress):
    from impls.registry import resolve

    torch.manual_seed(options.seed)
    model = GPT(options.config)
    for module in model.modules():  # GPT-2's initialization: the loss starts near ln(vocab)
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                torch.nn.init.zeros_(module.bias)
    model = model.to(ctx.device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    reference = name == REFERENCE
    if reference:
        wrapped, optimizer = model, torch.optim.AdamW(groups, lr=options.lr)
    else:
        impl = resolve(name)
        wrapped = impl.wrap(model, bucket_size_mb=options.bucket_mb)
        optimizer = impl.make_optimizer(groups, torch.optim.AdamW, lr=options.lr)
    finish = getattr(wrapped, "finish_gradient_synchronization", None)
    on_start = getattr(wrapped, "on_train_batch_start", None)
    batches = _batches(ctx, options, data, reference)
    losses = []
    start = time.perf_counter()
    for step in range(1, options.steps + 1):
        inputs, targets = next(batches)
        optimizer.zero_grad(set_to_none=True)
        if on_start is not None:
            on_start()
        logits = wrapped(inputs)
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
        )
        loss.backward()
        if finish is not None:
            finish()
        optimizer.step()
        logged = loss.detach().clone()
        if ctx.world_size > 1:  # the global batch's mean loss: the mean of the ranks' means
            dist.all_reduce(logged)
            logged /= ctx.world_size
        losses.append(float(logged))
        if step % options.log_every == 0 or step == options.steps:
            rate = step / (time.perf_counter() - start)
            progress(
                f"train {name}: step {step}/{options.steps}  loss {losses[-1]:.4f}  "
                f"({rate:.1f} steps/s)",
                rank=ctx.rank,
            )
    return losses, time.perf_counter() - start


def format_training(result: TrainResult) -> str:
    from tabulate import tabulate

    o = result.options
    if not result.ok:
        return f"train failed:\n{result.failure}"
    tokens = o.world_size * o.local_batch * o.config.block_size
    rows = []
    for name, curve in result.losses.items():
        ref = name == REFERENCE
        rows.append(
            [
                name,
                1 if ref else o.world_size,
                f"{curve[0]:.4f}",
                f"{curve[-1]:.4f}",
                "-" if ref else f"{result.max_gap(name):.2e}",
                f"{o.steps / result.seconds[name]:.1f}",
                f"{o.steps * tokens / result.seconds[name]:.0f}",
            ]
        )
    headers = ["run", "ranks", "first loss", "final loss", "max |gap|", "steps/s", "tokens/s"]
    lines = [
        f"train: {', '.join(o.impls)} for {o.steps} steps, world size {o.world_size}, global "
        f"batch {o.world_size * o.local_batch} x {o.config.block_size} tokens, AdamW lr {o.lr:g}"
        f"; data: Markov chain, loss floor ln({BRANCHING}) = 1.386",
        f"machine: {result.machine}",
        "",
        tabulate(rows, headers=headers, disable_numparse=True),
        "",
        "max |gap| = largest difference from the single-process loss on the same global "
        "batches (float rounding; grows slowly as training amplifies it)",
        f"written to {result.run_dir} (loss.png: every curve beside the single-process one)",
    ]
    return "\n".join(lines + [f"note: {n}" for n in result.notes])

"""What the model's forward was given, per micro-step: the batch a recording keeps
(docs/compare.md, "The batch"), and how the ranks' batches make a step's global batch.

Which call is the batch's: the outermost module call (a forward that no other module's
forward is running around: DDP's or FSDP's wrapper, torch.compile's `OptimizedModule`, or
the model itself, whichever the script calls) of a module that holds a parameter requiring a
gradient, with gradients enabled. A loss module (no parameters) and an evaluation under
`no_grad` are not batches, nor a forward run again inside the backward (activation
checkpointing). Two global forward hooks count the nesting; the second, which
receives the keyword arguments, reads the inputs: every tensor among the positional and
keyword arguments, in lists, tuples and mappings, named as the call spells them (`args[0]`,
`kwargs['labels']`, `args[0]['input_ids']`). The n-th such call since optimizer 0's last
step is micro-step n of its next step.

What is kept of an input: the engine's fingerprint of each sample (its rows along dimension
0; a 0-dim tensor is one sample), computed on its device with no host sync at the forward,
and the whole input's sum and sum of squares (its sketch, one block: a union of the ranks'
inputs has no fixed blocks). At the audit point before optimizer 0's step (`take`), on the
host, the samples' fingerprints h_0 .. h_{n-1} become two numbers:

    ordered    sum_i h_i * P^i (64-bit, wrapping): the same samples in the same order
    unordered  sum_i h_i: the same samples in any order

Both compose over the ranks without the samples: a micro-step's global batch is the union of
the ranks' inputs in rank order, whose ordered number is the sum over ranks r of
P^(samples of the ranks before r) times rank r's, and whose unordered number is the sum of
the ranks' (`union`). A rank hands its inputs over as one row of `WORDS` words (`pack`),
whatever the batch size or the world size (the tool's collectives never depend on rank-local
shapes), in the recorder's one all-gather. At most `SLOTS` inputs a step are kept (the
micro-steps' inputs in order); the rest are counted (`dropped`).

The hooks read tensors and never write one; an error inside them stops the batch recording,
with the reason in the recording, and never reaches the script.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.modules import module as module_hooks

from verify.replica_audit.fingerprint import (
    bits_value,
    fingerprint_table,
    mixed,
    signed,
    text_bits,
    value_bits,
)

SLOTS = 32  # inputs kept a step, per rank
FIELDS = 8  # words per input: key code, micro-step, samples, numel, ordered, unordered, sums
WORDS = 2 + SLOTS * FIELDS  # the inputs kept, those dropped, then SLOTS x FIELDS
P = 0x100000001B3  # odd: the weight of one sample's position
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Input:
    """One input of one micro-step (module docstring): a rank's, or the union of the ranks'."""

    micro: int
    name: str
    dtype: str
    shape: tuple[int, ...]  # of one sample
    samples: int
    numel: int
    ordered: int  # signed 64-bit
    unordered: int
    total: float  # the sum of its elements
    square: float  # the sum of their squares

    @property
    def code(self) -> int:
        return text_bits(f"{self.name}|{self.dtype}|{self.shape}")


class BatchTap:
    """The global forward hooks (module docstring), from `install()` to `remove()`."""

    def __init__(self) -> None:
        self.depth = 0  # module forwards running, one inside another
        self.micro = 0  # micro-steps seen since the last `take`
        self.dropped = 0  # inputs seen beyond SLOTS a step, since the last `take`
        self.failed: str | None = None
        self.seconds = 0.0  # inside `_saw` and `take`, in all (the benchmark's figure)
        self._pending: list[tuple] = []  # (micro, name, tensor's facts, its device tensors)
        self._handles: list = []

    def install(self) -> None:
        # torch.compile(module) warns when global module hooks exist (these): their second
        # firing, inside the compiled forward, is skipped here (`is_compiling`), and a
        # warning the script did not cause must not appear in its output
        warnings.filterwarnings("ignore", message=r"Using `torch\.compile\(module\)` when there "
                                r"are global hooks on modules")  # fmt: skip
        if not self._handles:
            self._handles = [
                module_hooks.register_module_forward_pre_hook(self._enter),
                module_hooks.register_module_forward_hook(
                    self._exit, with_kwargs=True, always_call=True
                ),
            ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.depth = 0

    def _enter(self, module, args) -> None:
        if not torch.compiler.is_compiling():  # traced calls run inside an outer one
            self.depth += 1

    def _exit(self, module, args, *rest) -> None:
        """`rest`: (kwargs, output); (output) alone when the forward raised."""
        if torch.compiler.is_compiling():
            return
        self.depth = max(0, self.depth - 1)
        if self.depth or len(rest) != 2 or self.failed or not torch.is_grad_enabled():
            return
        if _in_backward():  # a checkpointed block's forward run again: not a micro-step
            return
        start = time.perf_counter()
        try:
            if any(p.requires_grad for p in module.parameters()):  # (stops at the first)
                self._saw(args, rest[0])
        except Exception as exc:  # the tap's own failure never becomes the script's
            self.failed = f"{type(exc).__name__}: {exc}"
        finally:
            self.seconds += time.perf_counter() - start

    def _saw(self, args, kwargs) -> None:
        for name, t in named_tensors(args, kwargs):
            if len(self._pending) >= SLOTS:
                self.dropped += 1
                continue
            x = t.detach()
            rows = [x] if x.dim() == 0 else list(x.unbind(0))
            prints = fingerprint_table(rows, x.device)  # stays on the device: no sync
            wide = torch.view_as_real(x) if x.is_complex() else x
            wide = wide if wide.is_floating_point() else wide.to(torch.float64)
            norm = torch.linalg.vector_norm(wide, dtype=torch.float64)
            sums = torch.stack([wide.sum(dtype=torch.float64), norm.square()])
            shape = tuple(x.shape[1:]) if x.dim() else ()
            facts = (str(x.dtype).removeprefix("torch."), shape, len(rows), x.numel())
            self._pending.append((self.micro, name, facts, prints, sums))
        self.micro += 1

    def take(self) -> tuple[list[Input], int]:
        """This rank's inputs since the last take (module docstring), and how many more were
        dropped; starts the next step's."""
        start = time.perf_counter()
        pending, dropped = self._pending, self.dropped
        self._pending, self.micro, self.dropped = [], 0, 0
        inputs = [_input(*p) for p in pending]
        self.seconds += time.perf_counter() - start
        return inputs, dropped


def _in_backward() -> bool:
    """Whether this thread runs inside autograd's backward (where activation checkpointing
    runs a module's forward again, outside any other module's)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def named_tensors(args, kwargs) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a call's arguments, named as the call spells it (module docstring)."""
    for i, a in enumerate(args):
        yield from _within(f"args[{i}]", a, 3)
    for k, a in (kwargs or {}).items():
        yield from _within(f"kwargs[{k!r}]", a, 3)


def _within(name: str, value, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif depth and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _within(f"{name}[{i}]", v, depth - 1)
    elif depth and isinstance(value, Mapping):  # a dict, or HF's BatchEncoding
        for k, v in value.items():
            yield from _within(f"{name}[{k!r}]", v, depth - 1)


def _input(micro: int, name: str, facts: tuple, prints: torch.Tensor, sums) -> Input:
    """One pending input on the host: its samples' fingerprints as two numbers."""
    dtype, shape, samples, numel = facts
    ordered = unordered = 0
    weight = 1
    for code, total, weighted in prints.cpu().tolist():
        h = mixed(code, total, weighted)
        ordered = (ordered + h * weight) & _MASK
        unordered = (unordered + h) & _MASK
        weight = (weight * P) & _MASK
    total, square = sums.cpu().tolist()
    return Input(micro, name, dtype, shape, samples, numel, signed(ordered), signed(unordered),
                 total, square)  # fmt: skip


def pack(inputs: list[Input], dropped: int) -> torch.Tensor:
    """A rank's inputs of one step as `WORDS` int64 words (module docstring)."""
    words = np.zeros(WORDS, dtype=np.int64)
    kept = inputs[:SLOTS]
    words[0], words[1] = len(kept), dropped + len(inputs) - len(kept)
    for j, x in enumerate(kept):
        words[2 + j * FIELDS : 2 + (j + 1) * FIELDS] = [
            x.code, x.micro, x.samples, x.numel, x.ordered, x.unordered,
            value_bits(x.total), value_bits(x.square),
        ]  # fmt: skip
    return torch.from_numpy(words)


def union(mine: list[Input], packed: list[torch.Tensor]) -> tuple[list[Input], int]:
    """The global batch of a step (module docstring) from every rank's `pack` (in rank
    order), named after `mine` (the owner's own inputs, which are rank 0's); and the inputs
    dropped on any rank. An input some rank holds under another name, dtype or sample shape
    is folded in with its code, so that it compares as other samples."""
    rows = [p.numpy().astype(np.int64) for p in packed]
    dropped = sum(int(r[1]) for r in rows)
    out = []
    for j, x in enumerate(mine[:SLOTS]):
        ordered = unordered = samples = numel = 0
        total = square = 0.0
        for r in rows:
            if j >= r[0]:
                continue
            code, _, n, elements, o, u, t, s = (int(v) for v in r[2 + j * FIELDS :][:FIELDS])
            odd = 0 if code == x.code else code
            ordered = (ordered + pow(P, samples, 1 << 64) * (o ^ odd)) & _MASK
            unordered = (unordered + (u ^ odd)) & _MASK
            samples, numel = samples + n, numel + elements
            total, square = total + bits_value(t), square + bits_value(s)
        out.append(Input(x.micro, x.name, x.dtype, x.shape, samples, numel, signed(ordered),
                         signed(unordered), total, square))  # fmt: skip
    dropped += sum(max(0, int(r[0]) - len(out)) for r in rows)
    return out, dropped

"""What a finding usually means, and what to do: one hint line under a finding.

A finding names the place (step, tensor, rank, source line); the symptom table of
docs/course-students.md knows the usual causes. `hint(text, situation)` maps the text of a
finding (or of a failed run's diagnosis) and the situation it was seen in to that cause and its
fix, or None when the pattern is not one the catalogue (`impls/faulty/`) knows. Pure: text in,
text out, so it is tested on every catalogue fault's real output (tests/test_faulty.py) and
the checks stay free of guesses: a hint never changes a verdict.

The scale patterns are exact arithmetic, not guesses: a gradient that was summed and never
divided is N times the average, so its error relative to max |reference| is N-1 on every
element (0 at one rank); divided twice it is 1/N of it (error 1-1/N); divided by a hard-coded
2 it is N/2 of it (error |N/2-1|); never reduced and zeroed, it is 0 (error 1). The world size
tells them apart, except "not divided" from "zeroed" at two ranks: both are named then.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SCALE = re.compile(r"step (\d+) gradients: .*?max \|err\| \S+ \(([0-9.e+-]+) of max \|reference\|")
_PARAMS_AT = re.compile(r"step (\d+) parameters: ")
_GRADS_AT = re.compile(r"step (\d+) gradients: ")
# within 1% of the predicted ratio: rounding of float32 sums is orders of magnitude below it
_SCALE_RTOL = 0.01


@dataclass(frozen=True)
class Situation:
    """What the run that produced a finding did, as far as the hint needs it."""

    world_size: int
    scheduler: bool = False
    round_trip_step: int | None = None
    model_round_trip: bool = False  # the round trip loads the model too, into a fresh wrapper
    accumulate: int = 1
    several_buckets: bool = False
    add_param_group: bool = False
    uneven_shards: bool = False  # parameters whose rows the world size does not divide


def situation_of(options) -> Situation:
    """From a check's options or a matrix behaviour (duck-typed: both name these fields)."""
    round_trip = getattr(options, "round_trip_step", None)
    if round_trip is None and getattr(options, "round_trip", False):
        round_trip = max(1, getattr(options, "steps", 2) // 2)
    return Situation(
        world_size=getattr(options, "ranks", None) or getattr(options, "world_size", None) or 2,
        scheduler=bool(getattr(options, "scheduler", False)),
        round_trip_step=round_trip,
        model_round_trip=bool(getattr(options, "round_trip_model", False)),
        accumulate=getattr(options, "accumulate", 1) or 1,
        several_buckets=getattr(options, "key", "") == "several-buckets",
        uneven_shards=getattr(options, "key", "") == "odd-sizes",
        add_param_group=bool(getattr(options, "add_param_group", False)),
    )


def hint(text: str, situation: Situation) -> str | None:
    """One line, "hint: <cause>: <fix>", for the first pattern `text` shows, or None.

    Races come first: a gradient divided before its all-reduce finished also reads as
    "not divided", and the race is the cause."""
    for rule in _RULES:
        line = rule(text, situation)
        if line:
            return f"hint: {line}"
    return None


def _plain(pattern: str, line: str):
    """A rule that says `line` when `pattern` (a regex) is found in the text."""
    compiled = re.compile(pattern)
    return lambda text, s: line if compiled.search(text) else None


_never_waited = _plain(
    r"was never waited on",
    "an async collective was never waited on: keep every handle an async_op=True call returns "
    "and call handle.wait() on each (in finish_gradient_synchronization() for gradients, in "
    "step() for parameter broadcasts) before the tensor is used",
)
_not_sharded = _plain(
    r"state kept on several ranks",
    "every rank keeps optimizer state for every parameter: give the inner optimizer only this "
    "rank's partition",
)
_params_not_sharded = _plain(
    r"parameters per rank / unsharded: [^;]*: not sharded",
    "every rank holds every parameter whole: replace each module parameter with this rank's "
    "shard (the optimizer, built over module.parameters(), then keeps 1/N of the state) and "
    "gather the full tensors only around the forward and backward that use them",
)
_grads_not_sharded = _plain(
    r"gradients per rank / unsharded: [^;]*: not sharded",
    "every rank keeps every gradient: after the reduce-scatter keep only this rank's shard "
    "of each gradient (set .grad to None, or to the shard, for the rest)",
)
_state_dict = _plain(
    r"state_dict\(\) (raised|returned)|state_dict round trip",
    "the optimizer's state_dict() / load_state_dict() failed: state_dict() must return the "
    "whole state (every parameter's, gathered from the shards) or only this rank's "
    "parameters, and load_state_dict() must accept what it returned",
)
_unused_everywhere = _plain(
    r"has a gradient, the reference's is None",
    "a parameter no rank used got a gradient (zeros): one process leaves its .grad None and "
    "the optimizer skips it; all-reduce only gradients that exist on some rank",
)
_unused_here = _plain(
    r"gradient is None, the reference has one",
    "a parameter used on another rank has no gradient here: all-reduce a zero gradient for a "
    "parameter this rank did not use, so it receives the others' contribution",
)
_not_reduced = _plain(
    r"step \d+ gradients: grad:\S+ differs",
    "gradients still differ across ranks after finish_gradient_synchronization(): some were "
    "not all-reduced: a bucket never launched (the last, partly filled bucket must be flushed "
    "too), or a hook that reduced the parameter rather than its .grad",
)
_params_not_synced = _plain(
    r"step \d+: param:\S+ differs",
    "parameters differ after optimizer.step() though the gradients agreed: a sharded optimizer "
    "must broadcast each updated parameter from the rank that owns it (and wait() on that "
    "broadcast)",
)


_empty_inner = _plain(
    r"optimizer got an empty parameter list",
    "a rank that owns no parameter (more ranks than parameters) built its inner optimizer "
    "from an empty list: skip the inner optimizer on such a rank; it must still take part in "
    "every collective",
)
_some_ranks_raised = _plain(
    r"only ranks? [\d, ]+ raised",
    "the class behaved differently on some ranks: whatever depends on the rank (what it owns, "
    "an if on dist.get_rank()) must still leave every rank constructing and communicating "
    "alike",
)
_state_on_some = _plain(
    r"optim:\S+ differs on ranks? [\d, ]+ \(vs rank \d+\): held on",
    "optimizer state exists on some ranks only: a parameter had a gradient on some ranks and "
    "None on others, so only they stepped it: assign the all-reduced gradient (zeros where "
    "this rank had none) back to .grad on every rank",
)
_freed_parameter = _plain(
    r"storage of size 0",
    "a parameter was used after its storage was freed: a ZeRO-3/FSDP unit must be gathered "
    "again before its backward (and before the next forward), not only before its first "
    "forward",
)

_layout = _plain(
    r"shards of \S+ overlap|held by no rank|shard of \S+ differs from rows|claims rows",
    "the shards do not partition the parameter: every row must be held by exactly one rank, "
    "where shard_rows() (or the DTensor placement) says it is (torch.chunk's blocks: ceil(n/N) "
    "rows a rank, fewer on the last), and a shard's first rows must be those rows of the full "
    "tensor (cut after the broadcast, stepped in place by the optimizer)",
)


def _in_flight(text: str, s: Situation) -> str | None:
    if "was in flight" not in text:
        return None
    if re.search(r"`(lerp_|addcmul_|add_|mul_|addcdiv_)` read \S+\.grad", text):
        return (
            "the optimizer read a gradient whose all-reduce was still running: "
            "finish_gradient_synchronization() must wait() on every handle before it returns"
        )
    if "`div_` wrote" in text or "`mul_` wrote" in text:
        return (
            "a gradient was divided while its all-reduce was still running, and the "
            "all-reduce overwrote the result: divide after handle.wait()"
        )
    if "`copy_` wrote" in text:
        return (
            "a buffer was refilled while the all-reduce sending it was still running: give "
            "each bucket its own buffer, or wait() before reusing it"
        )
    return "a tensor was used while an async collective on it was running: wait() first"


def _arrival_order(text: str, s: Situation) -> str | None:
    mismatch = ("extra all_reduce", "size mismatch", "shape mismatch")
    if not any(m in text for m in mismatch) or "all_reduce" not in text:
        return None
    return (
        "the ranks issued different all-reduces at the same position: launched in the order "
        "gradients arrive, they differ when a parameter gets no gradient on one rank or "
        "gradients arrive in another order; launch in an order fixed at construction, and "
        "all-reduce a zero gradient for a parameter this rank did not use"
    )


def _not_broadcast(text: str, s: Situation) -> str | None:
    at_construction = text.lstrip().startswith(("construction", "FAULT: construction"))
    if "not broadcast from rank 0" not in text and not (at_construction and "differs" in text):
        return None
    if "buffer:" in text:
        which = "the buffers from rank 0 too (dist.broadcast(b.data, src=0) for b in buffers())"
    else:
        which = (
            "every parameter from rank 0, frozen ones too (dist.broadcast(p.data, src=0) for p "
            "in module.parameters()), and every buffer"
        )
    return (
        f"the replicas start from different values: in __init__ broadcast {which}; a design "
        "that seeds every rank alike runs with --same-init"
    )


def _scale(text: str, s: Situation) -> str | None:
    """Gradients off by exactly the factor of a wrong division (module docstring)."""
    m = _SCALE.search(text)
    if not m or int(m.group(1)) != _first_step(text, _GRADS_AT):
        return None
    rel, n = float(m.group(2)), s.world_size
    causes = [
        (n - 1, f"gradients are {n} times the average: summed over the {n} ranks and never "
         "divided by the world size; divide by dist.get_world_size() after the all-reduce"),
        (1 - 1 / n, f"gradients are 1/{n} of the average: divided by the world size twice "
         "(before and after the all-reduce, or once in the hook and again after wait())"),
        (abs(n / 2 - 1), f"gradients are {n}/2 times the average: divided by a hard-coded 2, "
         "not by the world size; divide by dist.get_world_size()"),
        (1, "gradients are zero where the average is not: never all-reduced (a bucket "
         "skipped); every rank must send every bucket, zeros for unused parameters"),
    ]  # fmt: skip
    found = [line for want, line in causes if want > 0 and abs(rel - want) <= _SCALE_RTOL * want]
    return "; or ".join(found) or None


def _uneven_tail(text: str, s: Situation) -> str | None:
    """Gradients wrong where row shards are uneven (no exact scale factor: `_scale` first)."""
    if not s.uneven_shards or _first_step(text, _GRADS_AT) is None:
        return None
    return (
        "gradients are wrong where the world size does not divide a parameter's rows; if "
        "the class passes where it divides them all (world-2, world-4), the rows in the "
        "shard that also holds the padding were lost or misplaced: pad the gradient to "
        "N x ceil(rows / N) rows and send every chunk, the partial one too, and unpad by "
        "dropping only the padded rows"
    )


def _step_diverged(text: str, s: Situation) -> str | None:
    """Parameters wrong while the gradients were right: the optimizer, not the DDP."""
    step = _first_step(text, _PARAMS_AT)
    if step is None or (_first_step(text, _GRADS_AT) or step + 1) <= step:
        return None
    causes = []
    if s.round_trip_step is not None and step == s.round_trip_step + 1:
        causes.append(
            f"the state_dict() round trip after step {s.round_trip_step} lost state: "
            "state_dict() must hold every parameter's state (gather the shards), not only "
            "this rank's, or list only this rank's parameters"
        )
    if s.scheduler and step >= 2:
        causes.append(
            "the scheduler's lr never reached the inner optimizer: copy each global group's "
            "hyper-parameters (lr, weight_decay) to the inner optimizer's groups before its "
            "step()"
        )
    if s.add_param_group:
        causes.append(
            "a group added by add_param_group() after construction is never stepped: "
            "partition its parameters and give them to the inner optimizer"
        )
    if not causes:
        causes.append(
            "per-group hyper-parameters (lr, weight_decay) were lost or a group was not "
            "stepped: each parameter group must keep its own options"
        )
    head = f"gradients were right but the step {step} update was not, so the optimizer is wrong"
    return f"{head}: " + "; or ".join(causes)


def _model_reloaded(text: str, s: Situation) -> str | None:
    """Gradients right until the model was reloaded, wrong from the step after: the load (a
    lost optimizer state leaves the gradients right: `_step_diverged`)."""
    if not s.model_round_trip or s.round_trip_step is None:
        return None
    if _first_step(text, _GRADS_AT) != s.round_trip_step + 1:
        return None
    return (
        f"gradients were right until the model's state_dict() round trip after step "
        f"{s.round_trip_step}: "
        "load_state_dict() must put every value back where state_dict() took it from: from "
        "a full checkpoint each rank keeps its own rows (rows [r x ceil(n/N), (r+1) x "
        "ceil(n/N)) on rank r), from a per-rank one each rank loads its own shard"
    )


def _carried_over(text: str, s: Situation) -> str | None:
    """Right at the first step, wrong from a later one: state left from a previous step."""
    step = _first_step(text, _GRADS_AT)
    if step is None or step < 2:
        return None
    return (
        f"gradients were right until step {step}: something carried over from the step "
        "before: a list of handles (or of reduced gradients) never cleared, a zero_grad() "
        "that clears only some gradients, or (parameters sharded) a rank computing with "
        "parameters it gathered at an earlier step: gather the updated shards before every "
        "forward"
    )


def _accumulation_or_buckets(text: str, s: Situation) -> str | None:
    if _first_step(text, _GRADS_AT) is None:
        return None
    if s.accumulate > 1:
        return (
            "with no_sync() accumulation, a gradient was all-reduced before the last "
            "micro-batch or not at all: a bucket is ready when each member's hook fired in "
            "this backward, not when its .grad is not None; or (parameters sharded) the "
            "earlier micro-batches' gradients sit on full parameters a later forward "
            "replaced: gather into the same tensors every time, so gradients accumulate there"
        )
    if s.several_buckets:
        return (
            "with several parameters per bucket, a bucket was launched before all of its "
            "gradients were ready: count the members that are ready, do not assume an order"
        )
    return None


def _first_step(text: str, pattern: re.Pattern) -> int | None:
    steps = [int(m.group(1)) for m in pattern.finditer(text)]
    return min(steps) if steps else None


_RULES = (
    _never_waited,
    _in_flight,
    _empty_inner,
    _some_ranks_raised,
    _state_on_some,
    _freed_parameter,
    _arrival_order,
    _layout,
    _not_broadcast,
    _not_sharded,
    _params_not_sharded,
    _grads_not_sharded,
    _state_dict,
    _unused_everywhere,
    _unused_here,
    _scale,
    _not_reduced,
    _params_not_synced,
    _uneven_tail,
    _accumulation_or_buckets,
    _model_reloaded,
    _carried_over,
    _step_diverged,
)

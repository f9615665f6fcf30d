"""What a finding usually means, and what to do: one hint under a finding, chosen from what
was measured.

A finding (`verdict.Finding`) carries its `kind` (`kinds.py`) and its measured `numbers`;
`HINTS` maps each kind to a rule that reads those numbers and the situation the run was in
(world size, accumulation, round trip: `Situation`) and gives the usual cause and its fix,
or None when the measurement points at no cause the catalogue (`impls/faulty/`) knows. No
rule reads a message: a message can be reworded without moving a hint. The text reports and
`--json` show the same hint (`with_hints` stores it on the finding). A hint never changes a
verdict. Every catalogue fault's hint is asserted on real output (tests/test_faulty.py).

A departure of `compare` from a recording (`recording/departure.py`) is looked up the same
way, by its kind and numbers.

The numeric rules (scales, steps, which ranks) live in `rules.py`, and the script
audit's part of the table (keyed by its findings' phases) in `script_audit.py`; this module
holds the situation, the table and the rules that need only the kind.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from verify.hints import kinds as k
from verify.hints import rules


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
    raced: bool = False  # the sanitizer found a race in this run (set by `with_hints`)


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


def hint_for(finding, situation: Situation) -> str | None:
    """The cause and fix for `finding` (by its kind and numbers), or None."""
    rule = HINTS.get(finding.kind)
    return rule(finding.numbers, situation) if rule is not None else None


def with_hints(findings, situation: Situation) -> tuple:
    """`findings`, each with its `hint` set (what the text reports and `--json` show). Where
    some are races, the run raced (`Situation.raced`): replicas that part afterwards are its
    after-effect, and their hint says so rather than guess a cause of their own."""
    findings = tuple(findings)
    if any(f.kind in RACES for f in findings):
        situation = replace(situation, raced=True)
    return tuple(replace(f, hint=hint_for(f, situation)) for f in findings)


def first_hint(findings) -> str | None:
    """The first hint among `findings` (in report order: a race before what it broke)."""
    return next((f.hint for f in findings if f.hint), None)


RACES = (k.READ_IN_FLIGHT, k.WRITE_IN_FLIGHT, k.NEVER_WAITED)


def _say(line: str):
    """A rule for a kind whose measurement needs no number to name its cause."""
    return lambda numbers, situation: line


def _not_broadcast(n: dict, s: Situation) -> str:
    if n.get("buffers_only"):
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


def _parameters_differ(n: dict, s: Situation) -> str | None:
    if n.get("phase") != "step":  # after a round trip: the load, judged by equivalence
        return None
    return (
        "parameters differ after optimizer.step() though the gradients agreed: a sharded "
        "optimizer must broadcast each updated parameter from the rank that owns it (and "
        "wait() on that broadcast)"
    )


def _race(n: dict, s: Situation) -> str:
    """A read or a write of memory an async collective held: the operator says which."""
    op, grad = n.get("op", ""), n.get("gradient", False)
    if n.get("access") == "read" and grad and op in rules.OPTIMIZER_OPS:
        return (
            "the optimizer read a gradient whose all-reduce was still running: "
            "finish_gradient_synchronization() must wait() on every handle before it returns"
        )
    if n.get("access") == "write" and op in ("div_", "mul_"):
        return (
            "a gradient was divided while its all-reduce was still running, and the "
            "all-reduce overwrote the result: divide after handle.wait()"
        )
    if n.get("access") == "write" and op == "copy_":
        return (
            "a buffer was refilled while the all-reduce sending it was still running: give "
            "each bucket its own buffer, or wait() before reusing it"
        )
    return "a tensor was used while an async collective on it was running: wait() first"


def _not_sharded(n: dict, s: Situation) -> str | None:
    if n.get("what") == "parameters":
        return (
            "every rank holds every parameter whole: replace each module parameter with this "
            "rank's shard (the optimizer, built over module.parameters(), then keeps 1/N of the "
            "state) and gather the full tensors only around the forward and backward that use them"
        )
    if n.get("what") == "gradients":
        return (
            "every rank keeps every gradient: after the reduce-scatter keep only this rank's "
            "shard of each gradient (set .grad to None, or to the shard, for the rest)"
        )
    return None


HINTS = {
    k.NOT_BROADCAST: _not_broadcast,
    k.GRADIENTS_DIFFER: rules.gradients_differ,
    k.PARAMETERS_DIFFER: _parameters_differ,
    k.STATE_ON_SOME: _say(
        "optimizer state exists on some ranks only: a parameter had a gradient on some ranks "
        "and None on others, so only they stepped it: assign the all-reduced gradient (zeros "
        "where this rank had none) back to .grad on every rank"
    ),
    k.VALUES_MOVED: _say(
        "the values changed while the audit read them: a collective on them was still in "
        "flight (a race on an async collective): wait() on every handle before the tensor is "
        "read or changed; run with the sanitizer (the default, unless --no-sanitize) to name "
        "the line"
    ),
    k.LAYOUT: _say(
        "the shards do not partition the parameter: every row must be held by exactly one "
        "rank, where shard_rows() (or the DTensor placement) says it is (torch.chunk's blocks: "
        "ceil(n/N) rows a rank, fewer on the last), and a shard's first rows must be those rows "
        "of the full tensor (cut after the broadcast, stepped in place by the optimizer)"
    ),
    k.GRADIENTS_DIVERGE: rules.gradients_diverge,
    k.PARAMETERS_DIVERGE: rules.parameters_diverge,
    k.GRAD_NOT_IN_REFERENCE: _say(
        "a parameter no rank used got a gradient (zeros): one process leaves its .grad None "
        "and the optimizer skips it; all-reduce only gradients that exist on some rank"
    ),
    k.NO_GRAD_HERE: _say(
        "a parameter used on another rank has no gradient here: all-reduce a zero gradient for "
        "a parameter this rank did not use, so it receives the others' contribution"
    ),
    k.ROUND_TRIP_RAISED: _say(rules.STATE_DICT),
    k.RAISED_ON_SOME: rules.raised_on_some,
    k.RAISED: rules.raised,
    k.COLLECTIVE_MISMATCH: rules.collective_mismatch,
    k.HANG: rules.hang,
    k.NEVER_WAITED: _say(
        "an async collective was never waited on: keep every handle an async_op=True call "
        "returns and call handle.wait() on each (in finish_gradient_synchronization() for "
        "gradients, in step() for parameter broadcasts) before the tensor is used"
    ),
    k.READ_IN_FLIGHT: _race,
    k.WRITE_IN_FLIGHT: _race,
    k.STATE_NOT_SHARDED: _say(
        "every rank keeps optimizer state for every parameter: give the inner optimizer only "
        "this rank's partition"
    ),
    k.STATE_COPIED: _say(
        "a copy of the rank's own state outlives its use: keep one reference to each state "
        "tensor (a load_state_dict that copies the loaded state into the inner optimizer and "
        "into the wrapper's own .state leaves two; PyTorch's ZeroRedundancyOptimizer does this "
        "when the parameters are on a GPU and the loaded tensors on the CPU)"
    ),
    k.NOT_SHARDED: _not_sharded,
    k.LOSS_DEPARTS: rules.loss_departs,
    k.PARAMETERS_DEPART: rules.parameters_depart,
    k.SETTING_DEPARTS: rules.setting_departs,
}

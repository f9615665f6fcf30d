"""The hint rules that read numbers: scales, steps and which ranks (the table: `table.py`).

Each rule takes a finding's `numbers` (what its check measured) and the run's `Situation`,
and returns the usual cause and fix, or None.

The scales are exact arithmetic, not guesses. Each check fits the factor c with which a
wrong gradient is a multiple of the right one, and keeps it only where the fit is exact to
rounding in every tensor of the finding (`reference.compare`, the replica audit's `compare`).
Summed and never divided, a gradient is N times the average (c = N); divided twice, 1/N;
divided by a hard-coded 2, N/2; never reduced and zeroed, 0. A factor on some ranks only,
the same in every tensor, is a scaling done on those ranks alone: a gradient clipping (one
norm over every tensor) under `if rank == 0:`.
"""

from __future__ import annotations

# within 1% of the predicted factor: rounding of float32 sums is orders of magnitude below it
SCALE_RTOL = 0.01
#: operators through which an optimizer reads a gradient
OPTIMIZER_OPS = ("lerp_", "addcmul_", "add_", "mul_", "addcdiv_")

NOT_REDUCED = (
    "gradients still differ across ranks after finish_gradient_synchronization(): some were "
    "not all-reduced: a bucket never launched (the last, partly filled bucket must be flushed "
    "too), or a hook that reduced the parameter rather than its .grad"
)
AFTER_RACE = (
    "the gradients differ because of the races above: an all-reduce was still running when "
    "its gradient was read or stepped, so each rank used what it held then: wait() on every "
    "handle before finish_gradient_synchronization() returns (not at the next batch)"
)
FROZEN_BUCKET = (
    "a bucket never launched: a frozen or unused parameter's hook never fires, so its bucket "
    "never fills: plan buckets over the parameters that require grad only (or launch what is "
    "pending once backward ends); or the last, partly filled bucket was never flushed"
)
STATE_DICT = (
    "the optimizer's state_dict() / load_state_dict() failed: state_dict() must return the "
    "whole state (every parameter's, gathered from the shards) or only this rank's "
    "parameters, and load_state_dict() must accept what it returned"
)


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def scaled_on_some(scaled, others, factor: float) -> str:
    """The hint for gradients that are `factor` x the others' on the `scaled` ranks only."""
    return (
        f"the gradients on {_ranks(scaled)} are {factor:.3g} x those on {_ranks(others)}, the "
        "same factor in every tensor: they were scaled on some ranks only, as gradient "
        "clipping (clip_grad_norm_) or a loss scale applied on one rank (under `if rank == 0:`) "
        "does: clip on every rank, after the all-reduce, so every rank clips the same "
        "averaged gradients alike"
    )


def gradients_differ(n: dict, s) -> str:
    """Consistency: gradients not bitwise equal across ranks after the synchronization.
    numbers: `scale` (the differing ranks' gradients as a multiple of the reference rank's,
    one factor in every tensor, or None), `ranks`, `reference_rank`, `frozen` (the model's
    parameters that require no grad)."""
    c = n.get("scale")
    if c is None or c == 1 or c == 0:  # (zeros: not a scaling, nothing arrived there)
        return _not_reduced(n, s)
    differ, ref = n.get("ranks", ()), [n.get("reference_rank", 0)]
    # Clipping only shrinks: name the ranks whose gradients are the smaller.
    return scaled_on_some(differ, ref, c) if c < 1 else scaled_on_some(ref, differ, 1 / c)


def _not_reduced(n: dict, s) -> str:
    """Gradients some ranks never reduced: after a race, its effect; with parameters that
    require no grad (numbers: `frozen`), the bucket one of them is planned into."""
    if s.raced:
        return AFTER_RACE
    return FROZEN_BUCKET if n.get("frozen") else NOT_REDUCED


def _scale_causes(c: float, n: int) -> str | None:
    """Gradients off by exactly the factor of a wrong division (module docstring)."""
    causes = [
        (n, f"gradients are {n} times the average: summed over the {n} ranks and never "
         "divided by the world size; divide by dist.get_world_size() after the all-reduce"),
        (1 / n, f"gradients are 1/{n} of the average: divided by the world size twice "
         "(before and after the all-reduce, or once in the hook and again after wait())"),
        (n / 2, f"gradients are {n}/2 times the average: divided by a hard-coded 2, "
         "not by the world size; divide by dist.get_world_size()"),
    ]  # fmt: skip
    if c == 0:
        return (
            "gradients are zero where the average is not: never all-reduced (a bucket "
            "skipped); every rank must send every bucket, zeros for unused parameters"
        )
    found = [line for want, line in causes if want != 1 and abs(c - want) <= SCALE_RTOL * want]
    return "; or ".join(found) or None


def gradients_diverge(n: dict, s) -> str | None:
    """Equivalence: gradients off the one-process average. numbers: `step`,
    `first_gradient_step` (the run's first gradient divergence), `scale` (the wrong ranks'
    gradients as one multiple of the average in every tensor, or None), `ranks_off` (the
    ranks over tolerance), `world_size`, `ranks_agree` (every rank holds the same bits)."""
    step, first = n.get("step", 1), n.get("first_gradient_step", n.get("step", 1))
    c, off = n.get("scale"), list(n.get("ranks_off", ()))
    world = n.get("world_size", s.world_size)
    if c is not None and c != 1 and 0 < len(off) < world:
        right = [r for r in range(world) if r not in off]  # the reference says which are
        return scaled_on_some(off, right, c)
    if c is not None and n.get("ranks_agree", True):
        line = _scale_causes(c, s.world_size)
        if line:
            return line
    if s.uneven_shards:
        return (
            "gradients are wrong where the world size does not divide a parameter's rows; if "
            "the class passes where it divides them all (world-2, world-4), the rows in the "
            "shard that also holds the padding were lost or misplaced: pad the gradient to "
            "N x ceil(rows / N) rows and send every chunk, the partial one too, and unpad by "
            "dropping only the padded rows"
        )
    if s.accumulate > 1:
        return (
            "with no_sync() accumulation, a gradient was all-reduced before the last "
            "micro-batch or not at all: a bucket is ready when each member's hook fired in "
            "this backward, not when its .grad is not None; or (parameters sharded) the "
            "earlier micro-batches' gradients sit on full parameters a later forward "
            "replaced: gather into the same tensors every time, so gradients accumulate there"
        )
    if step != first:  # an echo of an earlier divergence (the ranks' replicas parted there)
        return None
    if step == 1 and not n.get("ranks_agree", True):
        return _not_reduced(n, s)  # the ranks hold different gradients: some never met
    if s.several_buckets:
        return (
            "with several parameters per bucket, a bucket was launched before all of its "
            "gradients were ready: count the members that are ready, do not assume an order"
        )
    if s.model_round_trip and s.round_trip_step is not None and step == s.round_trip_step + 1:
        return (
            f"gradients were right until the model's state_dict() round trip after step "
            f"{s.round_trip_step}: load_state_dict() must put every value back where "
            "state_dict() took it from: from a full checkpoint each rank keeps its own rows "
            "(rows [r x ceil(n/N), (r+1) x ceil(n/N)) on rank r), from a per-rank one each "
            "rank loads its own shard"
        )
    if step >= 2:
        return (
            f"gradients were right until step {step}: something carried over from the step "
            "before: a list of handles (or of reduced gradients) never cleared, a zero_grad() "
            "that clears only some gradients, or (parameters sharded) a rank computing with "
            "parameters it gathered at an earlier step: gather the updated shards before "
            "every forward"
        )
    return None


def parameters_diverge(n: dict, s) -> str | None:
    """Equivalence: parameters wrong after a step whose gradients were right (numbers:
    `step`, `first_gradient_step`, None when no gradient diverged): the optimizer."""
    step, grads = n.get("step", 1), n.get("first_gradient_step")
    if grads is not None and grads <= step:
        return None
    causes = []
    if s.round_trip_step is not None and step == s.round_trip_step + 1:
        causes.append(
            f"the state_dict() round trip after step {s.round_trip_step} lost state: "
            "state_dict() must hold every parameter's state (gather the shards), not only "
            "this rank's, or list only this rank's parameters"
        )
    # The first step after a reload runs with the rate the checkpoint holds; from the next,
    # with the first one the scheduler set after the reload.
    rt = s.round_trip_step
    if s.scheduler and rt is not None and step >= rt + 2:
        causes.append(
            f"the scheduler's lr did not reach the inner optimizer after the state_dict() "
            f"round trip after step {s.round_trip_step}: copy each global group's "
            "hyper-parameters (lr, weight_decay) to the inner optimizer's groups before its "
            "step(); if the scheduler row passes, load_state_dict() replaced the groups the "
            "scheduler reaches (the inner optimizer's load builds new ones: make those the "
            "optimizer's own again)"
        )
    elif s.scheduler and step >= 2:
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


_EMPTY_INNER = (
    "a rank that owns no parameter (more ranks than parameters) built its inner optimizer "
    "from an empty list: skip the inner optimizer on such a rank; it must still take part in "
    "every collective"
)


def raised_on_some(n: dict, s) -> str:
    """A class that raised on some ranks only (numbers: `exception`, `call`)."""
    if n.get("exception") == "ValueError" and n.get("call") == "the optimizer":
        return _EMPTY_INNER  # what the optimizer refuses on a rank given no parameter
    return (
        "the class behaved differently on some ranks: whatever depends on the rank (what it "
        "owns, an if on dist.get_rank()) must still leave every rank constructing and "
        "communicating alike"
    )


def raised(n: dict, s) -> str | None:
    """A rank's exception ended the run (numbers: `exception`, `call`: what the tool was
    calling, `parameters_sharded`: the class shards its parameters)."""
    call, exc = n.get("call"), n.get("exception")
    if call in ("the backward", "the forward") and exc == "RuntimeError":
        if n.get("parameters_sharded"):
            return (
                "a parameter was used after its storage was freed: a ZeRO-3/FSDP unit must be "
                "gathered again before its backward (and before the next forward), not only "
                "before its first forward"
            )
    if call in ("optimizer.state_dict()", "optimizer.load_state_dict()"):
        return STATE_DICT
    return None


def hang(n: dict, s) -> str | None:
    """A hang the trace diagnosed (numbers: `trace_kind`): only its measured shape names a
    cause; a rank parked elsewhere is the user's own code, named by the diagnosis itself."""
    if n.get("trace_kind") != "left early":
        return None
    return (
        "the ranks ran different numbers of steps (uneven data: one rank out of batches "
        "first): give every rank as many batches (DistributedSampler pads the last one; "
        "drop_last=True drops it), or run the loop under DDP's join() context manager"
    )


ON_SOME_RANKS = (
    "a collective issued on some ranks only (in code under `if rank == 0:`, an evaluate() or "
    "a logging step only the main process runs) waits for peers that never issue it: issue "
    "it on every rank (run the evaluation everywhere and reduce its metric there), or compute "
    "what rank 0 needs without a collective"
)


def collective_mismatch(n: dict, s) -> str | None:
    """The collective trace's diagnosis (numbers: `trace_kind`, `op`)."""
    kind = n.get("trace_kind")
    if kind == "issued on some ranks only":
        return ON_SOME_RANKS
    arrival = ("extra collective", "size mismatch", "shape mismatch")
    if n.get("op") != "all_reduce" or n.get("trace_kind") not in arrival:
        return None
    return (
        "the ranks issued different all-reduces at the same position: launched in the order "
        "gradients arrive, they differ when a parameter gets no gradient on one rank or "
        "gradients arrive in another order; launch in an order fixed at construction, and "
        "all-reduce a zero gradient for a parameter this rank did not use; a loop over a set "
        "(of parameters or of their names) runs in an order of each process's own: loop over "
        "the module's parameters (a tied weight comes once)"
    )


# --- compare: the first departure from a recording (`recording/departure.py`) -------------


def loss_departs(n: dict, s) -> str | None:
    """The loss departs (numbers: `recording`, `this_run`, each run's micro-steps at the
    step): a loss that is exactly as many times the other's as its run has micro-steps a
    step was not divided by them."""
    a, b = n.get("recording"), n.get("this_run")
    if not a or not b:
        return None
    sides = ((b / a, n.get("micro_steps"), "this run's"),
             (a / b, n.get("micro_steps_recording"), "the recording's"))  # fmt: skip
    for ratio, micro, whose in sides:
        if micro and micro > 1 and abs(ratio - micro) <= SCALE_RTOL * micro:
            return (
                f"{whose} loss is {micro} x the other's, as many times as that run has "
                f"micro-steps a step: its loss was not divided by the accumulation steps: "
                f"call backward() on loss / {micro}, so the micro-steps' gradients add up to "
                "the mean over the global batch"
            )
    return None


def parameters_depart(n: dict, s) -> str | None:
    """The parameters after a step depart while everything the step reads agreed (it is the
    first departure: its settings, loss and gradients were compared first). numbers:
    `compared_step`, `offset` (not 0: one run is a resume of the other)."""
    if n.get("in_one_run"):
        return None
    if n.get("offset") and n.get("compared_step") == 0:
        return (
            "the first step after the resume had the recording's gradients and settings but "
            "not its update: the optimizer state was not restored (AdamW's moments started "
            "over): save optimizer.state_dict() in the checkpoint and load it with "
            "optimizer.load_state_dict() before the first resumed step"
        )
    return (
        "the step had the recording's gradients and settings but not its update: the "
        "optimizers differ in what is not a param-group setting (their state, their class "
        "or its implementation), or the parameters were changed outside the step"
    )


def setting_departs(n: dict, s) -> str | None:
    """A param-group setting departs (numbers: `setting`, `offset`): an lr after a resume
    is the scheduler's."""
    if n.get("setting") != "lr" or not n.get("offset"):
        return None
    return (
        "the learning rate differs after the resume: the scheduler was not restored (save "
        "scheduler.state_dict() in the checkpoint and load it), or it was built after the "
        "optimizer's state was loaded (its constructor writes the base lr into the groups)"
    )

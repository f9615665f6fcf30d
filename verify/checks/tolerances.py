"""How far a correct data-parallel run may be from one process, tensor by tensor, and why.

The reference (`reference.py`) is one process that sees the whole global batch, fed in the
ranks' shards as gradient accumulation would feed it: shard r's gradient g_r is computed by
the same ops on the same inputs as rank r computes it, so on CPU (deterministic kernels) it is
bitwise what rank r holds before synchronization. A correct implementation then returns
a = (1/n) sum_r g_r, rounded. The only legitimate difference left is that rounding, in the
tensor's own dtype (unit roundoff u = eps/2):

- summing n terms in any order (gloo's ring, a tree, a loop over ranks): at most
  (n - 1) u sum|g_r| (first order);
- dividing by n after the sum: u |a|; dividing each g_r first ("pre-divide", as PyTorch DDP
  does): u |g_r| / n each, n u S in all with S = sum|g_r| / n;
- accumulating in a wider dtype and rounding once: u |a| (better than any of the above).

So every correct way stays within n u S + u |a| per element. `gradient_tolerance` is twice
that, eps (n S + |a|): no constant measured on one machine, and the element's own dtype, so a
float64 gradient averaged in a float32 buffer (error ~1e-8 of its scale) is caught, where a
model-wide bf16 tolerance let it pass. An element no shard touched must be exactly zero.

On CUDA some kernels add in a nondeterministic order (atomics in embedding backward,
index_add): rank r's g_r and the reference's may differ by a few roundings of the summands
before any communication. `CUDA_ULPS` ulps of the tensor's scale (its max |a|) are added
there; never on CPU.

Parameters. The reference is re-anchored to the replica after every step, so both sides step
from the same parameters, with gradients that differ by at most the gradient tolerance tau (the
tensor's largest). For AdamW, the update is lr u, u = m_hat / (sqrt(v_hat) + eps_adam), m_hat
and v_hat weighted averages of the gradients (weights summing to 1): |d m_hat| <= tau,
|d sqrt(v_hat)| <= tau (Minkowski), |u| <= U_k (Cauchy-Schwarz; 1 at the first step), so
    |d u| <= min(2 U_k, (1 + U_k) tau / (sqrt(v_hat) - tau + eps_adam)):
~tau/|g| where the gradient is above its rounding, and the honest 2 U_k (two lr-sized steps)
only where it is not. SGD with momentum mu: |d buffer| <= tau sum mu^j. On top, PARAM_EPS ulps
of the parameter's dtype: each side rounds the updated parameter once.

Buffers are computed from parameters by the same ops on both sides: float buffers get
eps of their dtype times their scale, integer buffers none.
"""

from __future__ import annotations

import math

import torch

CUDA_ULPS = 64.0
PARAM_EPS = 2.0
BUFFER_ULPS = 4.0


def eps_of(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def gradient_tolerance(
    dtype: torch.dtype, world_size: int, abs_mean: torch.Tensor, mean: torch.Tensor, *,
    cuda: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Per-element tolerance of an averaged gradient (module docstring).

    Args:
        dtype: the gradient's own dtype.
        world_size: n, the ranks averaged over.
        abs_mean: S = sum_r |g_r| / n, in float64.
        mean: a = sum_r g_r / n, in float64.
        cuda: add the allowance for nondeterministic kernels.
    """
    eps = eps_of(dtype)
    tol = eps * (world_size * abs_mean + mean.abs())
    if cuda and mean.numel():
        tol = tol + CUDA_ULPS * eps * float(mean.abs().max())
    return tol


def adam_update_bound(beta1: float, beta2: float, k: int) -> float:
    """U_k: the largest |m_hat / sqrt(v_hat)| any gradient history of k steps can give."""
    w1 = [(1 - beta1) * beta1 ** (k - s) / (1 - beta1**k) for s in range(1, k + 1)]
    w2 = [(1 - beta2) * beta2 ** (k - s) / (1 - beta2**k) for s in range(1, k + 1)]
    return math.sqrt(sum(a * a / b for a, b in zip(w1, w2, strict=True)))


def parameter_tolerance(
    ref_param: torch.Tensor,
    state: dict,
    group: dict,
    *,
    optimizer: str,
    tau: float,
    stepped: bool,
    updates: int,
    momentum: float = 0.9,
) -> torch.Tensor:
    """Per-element tolerance of a parameter after one step (module docstring).

    Args:
        ref_param: the reference parameter after the step.
        state: the reference optimizer's state for it (after the step).
        group: its parameter group; `lr` must be the one the step used.
        tau: the largest gradient tolerance this parameter had in any step so far.
        stepped: whether the optimizer updated it in this step (it had a gradient).
        updates: how many steps have updated it so far, this one included.
        momentum: SGD's momentum.
    """
    p = ref_param.detach().double().abs()
    eps_p = eps_of(ref_param.dtype)
    lr = float(group["lr"])
    if not stepped:
        return PARAM_EPS * eps_p * p  # untouched on both sides: only a copy's rounding
    if optimizer == "adamw":
        beta1, beta2 = group["betas"]
        k = int(state["step"])
        u_max = adam_update_bound(beta1, beta2, k)
        sqrt_v = (state["exp_avg_sq"].detach().double() / (1 - beta2**k)).sqrt()
        room = (sqrt_v - tau + group["eps"]).clamp_min(1e-300)
        du = ((1 + u_max) * tau / room).clamp_max(2 * u_max)
    else:  # sgd: the momentum buffer sums k gradients with weights mu^j
        du = torch.full_like(p, tau * sum(momentum**j for j in range(updates)))
        u_max = state["momentum_buffer"].detach().double().abs()
    return lr * du + PARAM_EPS * eps_p * (p + lr * u_max)


def buffer_tolerance(ref: torch.Tensor) -> float:
    if not ref.is_floating_point() or not ref.numel():
        return 0.0
    return BUFFER_ULPS * eps_of(ref.dtype) * float(ref.detach().abs().max())

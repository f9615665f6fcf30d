"""What a rehearsal cannot map, and how a rank tells it from a crash of the script.

A verdict never rests on a mapping the rehearsal could not make: a CUDA graph, a custom CUDA
kernel, an operator with no CPU kernel, a package that exists only for GPUs, a call into
NCCL itself. Each is one line naming the call and its file:line, and the run exits 2.

Three ways a rank meets one:
- a call the rehearsal knows it cannot map raises `UnmappableCall` (`Ledger.refuse`);
- a CUDA call it does not map at all raises what a CPU-only torch raises (the words
  `launching/needs_cuda.py` knows: "Torch not compiled with CUDA enabled", ...);
- an operator registered for CUDA only raises "Could not run ... from the 'CPU' backend".
`classify` turns the exception into a `CannotMap`; anything else is the script's own crash.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# Packages that exist for GPUs only: importing one is not a fault of the script.
CUDA_ONLY_PACKAGES = ("flash_attn", "apex", "triton", "transformer_engine", "cupy", "pycuda")


@dataclass(frozen=True)
class CannotMap:
    """A call the rehearsal could not map: as written, where, and why not."""

    call: str  # `torch.cuda.graph(g)` (the user's line when known)
    where: str  # path:line in the user's code
    why: str  # "a CUDA graph replays captured GPU kernels: ..."

    def message(self) -> str:
        return (
            f"--on-cpu cannot rehearse {self.where}: `{self.call}`: {self.why}; no verdict "
            "(run it where each rank has a GPU)"
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> CannotMap:
        return cls(data["call"], data["where"], data["why"])


class UnmappableCall(RuntimeError):
    """Raised at a call the rehearsal cannot map (`Ledger.refuse`)."""

    def __init__(self, what: CannotMap) -> None:
        super().__init__(what.message())
        self.what = what


def classify(exc: BaseException) -> CannotMap | None:
    """The call a rank could not rehearse, when `exc` says so (module docstring); else None."""
    from verify.launching.needs_cuda import says_cuda_missing, shown, user_frame

    if isinstance(exc, UnmappableCall):
        return exc.what
    text = str(exc)
    if says_cuda_missing(exc):
        why = "it needs CUDA, and the rehearsal has no CPU stand-in for it"
    elif "from the 'CPU' backend" in text and "Could not run" in text:
        why = "the operator has a CUDA kernel only, no CPU one"
    elif isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in (
        CUDA_ONLY_PACKAGES
    ):
        why = f"{exc.name} exists for GPUs only"
    else:
        return None
    frame = user_frame(exc)
    if frame is None:
        return CannotMap(text.splitlines()[0] if text else type(exc).__name__, "?", why)
    return CannotMap(
        (frame.line or "").strip() or text, f"{shown(frame.filename)}:{frame.lineno}", why
    )

"""A script written for GPUs, run where there are none: a usage error, not a fault.

Most single-node GPU scripts hard-code their device and backend (`torch.cuda.set_device(
local_rank)`, `init_process_group("nccl")`). On a machine without CUDA each rank then raises
from inside torch (`module 'torch._C' has no attribute '_cuda_setDevice'`, `Distributed
package doesn't have NCCL built in`); that says nothing about the script's correctness, so
`hang` and `audit` exit 2 with one line: the call, its file:line, why it cannot run here, and
what to do (`run_watched_script`, `checks/script.py`): among others, rehearse it as it is with
`--on-cpu` (`verify/oncpu/`). The script's own `assert torch.cuda.is_available()` is the
same error in its words.

A script that gives each rank a GPU of its own (`set_device(local_rank)`), started with more
ranks than the machine has GPUs, is the same usage error: CUDA's "invalid device ordinal" in
a rank past the last GPU, where this node's ranks outnumber its GPUs, says how many ranks can
run here (`_too_few_gpus`).

A rank recognizes the error (`classify`: only where this process has no usable CUDA, or no
GPU for its local rank, so any other CUDA error on a GPU machine stays a crash) and hands a
`NeedsCuda` to the parent as the partial report of its failure (`error_report`'s `found`),
its traceback going to its stderr file only.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import traceback
from dataclasses import dataclass

# torch's words where CUDA or NCCL is missing (CPU-only build, no driver, no device).
_SIGNS = (
    "module 'torch._C' has no attribute '_cuda",
    "Torch not compiled with CUDA enabled",
    "Found no NVIDIA driver",
    "No CUDA GPUs are available",
    "doesn't have NCCL built in",
    "ProcessGroupNCCL is only supported with GPUs",
)
_ORDINAL = "invalid device ordinal"  # CUDA's words for a GPU index this machine lacks


@dataclass(frozen=True)
class NeedsCuda:
    """The call of a user's script that needs CUDA, where it is, and why it cannot run here."""

    call: str  # the script's line, as written: `torch.cuda.set_device(local_rank)`
    where: str  # path:line in the user's code
    why: str  # "this torch is built without CUDA", ...
    backend: str | None = None  # the backend the script passes init_process_group, if nccl
    gpus: int = 0  # where there are too few: the GPUs this machine has (0: CUDA is missing)

    def message(self, backend_flag: str | None = None) -> str:
        """One line for the user; `backend_flag`: the tool's --backend, said to be overridden
        when the script hard-codes another."""
        if self.gpus:
            fewer = f"start at most {self.gpus} rank{'s' if self.gpus > 1 else ''} here"
            return (
                f"{self.where}: `{self.call}` needs a GPU for each rank, and {self.why}: "
                f"{fewer}, or run the script where each rank has a GPU, or rehearse it on CPU "
                "ranks as it is with --on-cpu"
            )
        text = (
            f"{self.where}: `{self.call}` needs CUDA, and {self.why}: run the script where "
            "each rank has a GPU, or let it choose its device and backend by "
            "torch.cuda.is_available() (cpu and gloo without GPUs), or rehearse it on CPU ranks "
            "as it is with --on-cpu"
        )
        if self.backend and backend_flag and backend_flag != self.backend:
            text += (
                f"; --backend {backend_flag} does not change the backend the script passes "
                f'init_process_group itself ("{self.backend}")'
            )
        return text


def classify(exc: BaseException, backend: str | None = None) -> NeedsCuda | None:
    """A `NeedsCuda` when `exc` is torch saying CUDA or NCCL is missing and this process has
    no usable CUDA, or CUDA saying a GPU index is out of range where this node's ranks
    outnumber its GPUs; else None. `backend`: what the script passed init_process_group, if
    it did."""
    import torch
    import torch.distributed as dist

    text = str(exc)
    if _ORDINAL in text:
        return _too_few_gpus(exc, backend)
    asserted = _asserts_cuda(exc)
    if not (says_cuda_missing(exc) or asserted):
        return None
    nccl = "NCCL" in text and not asserted
    if nccl and dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available():
        return None
    if not nccl and torch.cuda.is_available():
        return None
    if not torch.backends.cuda.is_built():
        why = "this torch is built without CUDA" + (" or NCCL" if nccl else "")
    elif not torch.cuda.is_available():
        why = "this machine has no usable GPU"
    else:
        why = "this torch has no NCCL"
    where, call = _located(exc)
    asked = str(backend).lower() if backend is not None else None
    return NeedsCuda(call or text, where, why, asked if asked and "nccl" in asked else None)


def _too_few_gpus(exc: BaseException, backend: str | None) -> NeedsCuda | None:
    """An out-of-range GPU index in a rank whose local rank is past this machine's GPUs,
    where this node starts more ranks than it has GPUs (its LOCAL_WORLD_SIZE, else
    WORLD_SIZE: every rank here); else None, a crash: a script's own wrong index (rank 0
    asking for cuda:1, GPUs shared by `local_rank % device_count()`), or a rank whose script
    chose gloo (accelerate's CPU ranks still bind a barrier to `cuda:<local rank>`:
    docs/audit.md says to hide the GPUs there)."""
    import torch

    if backend is not None and "nccl" not in str(backend).lower():
        return None
    if not torch.cuda.is_available():
        return None
    gpus = torch.cuda.device_count()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 0)
    local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    if ranks <= gpus or local_rank < gpus:
        return None
    where, call = _located(exc)
    call = call or str(exc).splitlines()[0]
    noun = "GPU" if gpus == 1 else "GPUs"
    return NeedsCuda(call, where, f"this machine has {gpus} {noun} for {ranks} ranks", gpus=gpus)


def _located(exc: BaseException) -> tuple[str, str]:
    """Where `exc` left the user's code (path:line, "?" when nowhere) and that line."""
    frame = user_frame(exc)
    if frame is None:
        return "?", ""
    return f"{shown(frame.filename)}:{frame.lineno}", (frame.line or "").strip()


def _asserts_cuda(exc: BaseException) -> bool:
    """The script's own `assert torch.cuda.is_available()` failed (3 of 5 public DDP scripts
    have one): the same usage error as a CUDA call, in the script's words."""
    if not isinstance(exc, AssertionError):
        return False
    frame = user_frame(exc)
    return frame is not None and "cuda.is_available()" in (frame.line or "")


def says_cuda_missing(exc: BaseException) -> bool:
    """Whether `exc` is torch saying CUDA or NCCL is missing from this build or machine (what
    a CPU-only torch raises at a CUDA call: `--on-cpu` names the calls it could not map by
    the same words, `verify/oncpu/unmappable.py`)."""
    text = str(exc)
    return any(sign in text for sign in _SIGNS)


USER, LIBRARY, TORCH_OR_TOOL = 0, 1, 2  # whose code a file is (`path_kind`)


@functools.lru_cache(maxsize=4096)
def path_kind(path: str) -> int:
    """USER for the user's code; LIBRARY for Python's own and installed packages;
    TORCH_OR_TOOL for torch and this tool."""
    import torch

    import verify

    path = os.path.abspath(path)
    mine = (os.path.dirname(torch.__file__), os.path.dirname(verify.__file__))
    if any(path.startswith(s + os.sep) for s in mine):
        return TORCH_OR_TOOL
    libraries = [sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")]
    return LIBRARY if any(path.startswith(s + os.sep) for s in libraries) else USER


def user_frame(exc: BaseException):
    """The innermost frame in the user's code: not torch's, not this tool's, not Python's;
    else the innermost outside torch and this tool (a library the script called)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    for worst in (USER, LIBRARY):
        for frame in reversed(frames):
            if path_kind(frame.filename) <= worst:
                return frame
    return None


@functools.lru_cache(maxsize=4096)
def shown(path: str) -> str:
    """`path` as the user reads it: relative to the working folder when under it."""
    rel = os.path.relpath(os.path.abspath(path))
    return rel if not rel.startswith("..") else path

"""A script written for GPUs, run where there are none: a usage error, not a fault.

Most single-node GPU scripts hard-code their device and backend (`torch.cuda.set_device(
local_rank)`, `init_process_group("nccl")`). On a machine without CUDA each rank then raises
from inside torch (`module 'torch._C' has no attribute '_cuda_setDevice'`, `Distributed
package doesn't have NCCL built in`); that says nothing about the script's correctness, so
`hang` and `audit` exit 2 with one line: the call, its file:line, why it cannot run here, and
what to do (`run_watched_script`, `checks/script.py`): among others, rehearse it as it is with
`--on-cpu` (`verify/oncpu/`). The script's own `assert torch.cuda.is_available()` is the
same error in its words.

A rank recognizes the error (`classify`: only where this process has no usable CUDA, so a
CUDA error on a GPU machine stays a crash) and hands a `NeedsCuda` to the parent as the
partial report of its failure (`error_report`'s `found`), its traceback going to its stderr
file only.
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


@dataclass(frozen=True)
class NeedsCuda:
    """The call of a user's script that needs CUDA, where it is, and why it cannot run here."""

    call: str  # the script's line, as written: `torch.cuda.set_device(local_rank)`
    where: str  # path:line in the user's code
    why: str  # "this torch is built without CUDA", ...
    backend: str | None = None  # the backend the script passes init_process_group, if nccl

    def message(self, backend_flag: str | None = None) -> str:
        """One line for the user; `backend_flag`: the tool's --backend, said to be overridden
        when the script hard-codes another."""
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
    no usable CUDA; else None. `backend`: what the script passed init_process_group, if it
    did."""
    import torch
    import torch.distributed as dist

    text = str(exc)
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
    frame = user_frame(exc)
    where = "?" if frame is None else f"{shown(frame.filename)}:{frame.lineno}"
    call = (frame.line or "").strip() if frame is not None else ""
    asked = str(backend).lower() if backend is not None else None
    return NeedsCuda(call or text, where, why, asked if asked and "nccl" in asked else None)


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

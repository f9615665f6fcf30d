"""`torch.cuda` as a GPU node would answer it, on CPU ranks.

On a CPU-only torch, `torch.cuda.set_device` raises (`torch._C` has no `_cuda_setDevice`),
`synchronize()` raises "Torch not compiled with CUDA enabled", a Stream or an Event cannot be
made, `is_available()` is False. Under a rehearsal:

- the script's questions (and those of the libraries it calls) get a GPU node's answers:
  `is_available()` True, `device_count()` the ranks on this node (LOCAL_WORLD_SIZE; in a
  launcher command's process that is no rank yet, such as `mp.spawn`'s parent asking how
  many to start, the GPUs `--nproc` gives the rehearsed node: `LAUNCHED_ON_CPU_ENV`),
  `current_device()` what `set_device` chose, a device name, capability 8.0 (bf16
  supported), memory figures of 0 (nothing is held on a GPU); torch asking itself gets the
  CPU build's answers, so that its own choices stay CPU ones (`torch.compile`'s inductor
  would otherwise plan for a GPU);
- calls that order or free GPU work are no-ops: `set_device`, `synchronize`, `empty_cache`,
  the peak-memory resets, NVTX ranges; a Stream, an Event and `torch.cuda.stream(s)` do
  nothing (every CPU op is complete when it returns), and an Event's `elapsed_time` is
  wall time between its records;
- the CUDA generator is the CPU one: `torch.cuda.manual_seed(_all)` seeds it, its RNG
  state is the CPU's;
- what cannot run without a GPU is refused, with the call and its line (`Ledger.refuse`):
  CUDA graphs, NCCL itself (`torch.cuda.nccl`, `ProcessGroupNCCL`), the jiterator, custom
  kernels built from CUDA sources.
"""

from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace

import torch

from verify.launching.env import LAUNCHED_ON_CPU_ENV
from verify.oncpu import standins
from verify.oncpu.ledger import Ledger
from verify.oncpu.standins import Node
from verify.patching import Patches

NAME = "CPU (rehearsing CUDA: --on-cpu)"


def install(ledger: Ledger, patches: Patches) -> Node:
    """Replace `torch.cuda`'s calls as the module docstring says; returns the rehearsed node
    (its GPUs, the one chosen), which `torch.accelerator` shares (`accelerator_api.py`)."""
    node = Node(_local_gpus())
    _questions(ledger, patches, node)
    _ordering(ledger, patches, node)
    _generators(ledger, patches, node)
    _streams(ledger, patches)
    _refusals(ledger, patches)
    _extensions(ledger, patches)
    return node


def _local_gpus() -> int:
    """The GPUs of the rehearsed node: one a rank on it (LOCAL_WORLD_SIZE); in a launcher
    command's process that is no rank yet, the GPUs `--nproc` gives the node."""
    node = os.environ.get(LAUNCHED_ON_CPU_ENV) or "1"
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", node)))


def properties() -> SimpleNamespace:
    """What `get_device_properties()` answers: a GPU with the host's memory."""
    return SimpleNamespace(
        name=NAME, major=8, minor=0, total_memory=_memory(),
        multi_processor_count=os.cpu_count() or 1, is_integrated=False,
    )  # fmt: skip


def _questions(ledger: Ledger, patches: Patches, node: Node) -> None:
    """A GPU node's answers (bf16 supported; nothing held, so memory figures of 0)."""
    cuda, props = torch.cuda, properties()
    total = props.total_memory
    for name, value in {
        "is_available": True, "device_count": node.count, "is_initialized": True,
        "is_bf16_supported": True, "get_device_name": NAME, "get_device_capability": (8, 0),
        "get_device_properties": props, "get_arch_list": [], "memory_allocated": 0,
        "max_memory_allocated": 0, "memory_reserved": 0, "max_memory_reserved": 0,
        "memory_cached": 0, "max_memory_cached": 0, "memory_stats": {}, "memory_summary": "",
        "mem_get_info": (total, total), "utilization": 0,
    }.items():  # fmt: skip
        original = getattr(cuda, name)
        patches.apply(cuda, name, standins.answer(ledger, f"torch.cuda.{name}", original, value))

    def current_device():
        if standins.torch_asks():
            return 0
        ledger.mapped("torch.cuda.current_device()", "the device set", direct=True)
        return node.device

    patches.apply(cuda, "current_device", current_device)


def _ordering(ledger: Ledger, patches: Patches, node: Node) -> None:
    """Calls that order or free GPU work, and the choice of a device: no-ops."""
    cuda = torch.cuda
    for name in ("synchronize", "empty_cache", "ipc_collect", "init", "reset_peak_memory_stats",
                 "reset_max_memory_allocated", "reset_max_memory_cached",
                 "reset_accumulated_memory_stats"):  # fmt: skip
        patches.apply(cuda, name, standins.no_op(ledger, f"torch.cuda.{name}"))

    def set_device(device):
        ledger.mapped("torch.cuda.set_device()", "no-op")
        node.choose(device)

    patches.apply(cuda, "set_device", set_device)
    patches.apply(cuda, "device", _device_context(ledger))
    for name in ("range_push", "range_pop", "mark"):
        patches.apply(cuda.nvtx, name, standins.no_op(ledger, f"torch.cuda.nvtx.{name}"))
    patches.apply(cuda.nvtx, "range", lambda *a, **k: _counted(ledger, "nvtx.range"))


def _generators(ledger: Ledger, patches: Patches, node: Node) -> None:
    """The CUDA generator is the CPU one."""
    cuda, generator = torch.cuda, torch.default_generator

    def seed(name, how):
        original = getattr(cuda, name)

        def call(*args, **kwargs):
            if standins.torch_asks():  # torch.manual_seed seeds CUDA's: a no-op in a CPU torch
                return original(*args, **kwargs)
            ledger.mapped(f"torch.cuda.{name}()", "the CPU generator", direct=True)
            return how(*args, **kwargs)

        patches.apply(cuda, name, call)

    seed("manual_seed", lambda s: generator.manual_seed(int(s)))
    seed("manual_seed_all", lambda s: generator.manual_seed(int(s)))
    seed("seed", generator.seed)
    seed("seed_all", generator.seed)
    seed("initial_seed", generator.initial_seed)
    seed("get_rng_state", lambda device="cuda": torch.get_rng_state())
    seed("set_rng_state", lambda s, device="cuda": torch.set_rng_state(s))
    seed("get_rng_state_all", lambda: [torch.get_rng_state()] * node.count)
    seed("set_rng_state_all", lambda s: torch.set_rng_state(s[0]))


def _refusals(ledger: Ledger, patches: Patches) -> None:
    """What cannot run without a GPU: CUDA graphs, NCCL itself, the jiterator."""
    cuda = torch.cuda
    graphs = "a CUDA graph replays captured GPU kernels, and a CPU rank has none to capture"
    for name in ("CUDAGraph", "graph", "make_graphed_callables", "graph_pool_handle"):
        patches.apply(cuda, name, standins.refuse(ledger, f"torch.cuda.{name}", graphs))
    nccl = "it calls NCCL itself, and the rehearsal's ranks talk over gloo"
    for name in ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "version",
                 "unique_id", "init_rank"):  # fmt: skip
        patches.apply(cuda.nccl, name, standins.refuse(ledger, f"torch.cuda.nccl.{name}", nccl))
    jit = "the jiterator compiles a CUDA kernel, which has no CPU code to run"
    for name in ("_create_jit_fn", "_create_multi_output_jit_fn"):
        refused = standins.refuse(ledger, f"torch.cuda.jiterator.{name}", jit)
        patches.apply(cuda.jiterator, name, refused)


def _streams(ledger: Ledger, patches: Patches) -> None:
    """Streams and events that do nothing: on a CPU every op is complete when it returns."""

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False):
            ledger.mapped("torch.cuda.Event()", "a wall-clock event")
            self.at = None

        def record(self, stream=None):
            self.at = time.perf_counter()

        def elapsed_time(self, end) -> float:
            return (end.at - self.at) * 1000.0  # ms, as CUDA's

        def query(self) -> bool:
            return True

        def wait(self, stream=None):
            pass

        def synchronize(self):
            pass

    class Stream:
        def __new__(cls, device=None, priority=0, **kwargs):
            ledger.mapped("torch.cuda.Stream()", "no-op")
            return super().__new__(cls)

        def __init__(self, device=None, priority=0, **kwargs):
            self.device, self.priority = torch.device("cpu"), priority

        def wait_stream(self, stream):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            event = event or Event()
            event.record()
            return event

        def synchronize(self):
            pass

        def query(self) -> bool:
            return True

    cuda = torch.cuda
    patches.apply(cuda, "Event", Event)
    patches.apply(cuda, "Stream", Stream)
    patches.apply(cuda, "ExternalStream", Stream)
    for name in ("current_stream", "default_stream"):
        patches.apply(cuda, name, lambda device=None, name=name: _answer(ledger, name, Stream))
    patches.apply(cuda, "stream", lambda stream=None: _counted(ledger, "stream"))
    patches.apply(cuda, "set_stream", lambda stream: ledger.mapped("torch.cuda.set_stream()", "no-op"))  # fmt: skip


def _answer(ledger: Ledger, name: str, make):
    ledger.mapped(f"torch.cuda.{name}()", "a no-op stream", direct=True)
    with ledger.quiet():
        return make()


def _counted(ledger: Ledger, name: str):
    ledger.mapped(f"torch.cuda.{name}()", "no-op")
    return contextlib.nullcontext()


def _device_context(ledger: Ledger):
    class device(contextlib.nullcontext):
        """`with torch.cuda.device(i):` chooses nothing on CPU ranks."""

        def __init__(self, device=None):
            ledger.mapped("torch.cuda.device()", "no-op")
            super().__init__()

    return device


def _extensions(ledger: Ledger, patches: Patches) -> None:
    """Custom kernels built at run time: refused when they have CUDA sources."""
    from torch.utils import cpp_extension

    load, load_inline = cpp_extension.load, cpp_extension.load_inline
    why = "a custom CUDA kernel has no CPU code to run"

    def load_checked(name, sources, *args, **kwargs):
        listed = [sources] if isinstance(sources, str) else list(sources)
        if kwargs.get("with_cuda") or any(str(s).endswith((".cu", ".cuh")) for s in listed):
            ledger.refuse(f"cpp_extension.load({name!r})", why)
        return load(name, sources, *args, **kwargs)

    def load_inline_checked(name, cpp_sources, cuda_sources=None, *args, **kwargs):
        if cuda_sources or kwargs.get("with_cuda"):
            ledger.refuse(f"cpp_extension.load_inline({name!r})", why)
        return load_inline(name, cpp_sources, cuda_sources, *args, **kwargs)

    patches.apply(cpp_extension, "load", load_checked)
    patches.apply(cpp_extension, "load_inline", load_inline_checked)


def _memory() -> int:
    """The host's memory, as the device's total: a plausible figure for scripts that size
    their batch by it."""
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 80 * 2**30

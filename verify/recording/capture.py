"""The drill-down's capture inside a rank (`compare --drill`, `checks/drill.py`; docs/compare.md,
"The drill-down"): one optimizer step of a re-run, op by op.

The step is named by `DRILL_ENV` (`<optimizer index>:<step>`). From the end of the step
before it (from the script's first line, for step 0) until that step has been taken, every
ATen op the dispatcher runs for the script is one `OpRecord` (a `TorchDispatchMode`, which
sees the data's preparation, the forward, the backward, DDP's collectives and its reducer's
copies, the optimizer's update and the script's own tensor code, but not what runs below
the dispatcher: a custom CUDA kernel, a C++ extension's own loops):

- where it ran: its phase (forward, backward, optimizer), the innermost module whose forward
  it ran in, by qualified name (the one the audit names tensors by, `naming.strip`), or in
  whose backward (the module whose output's gradient arrived last in this backward: a
  parent's own ops between two children read as the child's), and the script's source
  line (the first frame of the Python stack that is neither torch's, the tool's, the
  standard library's nor an installed package's: a Lightning module's line, not
  Lightning's);
- what it read and wrote: the replica audit's fingerprint of every tensor argument before
  the op runs (an in-place op's input as it was) and of every tensor it returned after, and
  of every other argument its exact text; of its first floating output, the sum and norm
  (float64), from which two runs' outputs are known to be apart by at least so much.
  Memory `empty` returned reads as "unwritten" (its dtype and shape, not its garbage) until
  ops have written all of its bytes; a collective's output is not read at its op (its
  backend writes it later, on its own thread).

Ops issued by the tool itself (the audit, the recorder, the batch's fingerprints) have a frame
of the tool's above the op and are not recorded, nor are the capture's own fingerprints (the
mode is off inside its handler). Each module's forward adds a `ModuleCall` (its inputs' and
outputs' fingerprints), and the gradient of its output, as the backward brings it, a
record of its fingerprint: the module boundaries the drill-down looks at before the ops. An
error of the capture's own stops it (`broken`, in its file) and never reaches the script.
Once the step is taken, each rank writes its records to
`<report folder>/drill/rank<r>.json` and the script ends there, as a `sys.exit(0)` would
(`SystemExit`): the re-run goes no further than the step drilled into, and the recording
(the replay check's evidence, `checks/drill.py`) is written as at any end of the script.

Nothing here runs before the end of the step before the one drilled into, beyond a check per
optimizer step: the steps before cost what the plain re-run costs.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import sysconfig
import traceback
from dataclasses import asdict, dataclass

import torch
import torch.utils._pytree as pytree
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import TorchDispatchMode

import verify
from verify.launching.env import DRILL_ENV
from verify.patching import WRAPPERS
from verify.replica_audit.fingerprint import fingerprints, text_bits
from verify.watching.stacks import relpath

FORWARD, BACKWARD, OPTIMIZER = "forward", "backward", "optimizer"
# arguments whose text is their value (others, such as a process group, by their type)
_EXACT = (int, float, bool, complex, str, type(None), torch.dtype, torch.device,
          torch.memory_format, torch.layout)  # fmt: skip
FOLDER = "drill"  # <report folder>/drill/rank<r>.json
# the namespaces of collectives, whose output is written later, on the backend's own thread
_ASYNC = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                    "empty_permuted"})  # fmt: skip
_NAMED = "_ddp_verify_backward_of"  # on a module's output: the module its gradient names
_NOT_THE_SCRIPTS = tuple(
    os.path.join(p, "")  # a folder, not a prefix of a name: verify/ is not verify_demo.py
    for p in {os.path.dirname(torch.__file__), os.path.dirname(verify.__file__)}
    | {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


@dataclass
class OpRecord:
    """One ATen op the script ran in the captured step (module docstring)."""

    phase: str
    module: str  # the innermost module's qualified name; "" for the script's own code
    op: str  # "aten.addmm.default"
    line: str  # "train.py:42"
    inputs: list[int]  # one fingerprint per argument, tensors and others, in pytree order
    args: list[str]  # what each argument is: "float32 [8, 4]", "param fc1.weight", "0.5"
    outputs: list[int]
    shape: str  # the first tensor output's dtype and shape
    total: float | None = None  # the first floating output's sum and norm (float64)
    norm: float | None = None


@dataclass
class ModuleCall:
    """One module's forward in the captured step."""

    module: str
    kind: str  # its class
    line: str  # where the script called it
    inputs: list[int]
    outputs: list[int]
    ended: int = -1  # the order it returned in: an inner module's call before its parent's


def capture_for(settings, modules) -> Capture | None:
    """A capture when the parent asked for one (`DRILL_ENV`), writing beside the rank's audit
    report; else None. `modules`: the audit's `naming.Modules` (the roots and their names)."""
    asked = os.environ.get(DRILL_ENV)
    if not asked or not getattr(settings, "path", None):
        return None
    index, step = (int(x) for x in asked.split(":")[:2])
    return Capture(os.path.join(os.path.dirname(settings.path), FOLDER), index, step, modules)


class Capture:
    """The records of one optimizer step of one rank (module docstring)."""

    def __init__(self, folder: str, index: int, step: int, modules) -> None:
        self.folder, self.index, self.step, self.modules = folder, index, step, modules
        self.ops: list[OpRecord] = []
        self.calls: list[ModuleCall] = []
        self.grads: list[dict] = []  # each module output's gradient as it arrived (backward)
        self.paused = 0  # > 0 while the tool's own code runs (the audit's `_guard`)
        self.live = False  # the mode is on
        self.broken: str | None = None  # why the capture stopped early (its own error)
        # storages `empty` returned -> their bytes no op has written yet
        self._unwritten: dict[int, int] = {}
        self.stepping = False  # inside the optimizer's step() (its update's ops)
        self.backward_of = ""  # the module whose output's gradient arrived last
        self._names: dict[int, str] = {}
        self._stack: list[str] = []
        self._ended = 0
        self._task = -1  # the backward `backward_of` was named in
        self._handles: list = []
        self._mode = _Ops(self)

    def install(self) -> None:
        if self.step == 0:  # from the script's first line
            self._arm()

    def remove(self) -> None:
        self._stop()

    def optimizer_step(self, index: int, begins: bool) -> None:
        """The script's outermost `step()` of optimizer `index` begins or has ended."""
        if index == self.index:
            self.stepping = begins

    def stepped(self, index: int, step: int) -> None:
        """Optimizer `index` took step `step` (its post-hook, the audit's work done): the step
        before the captured one arms the capture; the captured one ends it, and the script."""
        if index != self.index:
            return
        if step == self.step - 1:
            self._arm()
        elif step == self.step:
            self._stop()
            self.write()
            raise SystemExit(0)

    def _arm(self) -> None:
        """From here to the captured step's end, every op (the data's preparation too)."""
        self._names = self.modules.module_names()
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._pre),
            nn_module.register_module_forward_hook(self._post, with_kwargs=True),
        ]
        self._mode.__enter__()
        self.live = True

    def _stop(self) -> None:
        if self.live:
            self._mode.__exit__(None, None, None)
            self.live = False
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre(self, module, args) -> None:
        if self.paused or self.broken:
            return
        name = self._name(module)
        self._stack.append(name)
        with self._own():
            line = script_line(sys._getframe(1)) or ""
            self.calls.append(ModuleCall(name, type(module).__name__, line, self.seen(args)[0], []))

    def _post(self, module, args, kwargs, output) -> None:
        if self.paused or self.broken or not self._stack:
            return
        name = self._stack.pop()
        call = next((c for c in reversed(self.calls) if c.module == name and not c.outputs), None)
        with self._own():
            if call is not None:  # the keyword arguments too (read here, where hooks get them)
                call.inputs += self.seen(kwargs)[0]
                call.outputs = self.seen(output)[0] or [0]
                call.ended, self._ended = self._ended, self._ended + 1
            for t in pytree.tree_leaves(output):  # an inner module's output may be its
                if isinstance(t, torch.Tensor) and t.requires_grad and not hasattr(t, _NAMED):
                    setattr(t, _NAMED, name)  # parent's too: the inner module's backward runs
                    t.register_hook(self._gradient_of(name))  # first

    def _gradient_of(self, name: str):
        def arrived(grad):
            self.backward_of, self._task = name, torch._C._current_graph_task_id()
            with self._own():
                self.grads.append({"module": name, "gradient": self.seen(grad)[0]})

        return arrived

    def _name(self, module) -> str:
        if id(module) not in self._names:  # built or wrapped since the capture began
            self._names = self.modules.module_names()
        return self._names.get(id(module), type(module).__name__)

    @contextlib.contextmanager
    def _own(self):
        """The capture's own work: its ops not recorded, its errors never the script's (the
        capture stops, saying why, and the script runs on)."""
        self.paused += 1
        try:
            yield
        except Exception as exc:
            self.fail(exc)
        finally:
            self.paused -= 1

    def fail(self, exc: Exception) -> None:
        if self.broken is None:
            frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
            where = f" (at {os.path.basename(frame.filename)}:{frame.lineno})" if frame else ""
            self.broken = f"{type(exc).__name__}: {exc}{where}"

    def phase(self) -> tuple[str, str]:
        """(phase, module) of the op running now."""
        task = torch._C._current_graph_task_id()
        if task != -1:  # a module named in an earlier backward is not this one's
            return BACKWARD, self.backward_of if task == self._task else ""
        if self._stack:
            return FORWARD, self._stack[-1]
        return (OPTIMIZER if self.stepping else FORWARD), ""

    def seen(self, tree) -> tuple[list[int], list[str], list[torch.Tensor]]:
        """(a fingerprint per leaf of `tree`, what each leaf is, its plain tensors)."""
        leaves = pytree.tree_leaves(tree)
        tensors = [x for x in leaves if _plain(x)]
        written = [x for x in tensors if _storage(x) not in self._unwritten]
        prints = dict(zip(map(id, written), fingerprints(written))) if written else {}
        marks, what = [], []
        for x in leaves:
            if _plain(x) and id(x) not in prints:  # memory as `empty` left it: its bits vary
                marks.append(text_bits(f"unwritten {_shape(x)}"))
                what.append(f"unwritten {_shape(x)}")
            elif _plain(x):
                marks.append(prints[id(x)])
                name = self.modules.name_of(x) if isinstance(x, torch.nn.Parameter) else None
                what.append(f"param {name}" if name else _shape(x))
            else:
                text = repr(x) if isinstance(x, _EXACT) else type(x).__name__
                marks.append(text_bits(text))
                what.append(text[:40])
        return marks, what, tensors

    def record(self, func, line: str, inputs, args, kwargs, out) -> None:
        """One op's record (module docstring), its inputs read before it ran."""
        self._note_writes(func, args, kwargs, out)
        # a collective's output is written later, by its backend's thread: not read here
        unread = func.namespace in _ASYNC
        outputs, _, tensors = ([], [], []) if unread else self.seen(out)
        phase, module = self.phase()
        rec = OpRecord(phase, module, str(func), line, inputs[0], inputs[1], outputs,
                       _shape(tensors[0]) if tensors else "")  # fmt: skip
        floating = next((t for t in tensors if t.is_floating_point() and t.numel()), None)
        if floating is not None:  # summed in float64, never copied to it
            rec.total = float(floating.detach().sum(dtype=torch.float64))
            rec.norm = float(torch.linalg.vector_norm(floating.detach(), dtype=torch.float64))
        self.ops.append(rec)

    def _note_writes(self, func, args, kwargs, out) -> None:
        """`empty` and its kin return memory as it was (garbage, whose bits differ from run
        to run): its storage reads as unwritten until an op the schema says writes it (an
        in-place op, an `out=`) or a fresh result is allocated in it. A view of it reads as
        unwritten too, and the storage is cleared by a write through the view."""
        fresh = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if func._opname in _EMPTY:
            self._unwritten.update((_storage(t), _nbytes(t)) for t in fresh)
            return
        schema = func._schema
        if all(r.alias_info is None for r in schema.returns):  # new memory, written
            for t in fresh:
                self._unwritten.pop(_storage(t), None)
        named = dict(zip((a.name for a in schema.arguments), args)) | kwargs
        for a in schema.arguments:  # the bytes an op writes, through views too
            if a.alias_info is not None and a.alias_info.is_write and a.name in named:
                for t in pytree.tree_leaves(named[a.name]):
                    key = _storage(t) if isinstance(t, torch.Tensor) else None
                    if key in self._unwritten:
                        left = self._unwritten[key] - t.numel() * t.element_size()
                        if left > 0:
                            self._unwritten[key] = left
                        else:
                            del self._unwritten[key]

    def write(self) -> None:
        os.makedirs(self.folder, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        body = {
            "index": self.index, "step": self.step, "rank": rank,
            "ops": [asdict(o) for o in self.ops], "calls": [asdict(c) for c in self.calls],
            "grads": self.grads, "broken": self.broken,
        }  # fmt: skip
        tmp = os.path.join(self.folder, f"rank{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(body, f)
        os.replace(tmp, os.path.join(self.folder, f"rank{rank}.json"))


class _Ops(TorchDispatchMode):
    """Every op the script runs, recorded by `Capture` (the mode is off in here: the
    fingerprints' own ops are not seen)."""

    def __init__(self, capture: Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.capture
        line = inputs = None
        if not (c.paused or c.broken or func.namespace == "profiler"):
            with c._own():
                line = script_line(sys._getframe(1))  # None: the tool's own op
                inputs = c.seen((args, kwargs)) if line is not None else None
        out = func(*args, **kwargs)  # the script's op: what it raises is the script's
        if inputs is not None:
            with c._own():
                c.record(func, line, inputs, args, kwargs, out)
        return out


def script_line(frame) -> str | None:
    """The script's source line that `frame` runs for: the first frame, going out, of none of
    torch, the standard library or an installed package, nor a wrapper the tool put in
    torch's place (`patching.WRAPPERS`: a pass-through); None when a frame of the tool's
    comes first (an op the tool issued, not the script)."""
    here = os.path.join(os.path.dirname(verify.__file__), "")
    while frame is not None:
        name = frame.f_code.co_filename
        if frame.f_code not in WRAPPERS:
            if name.startswith(here):
                return None
            if not name.startswith(_NOT_THE_SCRIPTS) and not name.startswith("<"):
                return f"{relpath(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage of its own
        return 0


def _plain(x) -> bool:
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided
            and x.device.type != "meta")  # fmt: skip


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"

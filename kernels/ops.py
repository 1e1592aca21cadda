"""The kernels' torch custom ops: ``custom_op(name, mutates_args)`` registers a launcher as ``pixdit::name``.

As custom ops, the launchers are opaque to torch.compile, which traces everything around them (see the package
docstring); each comes with a fake-tensor rule (``register_fake``: output shapes and dtypes without running it) and
declares the arguments it writes into. Only tracing needs the op: a plain eager call runs the launcher directly
(``KernelOp``). The namespace is ``pixdit`` for the installed library; a second copy of the
library loaded under another package name (two kernel versions interleaved in one process, scripts/kernel_ab.py)
registers its ops under that name instead of clashing with the installed ones.
"""

from __future__ import annotations

import functools
import os
import re

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

NAMESPACE = "pixdit" if __package__ == "pixdit.kernels" else re.sub(r"\W", "_", __package__ or "kernels")
# The Triton interpreter runs the kernels on CPU tensors (tests); TRITON_INTERPRET=1 must be set before pixdit.kernels
# is imported (the @triton.jit functions are created then).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


class KernelOp:
    """A launcher and its custom op (``.op``). Called, it goes through the op whenever something traces or
    intercepts the call (torch.compile, a TorchDispatchMode such as FakeTensorMode or make_fx, a tensor subclass
    such as DTensor) and runs the launcher directly otherwise: the same computation, without the custom op's
    per-call cost in eager mode (its Python autograd and dispatch layers cost ~0.2 ms a call on the H200's host, which
    made an eager LLSA forward+backward ~20% slower; docs/kernel_notes.md v16)."""

    def __init__(self, launcher, op):
        functools.update_wrapper(self, launcher)
        self.launcher, self.op = launcher, op

    def __call__(self, *args, **kwargs):
        if _traced() or _has_tensor_subclass(args, kwargs):
            return self.op(*args, **kwargs)
        return self.launcher(*args, **kwargs)

    def register_fake(self, fn):
        return self.op.register_fake(fn)


def _traced() -> bool:
    """Whether something traces or intercepts the calls made now: torch.compile, or a TorchDispatchMode."""
    return torch.compiler.is_compiling() or is_in_torch_dispatch_mode()


def _has_tensor_subclass(args, kwargs) -> bool:
    # a plain loop, no generator: this runs before every eager launch
    for a in (*args, *kwargs.values()):
        if type(a) is not torch.Tensor and isinstance(a, torch.Tensor):
            return True
    return False


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launchers' host code. ``triton.cdiv`` is a constexpr function, whose wrapper unwraps
    each argument on every host call (~5 us; an eager LLSA forward + backward made ~30 such calls)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), for the launchers' host code (see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def custom_op(name: str, mutates_args: tuple[str, ...] = ()):
    """``torch.library.custom_op`` in this library's namespace, wrapped in a ``KernelOp`` (a decorator).

    Tagged ``needs_exact_strides``: Inductor must hand every op its inputs with the strides eager mode gives them.
    The launchers index some inputs implicitly (LSE, Δ, lists, pooled gradients: contiguous rows), so a buffer that
    Inductor padded for alignment (it pads rows of over 1,024 elements to 128 bytes on the GPU) or laid out in
    another order would be read wrongly. Explicit, whatever the installed torch's default for custom ops is.
    """

    def wrap(launcher) -> KernelOp:
        op = torch.library.custom_op(
            f"{NAMESPACE}::{name}", mutates_args=mutates_args, tags=(torch.Tag.needs_exact_strides,)
        )(launcher)
        return KernelOp(launcher, op)

    return wrap


# Tensors that depend only on shapes, kept for eager calls (``shape_constant``): at most this many, the oldest dropped.
SHAPE_CONSTANTS_KEPT = 64
_shape_constants: dict = {}


def shape_constant(key: tuple, device: torch.device, make):
    """``make()``: a tensor (or a tuple of them) on ``device`` that depends only on ``key`` (sizes, dtypes), made once
    and kept for eager calls. For the index tensors of the lists' transposes (``blocks.csr_to_csc``, ``shared_csc``)
    and LLSA's bank weights: each is an ``arange`` or two, or a few fills, whose launches a host-bound eager backward
    paid on every call. Made anew, not kept, where calls are traced (torch.compile, a dispatch mode: a kept tensor
    would be state they do not see) or captured in a CUDA graph. The caller must not write into it."""
    if _traced() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return make()
    kept = _shape_constants.get((key, device))
    if kept is None:
        with torch.inference_mode(False):  # a normal tensor even if the first call samples under inference mode
            kept = make()
        if device.type == "cuda":  # made on this stream: finished before another stream can read it
            torch.cuda.current_stream(device).synchronize()
        if len(_shape_constants) >= SHAPE_CONSTANTS_KEPT:
            del _shape_constants[next(iter(_shape_constants))]
        _shape_constants[(key, device)] = kept
    return kept

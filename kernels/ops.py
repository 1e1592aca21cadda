"""The kernels' torch custom ops: ``custom_op(name, mutates_args)`` registers a launcher as ``pixdit::name``.

As custom ops, the launchers are opaque to torch.compile, which traces everything around them (see the package
docstring); each comes with a fake-tensor rule (``register_fake``: output shapes and dtypes without running it) and
declares the arguments it writes into. The namespace is ``pixdit`` for the installed library; a second copy of the
library loaded under another package name (two kernel versions interleaved in one process, scripts/kernel_ab.py)
registers its ops under that name instead of clashing with the installed ones.
"""

from __future__ import annotations

import re

import torch

NAMESPACE = "pixdit" if __package__ == "pixdit.kernels" else re.sub(r"\W", "_", __package__ or "kernels")


def custom_op(name: str, mutates_args: tuple[str, ...] = ()):
    """``torch.library.custom_op`` in this library's namespace (a decorator).

    Tagged ``needs_exact_strides``: Inductor must hand every op its inputs with the strides eager mode gives them.
    The launchers index some inputs implicitly (LSE, Δ, lists, pooled gradients: contiguous rows), so a buffer that
    Inductor padded for alignment (it pads rows of over 1,024 elements to 128 bytes on the GPU) or laid out in
    another order would be read wrongly. Explicit, whatever the installed torch's default for custom ops is.
    """
    return torch.library.custom_op(
        f"{NAMESPACE}::{name}", mutates_args=mutates_args, tags=(torch.Tag.needs_exact_strides,)
    )

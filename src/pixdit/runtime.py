"""What training, evaluation and the benchmarks share about the process they run in, each defined once:

* seeds: ``mixed_seed(*numbers)`` turns a tuple such as (seed, rank, step) or (seed, sample index) into one
  well-mixed generator seed; ``noise_for_indices`` draws the noise of numbered samples from it, so sample ``i`` gets
  the same noise whatever the batch size, rank or device (the validation loss, FID samples);
* ``rank_and_world_size()`` of the default process group ((0, 1) without one); ``is_rank_zero()``: whether this
  process is the first of its job, from the launchers' environment (before any process group exists);
* precision names: ``PRECISIONS`` (fp32 / bf16 / fp16 -> the autocast dtype), ``resolve_precision`` (``auto`` and
  Lightning's trainer precision -> one of them) and ``autocast(device, precision)``;
* torch.compile: ``resolve_compile`` (``compile: auto``) and ``set_compile_memory_budget`` (how much of the forward
  the compiled backward may recompute to keep fewer activations).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

import numpy as np
import torch

from pixdit.errors import PixditError


# ----------------------------------------------------------------------------------------------- seeds
def mixed_seed(*numbers: int) -> int:
    """A well-mixed 63-bit seed from a tuple of non-negative ints (numpy's SeedSequence hashing)."""
    return int(np.random.SeedSequence([int(n) for n in numbers]).generate_state(1, dtype=np.uint64)[0] >> 1)


def noise_for_indices(indices: Sequence[int], shape: Sequence[int], seed: int) -> torch.Tensor:
    """Standard-normal noise [len(indices), *shape] (float32, CPU); row k depends only on (seed, indices[k])."""
    generator = torch.Generator(device="cpu")
    rows = []
    for index in indices:
        generator.manual_seed(mixed_seed(seed, index))
        rows.append(torch.randn(tuple(shape), generator=generator, dtype=torch.float32))
    return torch.stack(rows)


# ----------------------------------------------------------------------------------------------- ranks
def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default torch.distributed process group; (0, 1) when there is none."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID")  # set by Lightning / torchrun / srun


def is_rank_zero() -> bool:
    """True in the first process of a job (and in a job of one process): what writes a run's shared files."""
    return all(os.environ.get(name, "0") == "0" for name in RANK_VARIABLES)


# ----------------------------------------------------------------------------------------------- precision
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # name -> autocast dtype (None: off)
# Lightning's Trainer(precision=...) -> the name above.
TRAINER_PRECISIONS = {
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "bf16": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
    "16": "fp16",
    "32-true": "fp32",
    "32": "fp32",
    "64-true": "fp32",
}


def resolve_precision(
    precision: str, device: torch.device | str, trainer_precision: str | None = None, key: str = "precision"
) -> str:
    """``precision`` (config key ``key``) as one of PRECISIONS. ``auto``: the trainer's precision when there is a
    trainer, else bf16 on CUDA and fp32 elsewhere."""
    if precision == "auto":
        if trainer_precision is not None:
            return TRAINER_PRECISIONS.get(str(trainer_precision), "fp32")
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    if precision not in PRECISIONS:
        raise PixditError(f"{key}={precision!r}; allowed: auto, {', '.join(PRECISIONS)}")
    return precision


def autocast(device: torch.device | str, precision: str):
    """The autocast context of a precision name (a no-op for fp32)."""
    dtype = PRECISIONS[resolve_precision(precision, device)]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def resolve_compile(compile_option, accelerator: str) -> bool:
    """``compile``: true / false, or auto = on when the work runs on a CUDA GPU (``accelerator``: the trainer's
    accelerator or a device type). There torch.compile fuses the elementwise work around the matmuls and attention
    kernels (qk-norm, RoPE, adaLN, GELU, layouts): 1.8x the tokens/s of eager for DiT-S with LLSA
    (docs/benchmarks.md), after 1-2 minutes of compilation; on CPU it only costs time."""
    if isinstance(compile_option, bool):
        return compile_option
    if compile_option != "auto":
        raise PixditError(f"compile={compile_option!r} is not allowed; use true, false or auto (on for CUDA GPUs)")
    return accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available()


def check_compile_memory_budget(fraction, name: str = "compile_memory_budget") -> float:
    """``fraction`` as a float when it is a number in (0, 1], else a PixditError naming ``name`` (see
    ``set_compile_memory_budget``)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise PixditError(
            f"{name}={fraction!r} must be a number in (0, 1]: the share of activations the compiled step may keep "
            f"(1 = torch's default; lower recomputes more in the backward to use less memory, e.g. 0.9)"
        )
    return float(fraction)


def set_compile_memory_budget(fraction, name: str = "compile_memory_budget") -> float:
    """Set torch.compile's activation memory budget for the backward passes compiled after this call, and return it.

    ``fraction`` in (0, 1]: 1 (torch's default) keeps every activation its partitioner would keep for speed; below
    1 the compiled backward recomputes more of the forward (elementwise ops, and matmuls when needed) to keep fewer.
    Measured on one H200 (DiT-S, LLSA, 256², docs/scaling.md): 0.9 took the peak from 55.4 to 44.1 GB for 9% more
    time per step. A process-wide torch setting (``torch._functorch.config.activation_memory_budget``, the knob
    torch.compile exposes for this), read when a graph is compiled. ``name`` is the key the error message names.
    """
    fraction = check_compile_memory_budget(fraction, name)
    from torch._functorch import config as functorch_config

    functorch_config.activation_memory_budget = fraction
    return fraction

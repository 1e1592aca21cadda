"""What training, evaluation and the benchmarks share about the process they run in, each defined once:

* seeds: ``mixed_seed(*numbers)`` turns a tuple such as (seed, rank, step) or (seed, sample index) into one
  well-mixed generator seed; ``noise_for_indices`` draws the noise of numbered samples from it, so sample ``i`` gets
  the same noise whatever the batch size, rank or device (the validation loss, FID samples);
* ``rank_and_world_size()`` of the default process group ((0, 1) without one); ``is_rank_zero()``: whether this
  process is the first of its job, from the launchers' environment (before any process group exists);
* precision names: ``PRECISIONS`` (fp32 / bf16 / fp16 -> the autocast dtype), ``resolve_precision`` (``auto`` and
  Lightning's trainer precision -> one of them) and ``autocast(device, precision)``.
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

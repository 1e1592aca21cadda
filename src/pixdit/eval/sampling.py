"""Sample generation for evaluation: per-index seeding, class balance, rank sharding, OOM-safe batching.

Sample `i` is a pure function of (seed, i): its noise comes from a CPU generator seeded by (seed, i) and its class
label is `i % num_classes`. So the set of images does not depend on the number of GPUs, the batch size or the order
in which ranks process their indices, and two evaluations with disjoint index ranges use disjoint noise
(`seeds=3` in scripts/evaluate.py uses indices [0, N), [N, 2N), [2N, 3N)).

    for indices, images in generate_uint8(ema_model, flow, rank_indices(50_000, rank, world_size), ...):
        ...  # images: uint8 [b, 3, H, W]
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from pixdit.errors import PixditError
from pixdit.eval.inception import images_to_uint8

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def sample_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit generator seed for sample `index` of an evaluation seeded with `seed`."""
    state = np.random.SeedSequence([int(seed), int(index)]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def noise_for_indices(indices: Sequence[int], shape: Sequence[int], seed: int) -> torch.Tensor:
    """Standard-normal noise [len(indices), *shape] (float32, CPU); row k depends only on (seed, indices[k])."""
    generator = torch.Generator(device="cpu")
    rows = []
    for index in indices:
        generator.manual_seed(sample_seed(seed, index))
        rows.append(torch.randn(tuple(shape), generator=generator))
    return torch.stack(rows)


def labels_for_indices(indices: Sequence[int], num_classes: int) -> torch.Tensor | None:
    """Class-balanced labels `index % num_classes` (equal count per class over any num_classes consecutive indices);
    None for unconditional models (num_classes == 0)."""
    if num_classes <= 0:
        return None
    return torch.as_tensor(list(indices), dtype=torch.int64) % num_classes


def rank_indices(num_samples: int, rank: int = 0, world_size: int = 1, offset: int = 0) -> list[int]:
    """The sample indices rank `rank` generates: offset + rank, offset + rank + world_size, ... < offset + num_samples."""
    return list(range(offset + rank, offset + num_samples, world_size))


def autocast_context(device: torch.device, precision: str):
    if precision not in PRECISIONS:
        raise PixditError(f"precision={precision!r} is not supported; allowed: {sorted(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def generate_uint8(
    model: torch.nn.Module,
    flow,
    indices: Sequence[int],
    *,
    image_size: Sequence[int],
    seed: int,
    steps: int,
    sampler: str = "euler",
    cfg_interval: Sequence[float] | None = None,
    cfg_scale: float = 1.0,
    num_classes: int = 0,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    channels: int = 3,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (indices int64 [b], uint8 images [b, 3, H, W] on CPU) for `indices`, `batch_size` at a time.

    On CUDA out-of-memory the batch is retried at half the size (results do not depend on the batch size), so an
    evaluation inside a training run degrades to smaller batches instead of killing the run.
    """
    device = torch.device(device)
    height, width = int(image_size[0]), int(image_size[1])
    indices = list(indices)
    start = 0
    while start < len(indices):
        chunk = indices[start : start + batch_size]
        noise = noise_for_indices(chunk, (channels, height, width), seed).to(device)
        labels = labels_for_indices(chunk, num_classes)
        labels = labels.to(device) if labels is not None else None
        try:
            with autocast_context(device, precision):
                images = flow.sample(model, noise, steps, y=labels, cfg_scale=cfg_scale, sampler=sampler,
                                     cfg_interval=cfg_interval)
        except torch.cuda.OutOfMemoryError:
            if batch_size == 1:
                raise
            del noise, labels
            torch.cuda.empty_cache()
            batch_size = max(1, batch_size // 2)
            continue
        yield torch.as_tensor(chunk, dtype=torch.int64), images_to_uint8(images).cpu()
        start += len(chunk)

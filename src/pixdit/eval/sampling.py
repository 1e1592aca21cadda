"""Sample generation for evaluation: per-index seeding, class balance, rank sharding, OOM-safe batching.

Sample `i` is a pure function of (seed, i): its noise comes from a CPU generator seeded by (seed, i)
(``pixdit.runtime.noise_for_indices``, the same per-index noise as the validation loss) and its class
label is `i % num_classes`. So the set of images does not depend on the number of GPUs, the batch size or the order
in which ranks process their indices, and two evaluations with disjoint index ranges use disjoint noise
(`seeds=3` in scripts/evaluate.py uses indices [0, N), [N, 2N), [2N, 3N)).

    for indices, images in generate_uint8(ema_model, flow, rank_indices(50_000, rank, world_size), ...):
        ...  # images: uint8 [b, 3, H, W]
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from pixdit.eval.inception import images_to_uint8
from pixdit.runtime import autocast, noise_for_indices


def labels_for_indices(indices: Sequence[int], num_classes: int) -> torch.Tensor | None:
    """Class-balanced labels `index % num_classes` (equal count per class over any num_classes consecutive indices);
    None for unconditional models (num_classes == 0)."""
    if num_classes <= 0:
        return None
    return torch.as_tensor(list(indices), dtype=torch.int64) % num_classes


def rank_indices(num_samples: int, rank: int = 0, world_size: int = 1, offset: int = 0) -> list[int]:
    """The sample indices rank `rank` generates: offset + rank, offset + rank + world_size, ... < offset + num_samples."""
    return list(range(offset + rank, offset + num_samples, world_size))


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
            with autocast(device, precision):
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

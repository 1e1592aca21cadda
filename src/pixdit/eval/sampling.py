"""Sample generation for evaluation: per-index seeding, class balance, rank sharding, OOM-safe batching, and the
fast path (a compiled forward at one static batch shape; the batch sized from free GPU memory).

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

from pixdit.errors import PixditError
from pixdit.eval.inception import images_to_uint8
from pixdit.runtime import autocast, noise_for_indices

AUTO_BATCH_CAP = 256  # "auto" batches stop here: throughput is flat long before (the GPU is full at ~1M tokens)
AUTO_BATCH_MEMORY_SHARE = 0.6  # of the free memory, for the activations of one forward (the rest: fragmentation,
# the compiled graph's own buffers, Inception features)


def check_batch_size(value, name: str = "batch_size") -> int | str:
    """A positive int or "auto" (cheap: call before any work)."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise PixditError(
        f"{name}={value!r} must be a positive int or auto (the largest batch that fits in free GPU memory, "
        f"at most {AUTO_BATCH_CAP})"
    )


# Inductor options of the compiled sampler, on top of its mode's. Multi-kernel reductions: where Inductor's heuristic
# would loop over a row (the LayerNorm + modulation after each block's attention: 384 values, but fused reads that
# make its reduction hint not INNER), it builds the persistent and the looped kernel and keeps the faster at the first
# call (cached on disk per machine). One H200, DiT-S LLSA 256², a compiled forward of 32 images, one process: 1.040x
# (that kernel 31.3 -> 13.3 ms of 388). A compiled training step gained nothing (1.003x, within noise), so training
# keeps Inductor's defaults (docs/kernel_notes.md v32). No FX graph cache: with torch 2.11 + Triton 3.6, a process
# that loads a compiled graph holding multi-kernels from Inductor's on-disk cache (the second evaluation on a
# machine) crashes while it looks up the cached pick (``TypeError: 'NoneType' object does not support the context
# manager protocol`` from Triton's ``JITFunction.cache_key``); a graph built in the process itself is fine. So each
# process generates the sampler's code anew (Triton's compiled kernels still come from its cache): at most ~40 s
# once per evaluation (docs/kernel_notes.md v33).
SAMPLING_INDUCTOR_OPTIONS = {"triton.multi_kernel": 1, "fx_graph_cache": False}


def sampling_model(model: torch.nn.Module, device, compile: bool, mode: str | None = None) -> torch.nn.Module:
    """The model as the sampler calls it. With ``compile`` on a CUDA device it is compiled in place (once: later
    calls, e.g. the next FID evaluation of a training run, reuse it) for static shapes, with
    ``SAMPLING_INDUCTOR_OPTIONS``; ``generate_uint8`` pads the last batch so one shape serves a whole evaluation.
    ``mode``: torch.compile's mode (None: the default one)."""
    if compile and torch.device(device).type == "cuda" and getattr(model, "_compiled_call_impl", None) is None:
        from torch._inductor import list_mode_options  # what torch.compile's ``mode`` stands for

        # torch.compile takes a mode or options, not both: the mode's own options, then ours
        options = {**list_mode_options(mode or "default"), **SAMPLING_INDUCTOR_OPTIONS}
        model.compile(dynamic=False, options=options)
    return model


@torch.no_grad()
def auto_batch_size(
    model: torch.nn.Module,
    image_size: Sequence[int],
    device,
    precision: str,
    num_classes: int = 0,
    channels: int = 3,
    probe: int = 2,
    guided: bool = False,
) -> int:
    """The largest batch whose forward activations fit in ``AUTO_BATCH_MEMORY_SHARE`` of the free GPU memory,
    measured with one eager forward at batch ``probe`` (a compiled forward needs less: the estimate errs on the safe
    side), capped at ``AUTO_BATCH_CAP``. ``guided``: classifier-free guidance runs the model on twice the batch
    (DiT.forward_with_cfg), so half as many images fit. On CPU: the cap. Out-of-memory later still halves the batch."""
    device = torch.device(device)
    if device.type != "cuda":
        return AUTO_BATCH_CAP
    x = torch.randn(probe, channels, *image_size, device=device)
    t = torch.full((probe,), 500.0, device=device)
    y = torch.zeros(probe, dtype=torch.int64, device=device) if num_classes > 0 else None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with autocast(device, precision):
        model.forward(x, t, y)  # .forward: the eager function even when the module is compiled in place
    per_image = max(1, torch.cuda.max_memory_allocated(device) - base) / probe * (2 if guided else 1)
    # free to this process: the device's free memory plus what PyTorch's allocator holds but does not use
    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(max(1, min(AUTO_BATCH_CAP, AUTO_BATCH_MEMORY_SHARE * free // per_image)))


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
    batch_size: int | str = 64,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    channels: int = 3,
    compile: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (indices int64 [b], uint8 images [b, 3, H, W] on CPU) for `indices`, `batch_size` at a time.

    ``batch_size="auto"``: sized from free GPU memory (``auto_batch_size``). ``compile``: the model's forward is
    compiled (CUDA only, ``sampling_model``) and every batch has the same shape (the last one is padded with copies
    of its first noise; the copies are dropped). On CUDA out-of-memory the batch is retried at half the size (results
    do not depend on the batch size), so an evaluation inside a training run degrades to smaller batches instead of
    killing the run.
    """
    device = torch.device(device)
    height, width = int(image_size[0]), int(image_size[1])
    indices = list(indices)
    check_batch_size(batch_size)
    if batch_size == "auto":
        batch_size = auto_batch_size(
            model, (height, width), device, precision, num_classes, channels, guided=cfg_scale != 1.0
        )
    batch_size = min(batch_size, max(1, len(indices)))
    model = sampling_model(model, device, compile)
    start = 0
    while start < len(indices):
        chunk = indices[start : start + batch_size]
        noise = noise_for_indices(chunk, (channels, height, width), seed).to(device)
        labels = labels_for_indices(chunk, num_classes)
        labels = labels.to(device) if labels is not None else None
        pad = batch_size - len(chunk) if compile else 0  # one static shape for the compiled forward
        if pad:
            noise = torch.cat([noise, noise[:1].expand(pad, -1, -1, -1)])
            labels = torch.cat([labels, labels[:1].expand(pad)]) if labels is not None else None
        try:
            with autocast(device, precision):
                images = flow.sample(
                    model, noise, steps, y=labels, cfg_scale=cfg_scale, sampler=sampler, cfg_interval=cfg_interval
                )
        except torch.cuda.OutOfMemoryError:
            if batch_size == 1:
                raise
            del noise, labels
            torch.cuda.empty_cache()
            batch_size = max(1, batch_size // 2)
            continue
        yield torch.as_tensor(chunk, dtype=torch.int64), images_to_uint8(images[: len(chunk)]).cpu()
        start += len(chunk)

"""Exponential moving average (EMA) of a model's weights, with the LLSA recipe's warm-up (docs/algorithms.md).

At the n-th update (n = 1, 2, ...) the decay is ``min(max_decay, 1 - n ** -power)`` (max_decay 0.9999, power 3/4), so the
first update copies the weights (decay 0) and the average lengthens as training goes on (~0.9997 after 44k updates).
Each update does ``ema <- ema - (1 - decay) * (ema - weights)``, i.e. ``lerp(ema, weights, 1 - decay)``.

The average lives in an fp32 copy of the model (``ema.model``) that never needs gradients: sample and evaluate with it
directly (``flow.sample(ema.model, ...)``). ``EMA`` is an ``nn.Module``, so it moves with ``.to(device)`` and its
weights and update count are part of the owner's ``state_dict`` (checkpoints save and restore it for free).

    ema = EMA(model)            # once, before training
    ema.update(model)           # after every optimizer step
    images = flow.sample(ema.model, noise, steps=20)

Under FSDP (trainer=fsdp) the model's parameters are shards; ``update`` gathers each one whole first, so every GPU
holds the same full EMA.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def whole(parameter: torch.Tensor) -> torch.Tensor:
    """The full tensor of a parameter that FSDP (trainer=fsdp) shards over the GPUs (an all-gather: every rank must
    call it), else the parameter itself. The EMA is kept whole on every GPU (pixdit.fsdp says why)."""
    return parameter.full_tensor() if isinstance(parameter, DTensor) else parameter


class EMA(nn.Module):
    """fp32 EMA copy of ``model``; ``update(model)`` after each optimizer step."""

    def __init__(self, model: nn.Module, max_decay: float = 0.9999, power: float = 0.75):
        super().__init__()
        self.max_decay = float(max_decay)
        self.power = float(power)
        self.model = copy.deepcopy(model).float().eval().requires_grad_(False)
        # A buffer so it is saved with the weights and restored on resume; `_count` is its host-side copy, which the
        # per-step update reads (reading the buffer would make the CPU wait for the GPU after every optimizer step).
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64))
        self._count = 0

    def decay(self, n: int) -> float:
        """Decay used by the n-th update (n >= 1)."""
        return min(self.max_decay, 1.0 - n**-self.power)

    @torch.no_grad()
    def update(self, model: nn.Module) -> float:
        """Move the average towards ``model``'s current weights; returns the decay used."""
        self._count += 1
        self.num_updates.fill_(self._count)
        decay = self.decay(self._count)
        ema_params = list(self.model.parameters())
        params = [whole(p).detach().to(torch.float32) for p in model.parameters()]
        if len(ema_params) != len(params):
            raise RuntimeError(f"EMA holds {len(ema_params)} parameters but the model has {len(params)}")
        torch._foreach_lerp_(ema_params, params, 1.0 - decay)
        # Buffers (e.g. RoPE tables) are not averaged: they are copied.
        for ema_buffer, buffer in zip(self.model.buffers(), model.buffers()):
            ema_buffer.copy_(buffer)
        return decay

    @torch.no_grad()
    def reset(self, model: nn.Module) -> None:
        """Start the average again from ``model``'s weights (update count 0), e.g. after ``init_from``."""
        for ema_param, param in zip(self.model.parameters(), model.parameters()):
            ema_param.copy_(whole(param))
        for ema_buffer, buffer in zip(self.model.buffers(), model.buffers()):
            ema_buffer.copy_(buffer)
        self.num_updates.zero_()
        self._count = 0

    @property
    def update_count(self) -> int:
        """Number of updates so far (the decay of the last one is ``decay(update_count)``)."""
        return self._count

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._count = int(self.num_updates)  # resume: the host-side count follows the loaded buffer

    def train(self, mode: bool = True) -> EMA:
        # The averaged model always stays in eval mode (no dropout), whatever its owner does.
        super().train(mode)
        self.model.eval()
        return self

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

"""Activation checkpointing of the DiT (``model.grad_checkpointing``): which parts of which blocks recompute their
activations in the backward pass instead of keeping them from the forward pass.

    python train.py ... model.grad_checkpointing=true        # every block: keeps only each block's input
    python train.py ... model.grad_checkpointing=8           # the first 8 blocks (their activations live longest)
    python train.py ... model.grad_checkpointing=mlp         # in every block, only the MLP (fc1 -> GELU -> fc2)
    python train.py ... model.grad_checkpointing=attention   # in every block, only the attention (qkv -> kernel -> proj)

It is applied from outside the model's math: ``apply_grad_checkpointing`` replaces the ``forward`` of the chosen
modules by one that runs the class's own ``forward`` under ``torch.utils.checkpoint`` (non-reentrant, RNG state
preserved), so values and gradients are exactly those of the model without it. Module and parameter names do not
change (unlike a wrapper module), so checkpoints, the EMA copy (``copy.deepcopy`` rebinds the replaced forward to the
copy) and FSDP's per-block sharding see the same model. Without gradients (sampling, validation) nothing is recomputed.

What each setting keeps and costs: docs/scaling.md ("Memory"); the estimate of pixdit.memory follows this plan.
"""

from __future__ import annotations

import functools
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pixdit.errors import PixditError

# Policy name -> the DiTBlock submodule it recomputes ("block" = the whole block).
POLICIES = {"all": "block", "mlp": "mlp", "attention": "attn"}


def grad_checkpointing_plan(value, depth: int) -> dict[int, str]:
    """``model.grad_checkpointing`` -> {block index: "block" | "mlp" | "attn"} (what that block recomputes).

    false / null: nothing; true or "all": every whole block; an int N in 0..depth: the first N whole blocks;
    "mlp" / "attention": that part of every block. Anything else is a PixditError naming the allowed values."""
    allowed = (
        f"false, true (every block), an int from 0 to {depth} (the first N of the model's {depth} blocks), "
        f"'mlp' (only the MLP of each block) or 'attention' (only the attention of each block)"
    )
    if value is None or value is False:
        return {}
    if value is True:
        return dict.fromkeys(range(depth), "block")
    if isinstance(value, int):
        if not 0 <= value <= depth:
            raise PixditError(f"model.grad_checkpointing={value} is out of range; allowed: {allowed}")
        return dict.fromkeys(range(value), "block")
    if isinstance(value, str) and value in POLICIES:
        return dict.fromkeys(range(depth), POLICIES[value])
    raise PixditError(f"model.grad_checkpointing={value!r} is not allowed; use {allowed}")


def apply_grad_checkpointing(blocks: nn.ModuleList, plan: dict[int, str]) -> None:
    """Make the modules named by ``plan`` recompute their activations in the backward pass (in place)."""
    for index, part in plan.items():
        module = blocks[index] if part == "block" else getattr(blocks[index], part)
        module.forward = types.MethodType(_recomputed_forward, module)


def _recomputed_forward(self: nn.Module, *args, **kwargs):
    """The class's forward, under torch.utils.checkpoint when gradients are being recorded."""
    # a partial, not ``forward.__get__(self)``: torch 2.11's Dynamo cannot trace a function's __get__ (fullgraph)
    forward = functools.partial(type(self).forward, self)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)

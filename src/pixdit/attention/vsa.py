"""Trainable sparse attention backends: `llsa`, `vsa`, `sla` (thin wrappers over pixdit.kernels).

Each is selected with ``attention=<name>`` (configs/attention/<name>.yaml) and needs ``model.token_order=zorder`` so
that a block of 16 consecutive tokens is a 4x4 pixel patch (spec llsa.md §7). On CUDA tensors the kernels run Triton,
on CPU tensors an exact PyTorch path (slow; for tests). The interface is `pixdit.attention.AttentionBackend`.

    python train.py experiment=ffhq256_llsa attention.topk=16 attention.num_levels=2

Tests: ``.venv/bin/python -m pytest tests/test_attention.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from pixdit.attention import AttentionBackend, register_attention
from pixdit.errors import PixditError


def _kernel(function_name: str, backend_name: str):
    """The kernel library function, or a PixditError saying it is not available yet."""
    try:
        import pixdit.kernels as kernels
    except ImportError as error:  # pragma: no cover - the package is part of the install
        raise PixditError(f"attention={backend_name} needs pixdit.kernels, "
                          f"which cannot be imported ({error})") from None
    function = getattr(kernels, function_name, None)
    if function is None:
        raise PixditError(f"attention={backend_name} is not implemented yet (pixdit.kernels.{function_name} is "
                          f"missing in this version); use attention=full")
    return function


@register_attention("llsa")
class LLSAAttention(AttentionBackend):
    """Log-linear sparse attention (spec llsa.md §1-§3): hierarchical top-K block selection + KV enrichment, through
    `pixdit.kernels.llsa_attention` (Triton on CUDA, exact PyTorch gather form on CPU).

    block_size (B):     tokens pooled per level (16 = 4x4 pixel patches in Z-order); a power of two >= 16
    topk (K):           blocks kept per query block at every level (an int, or a list, one per level, finest first)
    num_levels (L):     pooled levels; null = paper formula floor(log_B N - 1) (clamped to >= 1) for each grid
    enrich_levels (Le): pooled levels 1..Le whose tokens enter the softmax; null = all L levels, 0 = none
    reference_l1_grad:  reproduce the reference l1 kernel's pooled-K/V gradient, B times too small (spec §6.2)
    """

    token_order = "zorder"

    def __init__(self, dim: int, num_heads: int, block_size: int = 16, topk: int | list[int] = 8,
                 num_levels: int | None = None, enrich_levels: int | None = None, reference_l1_grad: bool = False):
        super().__init__(dim, num_heads)
        self.block_size = block_size
        self.topk = list(topk) if isinstance(topk, (list, tuple)) else topk
        self.num_levels = num_levels
        self.enrich_levels = enrich_levels
        self.reference_l1_grad = bool(reference_l1_grad)
        self._llsa_attention = _kernel("llsa_attention", "llsa")
        self._llsa_check = _kernel("llsa_check", "llsa")

    def check_grid(self, grid_hw):
        num_tokens = grid_hw[0] * grid_hw[1]
        try:
            self._llsa_check(num_tokens, block_size=self.block_size, num_levels=self.num_levels, topk=self.topk,
                             enrich_levels=self.enrich_levels)
        except (ValueError, TypeError) as error:
            raise PixditError(f"attention=llsa cannot handle a {grid_hw[0]}x{grid_hw[1]} token grid "
                              f"({num_tokens} tokens): {error}") from None

    def forward(self, q, k, v, *, grid_hw, hidden):
        return self._llsa_attention(q, k, v, block_size=self.block_size, topk=self.topk, num_levels=self.num_levels,
                                    enrich_levels=self.enrich_levels, reference_l1_grad=self.reference_l1_grad)

    def extra_repr(self) -> str:
        return (f"block_size={self.block_size}, topk={self.topk}, num_levels={self.num_levels}, "
                f"enrich_levels={self.enrich_levels}")


class ZeroInitLinear(nn.Module):
    """``y = x W^T + b`` with W starting at zero and b at ``bias_value`` (0: VSA's gate G_c and SLA's Proj, so the
    method starts as its sparse part; 1: VSA's optional fine gate G_f, which starts as the identity).

    Deliberately not an ``nn.Linear``: ``DiT.initialize_weights`` re-initialises every ``nn.Linear`` with xavier, which
    would silently undo the init the methods require (vsa.md §2.2, sla.md §2.3). Same state-dict keys."""

    def __init__(self, in_features: int, out_features: int, bias_value: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.bias = nn.Parameter(torch.full((out_features,), float(bias_value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]}"


def _check_kernel_options(backend_name: str, head_dim: int, block_size: int, call) -> None:
    """Validate a backend's options once at build time by running its kernel on a tiny CPU input (the kernels own
    the rules: allowed block sizes, head dims, K, scopes...); their ValueError/TypeError becomes a PixditError."""
    x = torch.zeros(1, 1, block_size if isinstance(block_size, int) and block_size > 0 else 1, head_dim)
    try:
        call(x)
    except (ValueError, TypeError) as error:
        raise PixditError(f"attention={backend_name}: {error}") from None


def vsa_annealed_topk(step: int, num_tiles: int, target_topk: int, anneal_every: int, anneal_rate: float) -> int:
    """Dense-to-sparse schedule for fine-tuning a dense checkpoint (spec vsa.md §2.2, FastVideo's rule): the sparsity
    grows by ``anneal_rate`` every ``anneal_every`` steps from 0 (all tiles) until the target K is reached.
    ``anneal_every = 0``: the target K from step 0."""
    if anneal_every <= 0:
        return target_topk
    from pixdit.kernels.vsa import topk_from_fraction  # the kernels' K rule: clamp(ceil(fraction * T), 1, T)

    sparsity = min(1.0, (step // anneal_every) * anneal_rate)
    return max(target_topk, topk_from_fraction(1.0 - sparsity, num_tiles))


@register_attention("vsa")
class VSAAttention(AttentionBackend):
    """Video Sparse Attention on 2-D tiles (spec vsa.md) through `pixdit.kernels.vsa_attention`: coarse attention
    between tile means + exact fine attention to the top-K tiles of each query tile, output = fine + gate * coarse.

    block_size (C):  tokens per tile (16 = 4x4 pixels in Z-order; 16, 32 or 64)
    topk (K):        key tiles kept per query tile (clamped to the number of tiles); or
    sparsity:        instead of topk, the fraction of tiles dropped: K = clamp(ceil((1 - sparsity) * T), 1, T)
    gate:            true = G_c = Linear(dim, dim) of the modulated hidden states, zero-initialised (VSA starts as
                     its fine stage, spec §2.2); false = coarse output added ungated
    fine_gate:       true = also the paper's G_f = Linear(dim, dim) on the fine output, W = 0 and b = 1 (starts as
                     no gate; experimental: the paper gives no init, FastVideo drops it); false (default) = G_f = 1
    anneal_every, anneal_rate: dense-to-sparse schedule for fine-tuning a dense checkpoint (spec §2.2): the sparsity
                     grows by anneal_rate every anneal_every optimizer steps from 0 (dense) to the target K;
                     anneal_every = 0 (default) = target K from step 0. Needs the training loop to call
                     ``set_training_step(global_step)`` on the backend (the step is stored in the state dict).
    """

    token_order = "zorder"

    def __init__(self, dim: int, num_heads: int, block_size: int = 16, topk: int | None = 32,
                 sparsity: float | None = None, gate: bool = True, anneal_every: int = 0, anneal_rate: float = 0.02,
                 fine_gate: bool = False):
        super().__init__(dim, num_heads)
        self._vsa_attention = _kernel("vsa_attention", "vsa")
        self.block_size, self.topk, self.sparsity = block_size, topk, sparsity
        _check_kernel_options("vsa", self.head_dim, block_size,
                              lambda x: self._vsa_attention(x, x, x, block_size=block_size, topk=topk,
                                                            sparsity=sparsity))
        if isinstance(anneal_every, bool) or not isinstance(anneal_every, int) or anneal_every < 0:
            raise PixditError(f"attention=vsa: anneal_every must be an int >= 0 (0 = no annealing), "
                              f"got {anneal_every!r}")
        if not isinstance(anneal_rate, (int, float)) or not 0 < anneal_rate <= 1:
            raise PixditError(f"attention=vsa: anneal_rate must be a float in (0, 1], got {anneal_rate!r}")
        self.anneal_every, self.anneal_rate = anneal_every, float(anneal_rate)
        for name, value in (("gate", gate), ("fine_gate", fine_gate)):
            if not isinstance(value, bool):
                raise PixditError(f"attention=vsa: {name} must be true or false, got {value!r}")
        self.gate = ZeroInitLinear(dim, dim) if gate else None
        self.fine_gate = ZeroInitLinear(dim, dim, bias_value=1.0) if fine_gate else None
        self.register_buffer("training_step", torch.zeros((), dtype=torch.long))
        self._step_was_set = False

    def set_training_step(self, step: int) -> None:
        """The optimizer step that drives the annealing schedule (call once per training step)."""
        self.training_step.fill_(int(step))
        self._step_was_set = True

    def current_topk(self, num_tokens: int) -> int:
        from pixdit.kernels.vsa import topk_from_fraction

        num_tiles = -(-num_tokens // self.block_size)
        target = min(self.topk, num_tiles) if self.topk is not None else \
            topk_from_fraction(1.0 - self.sparsity, num_tiles)
        if self.anneal_every and self.training and not self._step_was_set:
            raise PixditError("attention=vsa with anneal_every > 0 needs the training loop to call "
                              "set_training_step(global_step) on the attention backends")
        if not self.anneal_every:
            return target  # without annealing, do not read the step buffer (a GPU sync in every layer's forward)
        return vsa_annealed_topk(int(self.training_step), num_tiles, target, self.anneal_every, self.anneal_rate)

    def forward(self, q, k, v, *, grid_hw, hidden):
        b, h, n, d = q.shape

        def per_head(projection):     # [b, N, dim] -> [b, heads, N, head_dim], no activation (spec §7)
            return None if projection is None else projection(hidden).view(b, n, h, d).transpose(1, 2).to(q.dtype)

        return self._vsa_attention(q, k, v, block_size=self.block_size, topk=self.current_topk(n),
                                   gate=per_head(self.gate), gate_fine=per_head(self.fine_gate))

    def extra_repr(self) -> str:
        return (f"block_size={self.block_size}, topk={self.topk}, sparsity={self.sparsity}, "
                f"gate={self.gate is not None}, fine_gate={self.fine_gate is not None}, "
                f"anneal_every={self.anneal_every}")


@register_attention("sla")
class SLAAttention(AttentionBackend):
    """Sparse-Linear Attention (spec sla.md) through `pixdit.kernels.sla_attention`: exact softmax attention over the
    top-K ("critical") key blocks + linear attention over the rest, output = O_sparse + Proj(O_linear) with Proj a
    Linear(head_dim, head_dim) shared across heads, zero-initialised (SLA starts as block-sparse attention, §2.3).

    block_size:        tokens per block for queries and keys (16 = 4x4 pixels in Z-order; 16, 32 or 64)
    topk (K):          critical key blocks per query block (clamped to the number of blocks); or
    topk_ratio:        instead of topk, the fraction kept: K = clamp(ceil(topk_ratio * T), 1, T)
    linear_scope:      noncritical (the authors' SLA-1 code, default) | all (their current main) | marginal (paper)
    feature_map:       softmax (default) | elu (elu + 1) | relu
    negligible_ratio:  marginal scope only: the fraction of lowest-scoring blocks skipped entirely
    """

    token_order = "zorder"

    def __init__(self, dim: int, num_heads: int, block_size: int = 16, topk: int | None = 32,
                 topk_ratio: float | None = None, linear_scope: str = "noncritical", feature_map: str = "softmax",
                 negligible_ratio: float = 0.0):
        super().__init__(dim, num_heads)
        self._sla_attention = _kernel("sla_attention", "sla")
        self.options = dict(block_size=block_size, topk=topk, topk_ratio=topk_ratio, linear_scope=linear_scope,
                            feature_map=feature_map, negligible_ratio=negligible_ratio)
        _check_kernel_options("sla", self.head_dim, block_size, lambda x: self._sla_attention(x, x, x, **self.options))
        self.proj_linear = ZeroInitLinear(self.head_dim, self.head_dim)

    def forward(self, q, k, v, *, grid_hw, hidden):
        o_sparse, o_linear = self._sla_attention(q, k, v, **self.options)
        # fp32 master weights; under autocast F.linear runs in the autocast dtype (spec §8)
        projected = self.proj_linear(o_linear if torch.is_autocast_enabled(o_linear.device.type)
                                     else o_linear.to(self.proj_linear.weight.dtype))
        return o_sparse + projected.to(o_sparse.dtype)

    def extra_repr(self) -> str:
        return ", ".join(f"{key}={value}" for key, value in self.options.items())

"""Trainable sparse attention backends: `llsa`, `vsa`, `sla` (thin wrappers over pixdit.kernels).

Each is selected with ``attention=<name>`` (configs/attention/<name>.yaml) and needs ``model.token_order=zorder`` so
that a block of 16 consecutive tokens is a 4x4 pixel patch (spec llsa.md §7). On CUDA tensors the kernels run Triton,
on CPU tensors an exact PyTorch path (slow; for tests). The interface is `pixdit.attention.AttentionBackend`.

    python train.py experiment=ffhq256_llsa attention.topk=16 attention.num_levels=2

Tests: ``.venv/bin/python -m pytest tests/test_attention.py``.
"""

from __future__ import annotations

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


@register_attention("vsa")
class VSAAttention(AttentionBackend):
    """Video Sparse Attention on 2-D tiles (spec vsa.md): coarse attention between tile means + fine attention to the
    top-K tiles, output = fine + gate * coarse. The gate is a per-layer Linear(dim, dim) of the modulated hidden
    states, zero-initialised so that VSA starts as pure fine-stage sparse attention."""

    token_order = "zorder"

    def __init__(self, dim: int, num_heads: int, block_size: int = 16, topk: int = 32):
        super().__init__(dim, num_heads)
        self.block_size = int(block_size)
        self.topk = int(topk)
        self.gate = nn.Linear(dim, dim)
        nn.init.zeros_(self.gate.weight)
        nn.init.zeros_(self.gate.bias)
        self._vsa_attention = _kernel("vsa_attention", "vsa")
        raise PixditError("attention=vsa is not implemented yet (its backend arrives with the VSA issue); "
                          "use attention=full or attention=llsa")

    def forward(self, q, k, v, *, grid_hw, hidden):
        raise NotImplementedError("VSA backend: see __init__")


@register_attention("sla")
class SLAAttention(AttentionBackend):
    """Sparse-Linear Attention (spec sla.md): block-sparse softmax attention over the top-K key blocks + a linear
    attention branch passed through a Linear(head_dim, head_dim) shared across heads, zero-initialised so that SLA
    starts as pure block-sparse attention."""

    token_order = "zorder"

    def __init__(self, dim: int, num_heads: int, block_size: int = 16, topk: int = 32):
        super().__init__(dim, num_heads)
        self.block_size = int(block_size)
        self.topk = int(topk)
        self.proj_linear = nn.Linear(self.head_dim, self.head_dim)
        nn.init.zeros_(self.proj_linear.weight)
        nn.init.zeros_(self.proj_linear.bias)
        self._sla_attention = _kernel("sla_attention", "sla")
        raise PixditError("attention=sla is not implemented yet (its backend arrives with the SLA issue); "
                          "use attention=full or attention=llsa")

    def forward(self, q, k, v, *, grid_hw, hidden):
        raise NotImplementedError("SLA backend: see __init__")



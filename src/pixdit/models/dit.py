"""The pixel-space diffusion transformer (the LLSA paper's "RopeDiT", generalised; docs/algorithms.md, "The pixel DiT").

    image [b, 3, H, W] --patches [b, N, 3 p^2], N = (H/p) * (W/p), reordered once (token_order: auto = what the
      attention needs | raster | zorder)--> patch embed (the Conv2d's weights as one matmul)--> tokens [b, N, hidden]
      --> depth x DiTBlock (adaLN-Zero; attention = swappable backend with RMS qk-norm and 2-D RoPE whose positions
      follow the tokens) --> final adaLN + Linear --> undo the order once --> unpatchify --> velocity [b, 3, H, W]

Every block uses the configured attention backend, except the blocks listed in `attention.dense_blocks`, which keep
full attention (a per-layer schedule, e.g. sparse attention with dense first and last blocks; see
pixdit.attention.block_attention_configs).

Conditioning: sinusoidal embedding of t = 1000 * sigma -> MLP, plus (optional) a class embedding with a null class for
classifier-free guidance. `per_block_conditioning=True` gives each block its own timestep MLP (and class table) as the
LLSA reference does (35,177,859 parameters for the unconditional DiT-S); the default shares one, as DiT does.

    >>> from pixdit.models import build_model
    >>> model = build_model("DiT-S", input_size=(128, 128), attention={"name": "llsa"})   # token_order auto: zorder
    >>> model = build_model("DiT-S", attention={"name": "llsa", "dense_blocks": [0, 11]})  # full attention in 0 and 11
    >>> velocity = model(x_sigma, 1000 * sigma)                  # x_sigma: [b, 3, 128, 128], sigma: [b]

Differences from the LLSA reference (set `per_block_conditioning=True, zero_init=False` to reproduce its model):
shared timestep MLP by default; DiT's zero-init by default; label dropout drawn once per sample (not per block);
RoPE positions are the integer coordinates of the actual token grid (no `rope_size` resampling); any H x W.

Tests: ``.venv/bin/python -m pytest tests/test_model.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pixdit.attention import AttentionBackend, block_attention_configs, build_attention
from pixdit.errors import PixditError
from pixdit.kernels.adaln_joint import adaln_joint, adaln_joint_forward
from pixdit.kernels.qk_norm_rope import apply_rope, qk_norm_rope  # noqa: F401  (apply_rope: part of this API)
from pixdit.kernels.qkv_norm_rope import qkv_norm_rope, qkv_norm_rope_fits
from pixdit.models.checkpointing import apply_grad_checkpointing, grad_checkpointing_plan
from pixdit.tokens import (
    MODEL_TOKEN_ORDERS,
    check_token_order,
    resolve_token_order,
    token_coordinates,
    token_permutation,
)

ROPE_THETA = 10000.0


def joined_residuals() -> bool:
    """Whether the blocks add their residuals inside the LayerNorm joints that follow them (``DiTBlock.forward``):
    when training under torch.compile, where the joints' backward in one Triton pass pays. Eager mode and sampling
    keep the plain ops."""
    return torch.compiler.is_compiling() and torch.is_grad_enabled()


def gelu_tanh(h: torch.Tensor) -> torch.Tensor:
    """GELU, tanh form, computed in fp32 and rounded once to h's dtype. Eager: F.gelu (one ATen kernel). Compiled:
    written as h * sigmoid(2u), u = sqrt(2 / pi) (h + 0.044715 h^3), the same function (0.5 (1 + tanh u) =
    sigmoid(2u)), because Inductor lowers F.gelu's tanh to libdevice's accurate tanh, dozens of instructions an
    element, which made the GELU kernels of a compiled step compute-bound, and sigmoid to its fast exp (the forward
    kernel 1.39x, the backward 1.13x faster; docs/kernel_notes.md v38). The sigmoid form is also the more accurate
    one in the negative tail, where 1 + tanh(u) cancels."""
    if not torch.compiler.is_compiling():
        return F.gelu(h, approximate="tanh")
    x = h.float()
    return (x * torch.sigmoid(x * (1.5957691216057308 + 0.07135481627260025 * x * x))).to(h.dtype)


class PermuteTokens(torch.autograd.Function):
    """out = x[:, order] for a permutation `order`; the backward gathers with the inverse permutation instead of
    scatter-adding (a permutation's adjoint is its inverse): deterministic and as cheap as the forward."""

    @staticmethod
    def forward(ctx, x, order, inverse_order):
        ctx.save_for_backward(inverse_order)
        return x[:, order]

    @staticmethod
    def backward(ctx, grad):
        (inverse_order,) = ctx.saved_tensors
        return grad[:, inverse_order], None, None


# ------------------------------------------------------------------ 2-D rotary position embedding
def rope_cos_sin(rows: torch.Tensor, cols: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin [tokens, head_dim / 2] (fp32), one angle per interleaved pair (2j, 2j + 1) of the head dim.

    The first half of the head dim rotates with the row y, the second half with the column x; each axis has
    head_dim / 4 frequencies omega_j = theta ** (-j / (head_dim / 4)) (= 10000 ** (-j / 16) for head dim 64).
    """
    if head_dim % 4:
        raise PixditError(f"2-D RoPE needs a head dim divisible by 4, got {head_dim}")
    pairs_per_axis = head_dim // 4
    freqs = ROPE_THETA ** (-torch.arange(pairs_per_axis, dtype=torch.float64, device=rows.device) / pairs_per_axis)
    angles = torch.cat([rows.double()[:, None] * freqs, cols.double()[:, None] * freqs], dim=1)
    return angles.cos().float(), angles.sin().float()


# ------------------------------------------------------------------ conditioning
class TimestepEmbedder(nn.Module):
    """t (float, = 1000 * sigma) -> sinusoidal features [cos | sin] -> Linear -> SiLU -> Linear."""

    def __init__(self, hidden_size: int, frequency_size: int = 256):
        super().__init__()
        self.frequency_size = frequency_size
        self.mlp = nn.Sequential(nn.Linear(frequency_size, hidden_size), nn.SiLU(), nn.Linear(hidden_size, hidden_size))

    def sinusoidal(self, t: torch.Tensor) -> torch.Tensor:
        # As the LLSA reference: frequencies exp(-ln(1e4) * k / (half - 1)), k = 0..half-1, features [cos | sin].
        half = self.frequency_size // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / (half - 1))
        angles = t.float()[:, None] * freqs[None]
        return torch.cat([angles.cos(), angles.sin()], dim=-1)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        features = self.sinusoidal(t)
        return self.mlp(features.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class label -> vector; row `num_classes` is the null class (dropped labels, unconditional CFG branch)."""

    def __init__(self, num_classes: int, hidden_size: int):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(y)


# ------------------------------------------------------------------ transformer
class Attention(nn.Module):
    """Fused qkv projection -> RMS qk-norm (learnable per-channel weight shared across heads) -> 2-D RoPE ->
    attention backend -> output projection. The norm, RoPE and the split into [batch, heads, tokens, head_dim] are
    one Triton kernel on CUDA (pixdit.kernels.qk_norm_rope), the same PyTorch ops on CPU.

    A backend that starts from block means of q, k, v (``backend.pool_block``: LLSA's selection and pooled bank,
    VSA's selection and coarse stage, SLA's selection) gets them from that kernel, which has the rows in registers as
    it writes them: a separate pass would read q, k and v again (docs/benchmarks.md, "block means in the
    prologue"); only where the tokens are whole blocks. ``fuse_block_means`` turns it off for A/B benchmarks
    (``scripts/bench_sampling.py --means``, ``scripts/bench_train.py --means``); the backend then pools them itself.
    Without autograd (sampling), a backend that reads v in place (``backend.reads_v_view``: LLSA) gets v as a view of
    the qkv projection's output instead of a copy; ``view_v`` turns that off for A/B benchmarks. Otherwise the qkv
    projection's bias is added by that kernel, which sums its gradient in its backward.
    With ``fuse_inference_qkv``, a forward without autograd on CUDA runs the projection and that kernel's work as one
    GEMM (pixdit.kernels.qkv_norm_rope: qkv is never written; v is written in the attention's layout, so
    ``view_v`` has nothing left to save); off: on an H100 it tied with the two launches (docs/kernel_notes.md v60, v61;
    ``scripts/bench_sampling.py --qkv both`` compares them).
    """

    fuse_block_means = True
    view_v = True
    fuse_inference_qkv = False

    def __init__(self, dim: int, num_heads: int, attention: Mapping[str, Any] | str | None, qk_norm_eps: float = 1e-5):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.q_norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self.k_norm_weight = nn.Parameter(torch.ones(self.head_dim))
        self.qk_norm_eps = qk_norm_eps
        self.backend = build_attention(attention, dim, num_heads)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x, cos, sin, grid_hw):
        n = x.shape[1]
        pool = self.backend.pool_block if self.fuse_block_means else None
        if pool is not None and n % pool:  # the prologue pools whole blocks; VSA and SLA take a partial last one
            pool = None
        weights = (self.q_norm_weight, self.k_norm_weight)
        if (
            self.fuse_inference_qkv
            and x.is_cuda
            and not torch.is_grad_enabled()
            and qkv_norm_rope_fits(x, self.num_heads, pool)
        ):
            outs = qkv_norm_rope(
                x, self.qkv.weight, self.qkv.bias, *weights, cos, sin, self.num_heads, self.qk_norm_eps, pool
            )
            return self._attend(x, outs, pool, grid_hw)
        view_v = self.view_v and self.backend.reads_v_view and not torch.is_grad_enabled()
        # The projection's bias is added inside qk_norm_rope, whose backward sums its gradient in the pass that
        # writes d(qkv) (autograd's sum read d(qkv) again: docs/kernel_notes.md v40); but a v read in place from
        # the projection's output (sampling) must hold it, so there the matmul adds it.
        bias_in_kernel = not view_v
        qkv = F.linear(x, self.qkv.weight, None if bias_in_kernel else self.qkv.bias)
        outs = qk_norm_rope(
            qkv,
            self.num_heads,
            *weights,
            cos,
            sin,
            eps=self.qk_norm_eps,
            pool_block=pool,
            v_view=view_v,
            bias=self.qkv.bias if bias_in_kernel else None,
        )
        return self._attend(x, outs, pool, grid_hw)

    def _attend(self, x, outs, pool, grid_hw):
        """The backend on the prologue's outputs (q, k, v, and the block means where ``pool``), then the output
        projection."""
        b, n, dim = x.shape
        if pool is None:  # q, k, v: each [b, heads, n, head_dim]
            out = self.backend(*outs, grid_hw=grid_hw, hidden=x)
        else:  # and their block means
            q, k, v, means = outs
            out = self.backend(q, k, v, grid_hw=grid_hw, hidden=x, means=means)
        # free for a backend that returns a view of tokens-major memory (LLSA's kernels write it so), a copy otherwise
        return self.proj(out.transpose(1, 2).reshape(b, n, dim))


class Mlp(nn.Module):
    """fc1 -> GELU (tanh) -> fc2.

    Without autograd on CUDA (sampling, evaluation), fc1 and its GELU are one cuBLASLt matmul with the GELU in its
    epilogue (``torch._addmm_activation``, whose CUDA GELU is the tanh form): the 4x-wide hidden activation is
    written once instead of written, read and written again (compiled sampling at 256² measured 1.07x faster,
    docs/benchmarks.md). Training keeps the separate ops (the GELU as ``gelu_tanh``), because the backward needs the
    pre-activation, which that call does not return, and torch has no public op for it (``F.linear`` does not take an
    activation); Triton GEMMs with the GELU (and its derivative) in their epilogues were measured and did not pay
    (docs/kernel_notes.md v38). The fused result differs from the separate ops by one bf16 rounding of the
    pre-activation. ``fuse_inference_gelu`` turns it off for A/B benchmarks (``scripts/bench_sampling.py --gelu
    separate|both``).
    """

    fuse_inference_gelu = True

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        if self.fuse_inference_gelu and x.is_cuda and not torch.is_grad_enabled():
            return self.fc2(self._fc1_gelu_fused(x))
        return self.fc2(gelu_tanh(self.fc1(x)))

    def _fc1_gelu_fused(self, x: torch.Tensor) -> torch.Tensor:
        # autocast does not cover _addmm_activation: cast to the dtype it would give the matmul
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        w, b = self.fc1.weight.to(dtype), self.fc1.bias.to(dtype)
        h = torch._addmm_activation(b, x.reshape(-1, x.shape[-1]).to(dtype), w.t(), use_gelu=True)
        return h.view(*x.shape[:-1], h.shape[-1])


class DiTBlock(nn.Module):
    """x += gate1 * Attn(LN(x)(1 + scale1) + shift1);  x += gate2 * MLP(LN'(x)(1 + scale2) + shift2).
    LayerNorms without affine (eps 1e-6 and 1e-5, as the reference); modulation = Linear(SiLU(c)) -> 6 * hidden."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, attention):
        super().__init__()
        self.attn = Attention(hidden_size, num_heads, attention)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x, c, cos, sin, grid_hw, residual=None):
        """-> (x, residual). Eager, and without autograd: x with both residual adds done, and None.

        Compiled with autograd, each residual add happens inside the LayerNorm joint that follows it
        (``pixdit.kernels.adaln_joint``, whose backward computes d shift, d scale and d gate in the LayerNorm's pass;
        the forward is ``adaln_joint_forward``, the ops of the eager path; docs/kernel_notes.md v40). So the MLP's add
        is left to the next block's first joint: this block returns x before it and ``residual`` = (MLP output,
        gate2), and takes the previous block's as ``residual`` (the final layer takes the last one)."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=-1)
        if joined_residuals():
            branch, gate = residual if residual is not None else (None, None)
            x, h = adaln_joint(x, branch, gate, shift1, scale1, eps=1e-6)
            x, h = adaln_joint(x, self.attn(h, cos, sin, grid_hw), gate1, shift2, scale2, eps=1e-5)
            return x, (self.mlp(h), gate2)
        _, h = adaln_joint_forward(x, None, None, shift1, scale1, eps=1e-6)
        x, h = adaln_joint_forward(x, self.attn(h, cos, sin, grid_hw), gate1, shift2, scale2, eps=1e-5)
        return torch.addcmul(x, gate2[:, None], self.mlp(h)), None  # x + gate2 * mlp


class FinalLayer(nn.Module):
    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)

    def forward(self, x, c, residual=None):
        """``residual``: the last block's MLP output and gate2 not yet added to x (``DiTBlock.forward``)."""
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        if residual is not None:
            return self.linear(adaln_joint(x, *residual, shift, scale, eps=1e-6)[1])
        return self.linear(adaln_joint_forward(x, None, None, shift, scale, eps=1e-6)[1])


class DiT(nn.Module):
    """Pixel DiT predicting the flow velocity. See the module docstring; sizes in DIT_MODELS."""

    def __init__(
        self,
        input_size: int | tuple[int, int] = (32, 32),
        patch_size: int = 1,
        in_channels: int = 3,
        hidden_size: int = 384,
        depth: int = 12,
        num_heads: int = 6,
        mlp_ratio: float = 4.0,
        num_classes: int = 0,
        class_dropout: float = 0.1,
        token_order: str = "auto",
        attention: Mapping[str, Any] | str | None = None,
        per_block_conditioning: bool = False,
        grad_checkpointing: bool | int | str | None = None,  # None = false (a bool default would refuse "mlp")
        zero_init: bool = True,
    ):
        super().__init__()
        check_token_order(token_order, MODEL_TOKEN_ORDERS)
        block_attention = block_attention_configs(attention, depth)  # checks attention.dense_blocks against depth
        if hidden_size % num_heads:
            raise PixditError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
        if not 0.0 <= class_dropout < 1.0:
            raise PixditError(f"class_dropout={class_dropout} must be in [0, 1)")
        self.input_size = _pair(input_size, "input_size")
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.num_heads = num_heads
        self.num_classes = num_classes
        self.class_dropout = class_dropout
        # Which blocks (or parts of blocks) recompute their activations in the backward pass; checked before any
        # block is built, applied after (pixdit.models.checkpointing).
        self.grad_checkpointing_plan = grad_checkpointing_plan(grad_checkpointing, depth)
        self.per_block_conditioning = per_block_conditioning

        self.x_embedder = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)
        num_embedders = depth if per_block_conditioning else 1
        self.t_embedders = nn.ModuleList(TimestepEmbedder(hidden_size) for _ in range(num_embedders))
        self.y_embedders = (
            nn.ModuleList(LabelEmbedder(num_classes, hidden_size) for _ in range(num_embedders))
            if num_classes > 0
            else None
        )
        self.blocks = nn.ModuleList(
            DiTBlock(hidden_size, num_heads, mlp_ratio, block_attention[index]) for index in range(depth)
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, in_channels)

        # The configured backend decides the token order (the dense blocks' `full` takes any order); every kind of
        # backend in the model checks the grid.
        backends = self.attention_backends()
        decides = next((backend for backend in backends if backend.token_order is not None), backends[0])
        self.token_order = resolve_token_order(token_order, decides.token_order, decides.name)
        grid_hw = self.grid_size(*self.input_size)
        for backend in backends:
            backend.check_grid(grid_hw)
        # Token order and RoPE tables for the configured size, as buffers (move with .to(), seen by torch.compile);
        # other sizes are computed on the fly in `_grid_tables`.
        perm, inv, cos, sin = self._make_grid_tables(grid_hw)
        self._grid_cache: dict = {}  # tables of other resolutions (e.g. sampling at another size), per device
        self.register_buffer("token_perm", perm, persistent=False)
        self.register_buffer("token_inv", inv, persistent=False)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if zero_init:
            self.initialize_weights()
        apply_grad_checkpointing(self.blocks, self.grad_checkpointing_plan)

    # ---------------------------------------------------------- init
    def initialize_weights(self) -> None:
        """DiT's initialisation: xavier-uniform linears, zero adaLN modulation and output layer (every block starts as
        the identity and the model predicts 0). The attention backends initialise their own parameters (VSA's gates,
        SLA's projection: `reset_parameters`), which the methods require to start at zero. NB: the LLSA reference does
        NOT do this (it keeps PyTorch's default init everywhere despite the adaLN-Zero name); `zero_init=False`
        reproduces the reference."""
        backend_modules = {module for block in self.blocks for module in block.attn.backend.modules()}
        for module in self.modules():
            if isinstance(module, nn.Linear) and module not in backend_modules:
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.x_embedder.weight.view(self.x_embedder.weight.shape[0], -1))
        nn.init.zeros_(self.x_embedder.bias)
        for embedder in self.t_embedders:
            nn.init.normal_(embedder.mlp[0].weight, std=0.02)
            nn.init.normal_(embedder.mlp[2].weight, std=0.02)
        for embedder in self.y_embedders or []:
            nn.init.normal_(embedder.embedding_table.weight, std=0.02)
        for module in [block.adaLN_modulation[-1] for block in self.blocks] + [
            self.final_layer.adaLN_modulation[-1],
            self.final_layer.linear,
        ]:
            nn.init.zeros_(module.weight)
            nn.init.zeros_(module.bias)
        for block in self.blocks:
            block.attn.backend.reset_parameters()

    def attention_backends(self) -> list[AttentionBackend]:
        """One backend of each kind in the model (first block first): [configured] or, with dense blocks, also full."""
        kinds: dict[str, AttentionBackend] = {}
        for block in self.blocks:
            kinds.setdefault(block.attn.backend.name, block.attn.backend)
        return list(kinds.values())

    # ---------------------------------------------------------- grids
    def grid_size(self, height: int, width: int) -> tuple[int, int]:
        p = self.patch_size
        if height % p or width % p:
            raise PixditError(f"image size {height}x{width} is not divisible by patch_size={p}")
        return height // p, width // p

    def _make_grid_tables(self, grid_hw):
        perm, inv = token_permutation(self.token_order, *grid_hw)
        rows, cols = token_coordinates(self.token_order, *grid_hw)  # RoPE positions follow the tokens
        cos, sin = rope_cos_sin(rows, cols, self.blocks[0].attn.head_dim)
        return perm.clone(), inv.clone(), cos, sin

    def _grid_tables(self, grid_hw, device):
        if grid_hw == self.grid_size(*self.input_size):
            return self.token_perm, self.token_inv, self.rope_cos, self.rope_sin
        key = (grid_hw, str(device))
        if key not in self._grid_cache:
            for backend in self.attention_backends():
                backend.check_grid(grid_hw)
            self._grid_cache[key] = tuple(t.to(device) for t in self._make_grid_tables(grid_hw))
        return self._grid_cache[key]

    # ---------------------------------------------------------- forward
    def conditioning(self, t: torch.Tensor, y: torch.Tensor | None) -> list[torch.Tensor]:
        """One conditioning vector per block ([b, hidden]; the same tensor for all blocks unless per-block)."""
        if self.y_embedders is not None:
            if y is None:  # no labels: the unconditional (null class) model
                y = torch.full((t.shape[0],), self.num_classes, dtype=torch.long, device=t.device)
            elif self.training and self.class_dropout > 0:
                # Label dropout for classifier-free guidance, drawn ONCE per sample (the reference draws per block).
                drop = torch.rand(y.shape[0], device=y.device) < self.class_dropout
                y = torch.where(drop, torch.full_like(y, self.num_classes), y)
        conds = []
        for i, t_embedder in enumerate(self.t_embedders):
            c = t_embedder(t)
            if self.y_embedders is not None:
                c = c + self.y_embedders[i](y)
            conds.append(c)
        return conds * len(self.blocks) if len(conds) == 1 else conds

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """x: [b, C, H, W]; t: [b] float (= 1000 * sigma); y: [b] int64 labels or None -> velocity [b, C, H, W]."""
        b, _, height, width = x.shape
        grid_hw = self.grid_size(height, width)
        perm, inv, cos, sin = self._grid_tables(grid_hw, x.device)
        if t.ndim == 0:
            t = t.expand(b)
        conds = self.conditioning(t, y)

        x = self.embed(x, inv, perm)  # [b, N, hidden]; sequence position s holds raster token inv[s]
        residual = None  # a block's MLP output and gate2 left for the next joint (DiTBlock.forward)
        for block, c in zip(self.blocks, conds):
            x, residual = block(x, c, cos, sin, grid_hw, residual)
        # [b, N, p * p * C]; per-block conditioning: block 0's, as the reference
        x = self.final_layer(x, conds[0], residual)
        if self.token_order != "raster":
            x = PermuteTokens.apply(x, perm, inv)  # back to raster order
        return self.unpatchify(x, grid_hw)

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        """[b, C, H, W] -> [b, (H/p) * (W/p), C * p * p] in raster order, each patch flattened as the Conv2d's
        weights are: (channel, row, column)."""
        b, c, height, width = x.shape
        p = self.patch_size
        x = x.reshape(b, c, height // p, p, width // p, p)
        return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (height // p) * (width // p), c * p * p)

    def embed(self, x: torch.Tensor, order: torch.Tensor, inverse_order: torch.Tensor) -> torch.Tensor:
        """Patch embedding into sequence order: [b, C, H, W] -> [b, N, hidden], token s = raster patch order[s].

        The same map as ``x_embedder`` (a Conv2d, kept for its parameters and checkpoints), computed as a matmul on
        the patches after reordering them: the C * p * p values of a patch are cheap to permute, and the result is
        tokens-major and contiguous. The convolution wrote [b, hidden, H/p, W/p] instead, which the first block's
        two kernels (Inductor fused the reorder into them) read with each token's hidden values N elements apart:
        they took 2.2x the time of another block's, and compiled sampling at 256² runs 1.02x faster without them
        (docs/benchmarks.md)."""
        patches = self.patchify(x)
        if self.token_order != "raster":
            patches = PermuteTokens.apply(patches, order, inverse_order)
        weight = self.x_embedder.weight
        return F.linear(patches, weight.reshape(weight.shape[0], -1), self.x_embedder.bias)

    def unpatchify(self, x: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        """[b, h * w, p * p * C] (raster) -> [b, C, h * p, w * p]."""
        (h, w), p, c = grid_hw, self.patch_size, self.in_channels
        x = x.reshape(x.shape[0], h, w, p, p, c)
        return torch.einsum("bhwpqc->bchpwq", x).reshape(x.shape[0], c, h * p, w * p)

    def forward_with_cfg(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        """Classifier-free guidance: v_uncond + cfg_scale * (v_cond - v_uncond), both halves in one batch."""
        if self.y_embedders is None:
            raise PixditError("cfg_scale != 1 needs a class-conditional model (model.num_classes > 0)")
        if t.ndim == 0:
            t = t.expand(x.shape[0])
        null = torch.full_like(y, self.num_classes)
        # self(...), not self.forward(...): a model compiled in place (the sampler's fast path) compiles __call__
        v_cond, v_uncond = self(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null])).chunk(2)
        return v_uncond + cfg_scale * (v_cond - v_uncond)


def _pair(value, name: str) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    try:
        height, width = (int(v) for v in value)
    except (TypeError, ValueError):
        raise PixditError(f"{name} must be an int or a pair (height, width), got {value!r}") from None
    return height, width


# Architectures; the image size, patch size, attention and conditioning are options of `build_model`.
DIT_MODELS: dict[str, dict[str, int]] = {
    "DiT-T": dict(depth=4, hidden_size=128, num_heads=4),  # tiny: tests and the CPU quickstart
    "DiT-S": dict(depth=12, hidden_size=384, num_heads=6),  # the LLSA paper's model
    "DiT-B": dict(depth=12, hidden_size=768, num_heads=12),
    "DiT-L": dict(depth=24, hidden_size=1024, num_heads=16),
    "DiT-XL": dict(depth=28, hidden_size=1152, num_heads=16),
}

"""The pixel DiT (pixdit.models): shapes, gradients, token-order equivariance, RoPE against a complex-number oracle,
zero-init, CFG, parameter counts of the LLSA paper's model. Run: .venv/bin/python -m pytest tests/test_model.py"""

import math
from pathlib import Path

import pytest
import torch

from pixdit.errors import PixditError
from pixdit.models import DIT_MODELS, build_model
from pixdit.models.dit import apply_rope, rope_cos_sin

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tiny(**overrides):
    options = dict(input_size=(8, 8), depth=2, hidden_size=64, num_heads=2, zero_init=False)
    options.update(overrides)
    return build_model("DiT-T", **options)


def inputs(b, height, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, height, width, generator=g), 1000 * torch.rand(b, generator=g)


@pytest.mark.parametrize(
    "size,patch,order",
    [
        ((8, 8), 1, "raster"),
        ((8, 12), 1, "zorder"),
        ((12, 8), 2, "raster"),
        ((16, 16), 2, "zorder"),
        ((6, 10), 1, "zorder"),
    ],
)
def test_shapes_and_gradients(size, patch, order):
    torch.manual_seed(0)
    model = tiny(input_size=size, patch_size=patch, token_order=order)
    x, t = inputs(2, *size)
    out = model(x, t)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.square().mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


@pytest.mark.parametrize("size,patch,order", [((8, 12), 1, "zorder"), ((12, 8), 2, "raster"), ((16, 16), 2, "zorder")])
def test_patch_embedding_is_the_convolution_in_sequence_order(size, patch, order):
    """``embed`` (the patches reordered, then one matmul with the Conv2d's weights) equals the convolution followed by
    the token reorder, in value and in the gradients of the image and the conv's parameters."""
    torch.manual_seed(0)
    model = tiny(input_size=size, patch_size=patch, token_order=order)
    perm, inv = model.token_perm, model.token_inv  # the tables of the configured size
    assert order == "raster" or not torch.equal(inv, torch.arange(len(inv)))  # the reorder is exercised
    x = inputs(2, *size)[0].requires_grad_(True)
    weights = torch.randn(2, len(inv), model.x_embedder.out_channels)
    conv = model.x_embedder(x).flatten(2).transpose(1, 2)[:, inv]
    grads_conv = torch.autograd.grad((conv * weights).sum(), [x, *model.x_embedder.parameters()])
    embedded = model.embed(x, inv, perm)
    grads = torch.autograd.grad((embedded * weights).sum(), [x, *model.x_embedder.parameters()])
    assert embedded.shape == conv.shape and embedded.is_contiguous()
    torch.testing.assert_close(embedded, conv, atol=1e-5, rtol=1e-5)
    for got, want, name in zip(grads, grads_conv, ["image", "weight", "bias"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5, msg=name)


def test_registry_sizes():
    model = build_model("DiT-T", input_size=(4, 8))
    x, t = inputs(1, 4, 8)
    assert model(x, t).shape == x.shape
    for sizes in DIT_MODELS.values():  # 2-D RoPE splits the head dim into two axes of (cos, sin) pairs
        assert sizes["hidden_size"] % sizes["num_heads"] == 0 and sizes["hidden_size"] // sizes["num_heads"] % 4 == 0


def test_zorder_model_equals_raster_model():
    """Full attention is permutation-equivariant and RoPE positions follow the tokens: same weights, same output."""
    torch.manual_seed(0)
    raster = tiny(input_size=(8, 12), token_order="raster")
    zorder = tiny(input_size=(8, 12), token_order="zorder")
    zorder.load_state_dict(raster.state_dict())
    x, t = inputs(2, 8, 12)
    a, b = raster(x, t), zorder(x, t)
    assert a.abs().mean() > 1e-2  # non-trivial output
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    x.requires_grad_(True)  # gradients agree too (the token permutation's backward is its inverse gather)
    (raster(x, t) * x).sum().backward()
    grad_raster, x.grad = x.grad, None
    (zorder(x, t) * x).sum().backward()
    torch.testing.assert_close(x.grad, grad_raster, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(raster.named_parameters(), zorder.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_rope_matches_complex_rotation():
    torch.manual_seed(0)
    head_dim, rows, cols = 16, torch.tensor([0, 3, 5]), torch.tensor([2, 0, 7])
    cos, sin = rope_cos_sin(rows, cols, head_dim)
    x = torch.randn(3, 2, head_dim)  # [tokens, heads, head_dim]
    out = apply_rope(x, cos, sin)
    freqs = 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)
    for i in range(3):
        angles = torch.cat([rows[i] * freqs, cols[i] * freqs])  # first half: row, second half: column
        rotation = torch.polar(torch.ones(8, dtype=torch.float64), angles)
        z = torch.view_as_complex(x[i].double().reshape(2, 8, 2).contiguous()) * rotation
        torch.testing.assert_close(out[i].double(), torch.view_as_real(z).reshape(2, head_dim), atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_offsets():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 32), torch.randn(1, 1, 32)

    def score(q_pos, k_pos):
        qc = rope_cos_sin(torch.tensor([q_pos[0]]), torch.tensor([q_pos[1]]), 32)
        kc = rope_cos_sin(torch.tensor([k_pos[0]]), torch.tensor([k_pos[1]]), 32)
        return (apply_rope(q, *qc) * apply_rope(k, *kc)).sum()

    torch.testing.assert_close(score((2, 5), (1, 1)), score((7, 10), (6, 6)), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score((2, 5), (1, 1)), score((2, 5), (1, 2)))


def test_zero_init_output_is_zero_and_trains():
    model = build_model("DiT-T", input_size=(8, 8), num_classes=3)
    x, t = inputs(2, 8, 8)
    out = model(x, t, torch.tensor([0, 2]))
    assert torch.equal(out, torch.zeros_like(out))
    (model(x, t) - x).square().mean().backward()
    assert model.final_layer.linear.weight.grad.abs().sum() > 0  # the output layer receives gradient first
    assert model.blocks[0].attn.qkv.weight.grad.abs().sum() == 0  # zero gates: blocks start as the identity


def test_other_resolution_than_configured():
    model = tiny(input_size=(8, 8), token_order="zorder")
    x, t = inputs(1, 12, 16)
    assert model(x, t).shape == x.shape


def test_cfg():
    torch.manual_seed(0)
    model = tiny(num_classes=5, class_dropout=0.1).eval()
    x, t = inputs(3, 8, 8)
    y = torch.tensor([0, 4, 2])
    guided = model.forward_with_cfg(x, t, y, cfg_scale=4.0)
    assert guided.shape == x.shape
    torch.testing.assert_close(model.forward_with_cfg(x, t, y, 1.0), model(x, t, y), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        model.forward_with_cfg(x, t, y, 0.0), model(x, t, torch.full_like(y, 5)), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(model(x, t), model(x, t, torch.full_like(y, 5)))  # no labels = null class
    with pytest.raises(PixditError, match="num_classes"):
        tiny().forward_with_cfg(x, t, y, 2.0)


def test_cfg_calls_the_module_so_an_in_place_compiled_model_stays_compiled():
    """nn.Module.compile() compiles __call__; forward_with_cfg once called self.forward, so every guided sample of the
    evaluation fast path (pixdit.eval.sampling) ran eager."""
    model = tiny(num_classes=5).eval()
    batches = []
    model.register_forward_pre_hook(lambda module, args: batches.append(args[0].shape[0]))
    x, t = inputs(3, 8, 8)
    model.forward_with_cfg(x, t, torch.tensor([0, 4, 2]), cfg_scale=2.0)
    assert batches == [6]  # one call through __call__, conditional and unconditional halves together


def test_label_dropout_is_drawn_once_per_sample():
    torch.manual_seed(0)
    model = tiny(depth=3, num_classes=4, class_dropout=0.5, per_block_conditioning=True).train()
    b = 64
    y, t = torch.randint(0, 4, (b,)), 1000 * torch.rand(b)
    conds = model.conditioning(t, y)
    dropped_per_block = []
    for i, c in enumerate(conds):
        null = model.t_embedders[i](t) + model.y_embedders[i](torch.full_like(y, 4))
        dropped_per_block.append(torch.isclose(c, null, atol=1e-6).all(dim=1))
    dropped = torch.stack(dropped_per_block)
    assert (dropped == dropped[0]).all()  # the same samples lost their label in every block
    assert 10 < int(dropped[0].sum()) < 54  # about half of them
    model.eval()
    kept = model.conditioning(t, y)[0]
    torch.testing.assert_close(kept, model.t_embedders[0](t) + model.y_embedders[0](y))


def test_reference_parameter_count():
    """The reference's unconditional DiT-S has 35,177,859 parameters (one timestep MLP per block);
    the standard shared embedding gives 32,466,051; 1000 classes add 384,384 per block."""
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    reference = build_model("DiT-S", input_size=(4, 8), per_block_conditioning=True, zero_init=False)
    assert count(reference) == 35_177_859
    x, t = inputs(1, 4, 8)
    assert reference(x, t).shape == x.shape  # the paper's size runs (one token per pixel)
    assert count(build_model("DiT-S", input_size=8, zero_init=False)) == 32_466_051
    assert (
        count(build_model("DiT-S", input_size=8, per_block_conditioning=True, num_classes=1000, zero_init=False))
        == 35_177_859 + 12 * 384_384
    )


def test_bad_inputs_name_the_numbers():
    with pytest.raises(PixditError, match=r"30x32.*patch_size=4"):
        build_model("DiT-T", input_size=(30, 32), patch_size=4)
    model = tiny()
    with pytest.raises(PixditError, match=r"9x8.*patch_size=2"):
        tiny(patch_size=2)(torch.randn(1, 3, 9, 8), torch.ones(1))
    with pytest.raises(PixditError, match="DiT-S"):
        build_model("DiT-Q")
    with pytest.raises(PixditError, match="token_order"):
        build_model("DiT-T", input_size=8, token_order="hilbert")
    with pytest.raises(PixditError, match="allowed"):
        build_model("DiT-T", input_size=8, dropout=0.1)
    assert model is not None


@pytest.mark.parametrize(
    "key, value, kind",
    [
        ("patch_size", "abc", "int"),
        ("mlp_ratio", "abc", "float"),
        ("class_dropout", "abc", "float"),
        ("zero_init", "no", "true/false"),
    ],
)
def test_word_for_a_number_or_flag_is_named(key, value, kind):
    """model.patch_size=abc etc.: a PixditError naming the key, not a TypeError/ValueError from deep inside torch
    (and zero_init='no' is not silently true)."""
    with pytest.raises(PixditError, match=rf"model.{key}='{value}' must be {kind}"):
        build_model("DiT-T", input_size=8, **{key: value})


@pytest.mark.parametrize("config", ["dit_t", "dit_s", "dit_b", "dit_l", "dit_xl"])
def test_shipped_model_configs_build(config):
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(CONFIGS / f"model/{config}.yaml"))
    with torch.device("meta"):  # structure and parameter count only: no memory, no init cost
        model = build_model(**cfg, input_size=(64, 64), attention={"name": "full"})
    sizes = DIT_MODELS[cfg["name"]]
    assert len(model.blocks) == sizes["depth"] and model.blocks[0].attn.num_heads == sizes["num_heads"]
    assert model.token_perm.device.type == "cpu"  # the cached token tables were not created on the meta device
    if config == "dit_s":
        assert sum(p.numel() for p in model.parameters()) == 32_466_051


# --------------------------------------------------------------------------------- the MLP's fused inference GELU
def _mlp_ops(grad: bool, device: str) -> set[str]:
    """The aten ops of one Mlp forward, traced on fake tensors (a CUDA device needs no GPU here; autocast does, so
    the dtype under autocast is checked by the GPU test below)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from pixdit.models.dit import Mlp

    with FakeTensorMode(), torch.device(device):
        mlp, x = Mlp(16, 64), torch.empty(2, 5, 16)

        def run(x):
            with torch.set_grad_enabled(grad):
                return mlp(x)

        graph = make_fx(run)(x)
    return {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}


def test_mlp_fuses_gelu_only_for_cuda_inference():
    fused = "aten._addmm_activation.default"
    ops = _mlp_ops(grad=False, device="cuda")
    assert fused in ops and "aten.gelu.default" not in ops
    # training keeps the separate ops (the backward needs the pre-activation); on CPU the op's GELU is erf, not tanh
    ops = _mlp_ops(grad=True, device="cuda")
    assert fused not in ops and "aten.gelu.default" in ops
    assert fused not in _mlp_ops(grad=False, device="cpu")


def test_compiled_gelu_is_the_tanh_gelu_in_its_sigmoid_form():
    """Compiled, gelu_tanh is h * sigmoid(2u): the tanh GELU without 1 + tanh(u)'s cancellation, which costs F.gelu's
    fp32 form the negative tail (0 where the GELU is -3e-21, and 23% of the bf16 values on this grid)."""
    import torch.nn.functional as F

    from pixdit.models.dit import gelu_tanh

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def oracle(x):  # fp64, and 0.5 (1 + tanh u) as sigmoid(2u): even fp64's 1 + tanh(u) is 0 below x = -7.14
        return x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))

    x = torch.linspace(-8, 8, 4001)
    x64 = x.double().requires_grad_()
    (exact_grad,) = torch.autograd.grad(oracle(x64).sum(), x64)
    exact = oracle(x.double())
    compiled = torch.compile(gelu_tanh, backend=capture, fullgraph=True)
    h = x.clone().requires_grad_()
    y = compiled(h)
    y.sum().backward()
    assert ((y.double() - exact).abs() <= 1e-5 * exact.abs()).all()
    assert ((h.grad.double() - exact_grad).abs() <= 1e-5 * exact_grad.abs() + 1e-7).all()
    # bf16 in, bf16 out, one rounding of an fp32 result: the fp64 GELU's bf16 value but for rounding ties
    xb = x.bfloat16()
    yb = compiled(xb)
    assert yb.dtype == torch.bfloat16
    assert (yb == oracle(xb.double()).bfloat16()).float().mean() > 0.999
    targets = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert any("sigmoid" in t for t in targets) and not any("gelu" in t or "tanh" in t for t in targets), targets
    # eager mode keeps F.gelu (one ATen kernel, no fp32 temporaries)
    assert torch.equal(gelu_tanh(xb), F.gelu(xb, approximate="tanh"))


def test_compiled_training_runs_every_joint_as_adaln_joint():
    """Compiled with autograd, every residual add + LayerNorm + modulation of the DiT is pixdit.kernels.adaln_joint's
    Function (its backward computes the per-sample shift / scale / gate gradients in the LayerNorm's pass): two per
    block, each block's MLP residual joined to the next block's first LayerNorm and the last one to the final
    layer's. Outputs and gradients equal eager mode's up to fp32 summation order (tests/test_compile.py compares
    every attention backend); without autograd the compiled model keeps the plain ops."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(0)
    model = build_model("DiT-T", input_size=(8, 8), num_classes=3).eval()  # eval: no random label dropout
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.1)  # adaLN-Zero would zero the gates and their gradients' paths
    x, t, y = torch.randn(2, 3, 8, 8), torch.rand(2) * 1000, torch.tensor([0, 2])
    params = list(model.parameters())
    eager = model(x, t, y)
    eager_grads = torch.autograd.grad(eager.square().sum(), params)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=capture, fullgraph=True)
    out = compiled(x, t, y)
    grads = torch.autograd.grad(out.square().sum(), params)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    for (name, _), got, want in zip(model.named_parameters(), grads, eager_grads, strict=True):
        assert want.abs().max() > 0, f"{name} gets no gradient: the check would be vacuous"
        assert (got - want).norm() <= 1e-5 * want.norm(), name

    def joints():
        return [n for gm in graphs for n in gm.graph.nodes if str(n.target) == "autograd_function_apply"]

    assert len(joints()) == 2 * len(model.blocks) + 1, [str(n.target) for gm in graphs for n in gm.graph.nodes]
    graphs.clear()
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, backend=capture, fullgraph=True)(x, t, y), eager)
    assert graphs and not joints()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fused_inference_gelu_matches_the_separate_ops():
    from pixdit.models.dit import Mlp

    torch.manual_seed(0)
    mlp = Mlp(384, 1536).cuda()
    x = torch.randn(3, 4099, 384, device="cuda")  # rows not a multiple of any tile
    exact = mlp.fc2.double()(torch.nn.functional.gelu(mlp.fc1.double()(x.double()), approximate="tanh"))
    mlp.float()
    errors = {}
    for fused in (True, False):
        Mlp.fuse_inference_gelu = fused
        try:
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
                out = mlp(x)
        finally:
            Mlp.fuse_inference_gelu = True
        assert out.dtype == torch.bfloat16
        errors[fused] = ((out.double() - exact).abs().max() / exact.abs().max()).item()
    # both are bf16 matmuls; the fused one rounds the pre-activation once less
    assert errors[True] < 1.5 * errors[False] + 1e-3, errors
    assert errors[True] < 2e-2, errors


# ------------------------------------------------------------------ the sparse backends' block means from the prologue
@pytest.mark.parametrize(
    "attention,name",
    [
        ({"name": "llsa", "num_levels": 1}, "LLSAAttention"),
        ({"name": "vsa"}, "VSAAttention"),
        ({"name": "sla"}, "SLAAttention"),
    ],
)
def test_backend_gets_its_block_means_from_the_qk_norm_rope_prologue(monkeypatch, attention, name):
    """The backend that declares ``pool_block`` receives the stacked means of its q, k, v from qk_norm_rope; the
    output is bitwise the one of the backend pooling them itself (``Attention.fuse_block_means = False``)."""
    from pixdit.models.dit import Attention

    torch.manual_seed(0)
    model = tiny(input_size=(16, 16), token_order="zorder", attention=attention)
    backend_class = type(model.blocks[0].attn.backend)
    assert backend_class.__name__ == name and model.blocks[0].attn.backend.pool_block == 16
    seen, forward = [], backend_class.forward

    def spy(self, q, k, v, **kwargs):
        seen.append(kwargs.get("means"))
        return forward(self, q, k, v, **kwargs)

    monkeypatch.setattr(backend_class, "forward", spy)
    x, t = inputs(2, 16, 16)
    fused = model(x, t)
    assert len(seen) == 2 and all(m is not None and m.shape == (3, 2, 2, 16, 32) for m in seen)
    seen.clear()
    monkeypatch.setattr(Attention, "fuse_block_means", False)
    assert torch.equal(model(x, t), fused)
    assert seen == [None, None]


def test_only_blocks_of_16_take_means_and_only_whole_blocks_get_them(monkeypatch):
    """Larger blocks (their sums cross warps in the prologue's kernel: not measured to pay) and dense attention pool
    themselves; a grid that is not whole blocks (VSA and SLA take a partial last one) gets no means."""
    from pixdit.attention import build_attention

    for config in ({"name": "llsa", "block_size": 32}, {"name": "full"}, {"name": "vsa", "block_size": 32},
                   {"name": "sla", "block_size": 64}):  # fmt: skip
        assert build_attention(config, 64, 2).pool_block is None, config
    model = tiny(input_size=(6, 10), token_order="zorder", attention={"name": "vsa"})
    backend_class = type(model.blocks[0].attn.backend)
    seen, forward = [], backend_class.forward

    def spy(self, q, k, v, **kwargs):
        seen.append(kwargs.get("means"))
        return forward(self, q, k, v, **kwargs)

    monkeypatch.setattr(backend_class, "forward", spy)
    assert model(*inputs(1, 6, 10)).isfinite().all()
    assert seen == [None, None]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", [{"name": "llsa", "num_levels": 2}, {"name": "vsa"}, {"name": "sla"}])
def test_gpu_prologue_block_means_match_the_backends_own(attention):
    """On the GPU the kernel sums each block in its own order: the sampled output stays within bf16 noise of the
    backend pooling q, k, v itself (a sum of 16 bf16 values is mostly exact in fp32, so usually equal)."""
    from pixdit.models.dit import Attention

    torch.manual_seed(0)
    model = build_model("DiT-S", input_size=(128, 128), attention=attention, zero_init=False)
    model = model.cuda().eval()
    x, t = (a.cuda() for a in inputs(2, 128, 128))
    outs = {}
    for fused in (True, False):
        Attention.fuse_block_means = fused
        try:
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
                outs[fused] = model(x, t).float()
        finally:
            Attention.fuse_block_means = True
    error = ((outs[True] - outs[False]).norm() / outs[False].norm()).item()
    assert torch.isfinite(outs[True]).all() and error < 1e-3, error

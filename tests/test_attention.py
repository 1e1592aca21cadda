"""Attention backends (pixdit.attention, pixdit.attention_sparse): registry, config validation, full attention against
an explicit softmax oracle, the model's token-order check. Run: .venv/bin/python -m pytest tests/test_attention.py"""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import pixdit.kernels as kernels
from pixdit.attention import AttentionBackend, attention_names, build_attention, register_attention
from pixdit.errors import PixditError
from pixdit.models import build_model

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def softmax_attention(q, k, v):
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    return (scores.softmax(-1) @ v.double()).to(q.dtype)


def qkv(b=2, h=3, n=20, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g) for _ in range(3)]


def test_full_sdpa_matches_softmax_oracle():
    q, k, v = qkv()
    backend = build_attention({"name": "full"}, dim=48, num_heads=3)
    out = backend(q, k, v, grid_hw=(4, 5), hidden=torch.zeros(2, 20, 48))
    torch.testing.assert_close(out, softmax_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_registry_lists_all_backends():
    assert {"full", "llsa", "vsa", "sla"} <= set(attention_names())


def test_config_errors_list_the_choices():
    with pytest.raises(PixditError, match=r"block_size.*allowed: name, impl"):
        build_attention({"name": "full", "block_size": 16}, dim=64, num_heads=2)
    with pytest.raises(PixditError, match=r"full.*llsa.*sla.*vsa"):
        build_attention({"name": "ring"}, dim=64, num_heads=2)
    with pytest.raises(PixditError, match=r"sdpa, triton"):
        build_attention({"name": "full", "impl": "xformers"}, dim=64, num_heads=2)


def test_accepts_omegaconf_and_shipped_configs():
    cfg = OmegaConf.load(CONFIGS / "attention/full.yaml")
    assert build_attention(cfg, dim=64, num_heads=2).impl == "sdpa"
    for name in ["llsa", "vsa", "sla"]:  # every key of the shipped config is a constructor option
        cfg = OmegaConf.load(CONFIGS / f"attention/{name}.yaml")
        try:
            build_attention(cfg, dim=64, num_heads=2)
        except PixditError as error:
            assert "unknown option" not in str(error)


def test_triton_impl_is_clear_when_missing():
    if hasattr(kernels, "flash_attention"):
        q, k, v = qkv(n=64, d=16)
        backend = build_attention({"name": "full", "impl": "triton"}, dim=48, num_heads=3)
        torch.testing.assert_close(backend(q, k, v, grid_hw=(8, 8), hidden=None), softmax_attention(q, k, v),
                                   atol=1e-4, rtol=1e-4)
    else:
        with pytest.raises(PixditError, match="flash_attention"):
            build_attention({"name": "full", "impl": "triton"}, dim=48, num_heads=3)


@register_attention("test_needs_zorder")
class NeedsZorder(AttentionBackend):
    token_order = "zorder"

    def check_grid(self, grid_hw):
        if grid_hw[0] * grid_hw[1] % 16:
            raise PixditError(f"{grid_hw[0] * grid_hw[1]} tokens is not a multiple of block_size=16")

    def forward(self, q, k, v, *, grid_hw, hidden):
        return softmax_attention(q, k, v)


def test_model_checks_backend_token_order_and_grid():
    with pytest.raises(PixditError, match="token_order='zorder'"):
        build_model("DiT-T", input_size=8, attention={"name": "test_needs_zorder"})
    with pytest.raises(PixditError, match="36 tokens.*block_size=16"):
        build_model("DiT-T", input_size=6, token_order="zorder", attention={"name": "test_needs_zorder"})
    model = build_model("DiT-T", input_size=8, token_order="zorder", attention={"name": "test_needs_zorder"})
    with pytest.raises(PixditError, match="36 tokens"):  # another resolution at run time is checked too
        model(torch.randn(1, 3, 6, 6), torch.ones(1))


needs_llsa = pytest.mark.skipif(not hasattr(kernels, "llsa_attention"), reason="pixdit.kernels.llsa_attention missing")


@pytest.mark.skipif(hasattr(kernels, "llsa_attention"), reason="the LLSA kernel is available")
def test_llsa_without_kernel_is_a_clear_error():
    with pytest.raises(PixditError, match="llsa.*not implemented yet"):
        build_model("DiT-T", input_size=16, token_order="zorder", attention={"name": "llsa"})


@needs_llsa
def test_llsa_selecting_every_block_without_enrichment_is_full_attention():
    """K_1 = N / B keeps every fine block and enrich_levels=0 drops the pooled tokens: exactly dense attention."""
    q, k, v = qkv(n=64, d=16)
    backend = build_attention({"name": "llsa", "block_size": 16, "topk": 4, "enrich_levels": 0}, dim=48, num_heads=3)
    out = backend(q, k, v, grid_hw=(8, 8), hidden=None)
    torch.testing.assert_close(out, softmax_attention(q, k, v), atol=1e-5, rtol=1e-5)
    sparse = build_attention({"name": "llsa", "block_size": 16, "topk": 1}, dim=48, num_heads=3)
    assert not torch.allclose(sparse(q, k, v, grid_hw=(8, 8), hidden=None), out, atol=1e-3)


@needs_llsa
def test_llsa_model_trains_on_cpu_and_matches_full_attention_when_dense():
    torch.manual_seed(0)
    options = dict(input_size=(8, 16), depth=2, hidden_size=64, num_heads=2, zero_init=False)
    full = build_model("DiT-T", **options)
    llsa = build_model("DiT-T", **options, token_order="zorder",
                       attention={"name": "llsa", "block_size": 16, "topk": 8, "enrich_levels": 0})
    llsa.load_state_dict(full.state_dict())
    x, t = torch.randn(2, 3, 8, 16), 1000 * torch.rand(2)
    out = llsa(x, t)
    torch.testing.assert_close(out, full(x, t), atol=1e-4, rtol=1e-4)
    out.square().mean().backward()
    assert all(p.grad is not None for p in llsa.parameters())
    default_llsa = OmegaConf.load(CONFIGS / "attention/llsa.yaml")
    default = build_model("DiT-T", input_size=16, token_order="zorder", attention=default_llsa)
    assert default(torch.randn(1, 3, 16, 16), torch.ones(1)).shape == (1, 3, 16, 16)


@needs_llsa
def test_llsa_bad_grid_fails_at_build_with_both_numbers():
    with pytest.raises(PixditError, match=r"6x6 token grid \(36 tokens\).*16"):
        build_model("DiT-T", input_size=6, token_order="zorder", attention={"name": "llsa"})
    with pytest.raises(PixditError, match=r"num_levels=2.*256"):
        build_model("DiT-T", input_size=(16, 24), token_order="zorder", attention={"name": "llsa", "num_levels": 2})
    with pytest.raises(PixditError, match="block_size"):
        build_model("DiT-T", input_size=16, token_order="zorder", attention={"name": "llsa", "block_size": 12})
    with pytest.raises(PixditError, match="token_order='zorder'"):
        build_model("DiT-T", input_size=16, attention={"name": "llsa"})


@pytest.mark.parametrize("attention,order", [({"name": "full"}, "raster"),
                                             pytest.param({"name": "llsa"}, "zorder", marks=needs_llsa)])
def test_model_under_bf16_autocast(attention, order):
    """q, k, v reach the backend in one dtype under autocast (the kernels require it); bf16 output near fp32."""
    torch.manual_seed(0)
    model = build_model("DiT-T", input_size=8, depth=2, hidden_size=64, num_heads=2, token_order=order,
                        attention=attention, zero_init=False)
    x, t = torch.randn(2, 3, 8, 8), 1000 * torch.rand(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    torch.testing.assert_close(out.float(), model(x, t), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("name", ["vsa", "sla"])
def test_vsa_sla_backends_build_from_their_configs(name):  # (training tests: tests/kernels/test_{vsa,sla}_backend.py)
    model = build_model("DiT-T", input_size=16, token_order="zorder",
                        attention=OmegaConf.load(CONFIGS / f"attention/{name}.yaml"))
    assert model.blocks[0].attn.backend.name == name

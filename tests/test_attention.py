"""Attention backends (the pixdit.attention package): registry, config validation, full attention against an explicit
softmax oracle, the model's token order (auto and explicit), the backends' own parameter init, and that every module
imports on its own (no import cycle). Run: .venv/bin/python -m pytest tests/test_attention.py"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from pixdit.attention import AttentionBackend, attention_names, build_attention, register_attention
from pixdit.errors import PixditError
from pixdit.models import build_model

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


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
    with pytest.raises(PixditError, match=r"block_size.*in attention; allowed keys for FullAttention: kernel"):
        build_attention({"name": "full", "block_size": 16}, dim=64, num_heads=2)
    with pytest.raises(PixditError, match=r"full.*llsa.*sla.*vsa"):
        build_attention({"name": "ring"}, dim=64, num_heads=2)
    with pytest.raises(PixditError, match=r"sdpa, triton"):
        build_attention({"name": "full", "kernel": "xformers"}, dim=64, num_heads=2)
    with pytest.raises(PixditError, match=r"attention.topk='many' must be int"):
        build_attention({"name": "llsa", "topk": "many"}, dim=64, num_heads=2)


@pytest.mark.parametrize(
    "name,old,new", [("full", "impl", "attention.kernel"), ("vsa", "sparsity", "attention.topk_ratio = 1 - sparsity")]
)
def test_renamed_options_name_their_replacement(name, old, new):
    with pytest.raises(PixditError, match=f"attention.{old} .*was renamed: use {new}"):
        build_attention({"name": name, old: 0.5}, dim=64, num_heads=2)


def test_accepts_omegaconf_and_shipped_configs():
    cfg = OmegaConf.load(CONFIGS / "attention/full.yaml")
    assert build_attention(cfg, dim=64, num_heads=2).kernel == "sdpa"
    for name in ["llsa", "vsa", "sla"]:  # every key of the shipped config is a constructor option
        cfg = OmegaConf.load(CONFIGS / f"attention/{name}.yaml")
        assert build_attention(cfg, dim=64, num_heads=2).name == name


def test_full_triton_kernel_matches_softmax_oracle():
    q, k, v = qkv(n=64, d=16)
    backend = build_attention({"name": "full", "kernel": "triton"}, dim=48, num_heads=3)
    torch.testing.assert_close(
        backend(q, k, v, grid_hw=(8, 8), hidden=None), softmax_attention(q, k, v), atol=1e-4, rtol=1e-4
    )


@register_attention("test_needs_zorder")
class NeedsZorder(AttentionBackend):
    token_order = "zorder"

    def check_grid(self, grid_hw):
        if grid_hw[0] * grid_hw[1] % 16:
            raise PixditError(f"{grid_hw[0] * grid_hw[1]} tokens is not a multiple of block_size=16")

    def forward(self, q, k, v, *, grid_hw, hidden):
        return softmax_attention(q, k, v)


def test_model_token_order_auto_follows_the_backend_and_explicit_orders_are_checked():
    assert build_model("DiT-T", input_size=8, attention={"name": "test_needs_zorder"}).token_order == "zorder"
    assert build_model("DiT-T", input_size=8, attention={"name": "full"}).token_order == "raster"
    assert build_model("DiT-T", input_size=8, token_order="zorder").token_order == "zorder"  # full: any order
    with pytest.raises(PixditError, match="needs token_order='zorder'.*token_order='raster'.*auto"):
        build_model("DiT-T", input_size=8, token_order="raster", attention={"name": "test_needs_zorder"})
    with pytest.raises(PixditError, match="token_order='hilbert'.*auto, raster, zorder"):
        build_model("DiT-T", input_size=8, token_order="hilbert")


def test_model_checks_backend_grid():
    with pytest.raises(PixditError, match="36 tokens.*block_size=16"):
        build_model("DiT-T", input_size=6, token_order="zorder", attention={"name": "test_needs_zorder"})
    model = build_model("DiT-T", input_size=8, token_order="zorder", attention={"name": "test_needs_zorder"})
    with pytest.raises(PixditError, match="36 tokens"):  # another resolution at run time is checked too
        model(torch.randn(1, 3, 6, 6), torch.ones(1))


def test_llsa_selecting_every_block_without_enrichment_is_full_attention():
    """K_1 = N / B keeps every fine block and enrich_levels=0 drops the pooled tokens: exactly dense attention."""
    q, k, v = qkv(n=64, d=16)
    backend = build_attention({"name": "llsa", "block_size": 16, "topk": 4, "enrich_levels": 0}, dim=48, num_heads=3)
    out = backend(q, k, v, grid_hw=(8, 8), hidden=None)
    torch.testing.assert_close(out, softmax_attention(q, k, v), atol=1e-5, rtol=1e-5)
    sparse = build_attention({"name": "llsa", "block_size": 16, "topk": 1}, dim=48, num_heads=3)
    assert not torch.allclose(sparse(q, k, v, grid_hw=(8, 8), hidden=None), out, atol=1e-3)


def test_llsa_model_trains_on_cpu_and_matches_full_attention_when_dense():
    torch.manual_seed(0)
    options = dict(input_size=(8, 16), depth=2, hidden_size=64, num_heads=2, zero_init=False)
    full = build_model("DiT-T", **options)
    llsa = build_model("DiT-T", **options, attention={"name": "llsa", "block_size": 16, "topk": 8, "enrich_levels": 0})
    llsa.load_state_dict(full.state_dict())
    x, t = torch.randn(2, 3, 8, 16), 1000 * torch.rand(2)
    out = llsa(x, t)
    torch.testing.assert_close(out, full(x, t), atol=1e-4, rtol=1e-4)
    out.square().mean().backward()
    assert all(p.grad is not None for p in llsa.parameters())
    default_llsa = OmegaConf.load(CONFIGS / "attention/llsa.yaml")
    default = build_model("DiT-T", input_size=16, attention=default_llsa)
    assert default(torch.randn(1, 3, 16, 16), torch.ones(1)).shape == (1, 3, 16, 16)


def test_llsa_bad_grid_fails_at_build_with_both_numbers():
    with pytest.raises(PixditError, match=r"6x6 token grid \(36 tokens\).*16"):
        build_model("DiT-T", input_size=6, attention={"name": "llsa"})
    with pytest.raises(PixditError, match=r"num_levels=2.*256"):
        build_model("DiT-T", input_size=(16, 24), attention={"name": "llsa", "num_levels": 2})
    with pytest.raises(PixditError, match="block_size"):
        build_model("DiT-T", input_size=16, attention={"name": "llsa", "block_size": 12})
    with pytest.raises(PixditError, match="token_order='zorder'"):
        build_model("DiT-T", input_size=16, token_order="raster", attention={"name": "llsa"})


@pytest.mark.parametrize("attention", [{"name": "full"}, {"name": "llsa"}])
def test_model_under_bf16_autocast(attention):
    """q, k, v reach the backend in one dtype under autocast (the kernels require it); bf16 output near fp32."""
    torch.manual_seed(0)
    model = build_model(
        "DiT-T", input_size=8, depth=2, hidden_size=64, num_heads=2, attention=attention, zero_init=False
    )
    x, t = torch.randn(2, 3, 8, 8), 1000 * torch.rand(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    torch.testing.assert_close(out.float(), model(x, t), atol=0.1, rtol=0.05)


@pytest.mark.parametrize("name", ["vsa", "sla"])
def test_vsa_sla_backends_build_from_their_configs(name):  # (training tests: tests/kernels/test_{vsa,sla}_backend.py)
    model = build_model("DiT-T", input_size=16, attention=OmegaConf.load(CONFIGS / f"attention/{name}.yaml"))
    assert model.blocks[0].attn.backend.name == name


@register_attention("test_own_parameter")
class OwnParameter(AttentionBackend):
    """A backend with a parameter that must start at 0.5 (as VSA's gates and SLA's projection must start at 0)."""

    def __init__(self, dim, num_heads):
        super().__init__(dim, num_heads)
        self.mix = nn.Linear(dim, dim)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.constant_(self.mix.weight, 0.5)

    def forward(self, q, k, v, *, grid_hw, hidden):
        return softmax_attention(q, k, v)


def test_the_model_init_leaves_backend_parameters_to_the_backend():
    model = build_model("DiT-T", input_size=8, attention={"name": "test_own_parameter"})  # zero_init: DiT's init
    assert all(block.attn.backend.mix.weight.eq(0.5).all() for block in model.blocks)
    model.initialize_weights()
    assert all(block.attn.backend.mix.weight.eq(0.5).all() for block in model.blocks)


@pytest.mark.parametrize("attention", [{"name": "vsa", "topk": 2, "fine_gate": True}, {"name": "sla", "topk": 2}])
def test_backend_parameters_do_not_change_the_rest_of_the_init(attention):
    """The same seed gives the same DiT weights with any backend: the backends' zero-initialised layers draw nothing
    from the random stream and the DiT's xavier pass skips them."""
    torch.manual_seed(0)
    full = build_model("DiT-T", input_size=16, attention={"name": "full"}).state_dict()
    torch.manual_seed(0)
    sparse = build_model("DiT-T", input_size=16, attention=attention).state_dict()
    shared = [key for key in sparse if key in full]
    assert len(shared) == len(full) and len(sparse) > len(full)
    assert all(torch.equal(full[key], sparse[key]) for key in shared)


def _modules(package: Path, prefix: str) -> list[str]:
    names = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).with_suffix("").parts
        names.append(".".join((prefix, *parts[:-1])) if parts[-1] == "__init__" else ".".join((prefix, *parts)))
    return names


MODULES = _modules(ROOT / "src" / "pixdit", "pixdit") + _modules(ROOT / "kernels", "pixdit.kernels")


# In one fresh interpreter that has loaded the heavy third-party libraries but no pixdit module, each module is imported
# in a forked child: every child starts with no pixdit module loaded, as `python -c "import pixdit.X"` would, without
# paying for torch's import ~50 times.
IMPORT_EACH_IN_A_CHILD = """
import os, sys
import hydra, lightning, numpy, omegaconf, torch, triton
for name in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        try:
            __import__(name)
        except BaseException as error:
            print(f"import {name}: {type(error).__name__}: {error}", flush=True)
            os._exit(1)
        os._exit(0)
    os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_every_module_imports_first_without_a_cycle():
    assert "pixdit.attention.base" in MODULES and "pixdit.kernels.common" in MODULES
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_IN_A_CHILD, *MODULES], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_dense_blocks_keep_full_attention_in_the_listed_blocks():
    """attention.dense_blocks: full attention in the listed blocks, the configured backend in the others; the sparse
    backend still decides the token order (block 0 being dense must not switch the model to raster)."""
    model = build_model("DiT-T", input_size=16, attention={"name": "llsa", "dense_blocks": [0, 3]})
    assert [block.attn.backend.name for block in model.blocks] == ["full", "llsa", "llsa", "full"]
    assert model.token_order == "zorder"
    assert [backend.name for backend in model.attention_backends()] == ["full", "llsa"]
    vsa = build_model("DiT-T", input_size=16, attention={"name": "vsa", "topk": 2, "dense_blocks": [1]})
    gated = sorted({key.split(".attn")[0] for key in vsa.state_dict() if ".backend.gate." in key})
    assert gated == ["blocks.0", "blocks.2", "blocks.3"]  # VSA's own parameters only where VSA runs
    # Every block listed = the full-attention model (same seed, same weights, same output): dense blocks really are
    # full attention, not the sparse backend under another name.
    x, t = torch.randn(2, 3, 16, 16), 1000 * torch.rand(2)
    torch.manual_seed(0)
    all_dense = build_model(
        "DiT-T", input_size=16, zero_init=False, attention={"name": "llsa", "dense_blocks": [0, 1, 2, 3]}
    )
    torch.manual_seed(0)
    full = build_model("DiT-T", input_size=16, zero_init=False, attention={"name": "full"})
    assert all_dense.token_order == full.token_order == "raster"
    torch.testing.assert_close(all_dense(x, t), full(x, t), rtol=0, atol=0)
    # An empty list, null, or a bare backend name: the configured backend everywhere.
    for attention in ({"name": "llsa", "dense_blocks": []}, {"name": "llsa", "dense_blocks": None}, "llsa"):
        assert {
            block.attn.backend.name for block in build_model("DiT-T", input_size=16, attention=attention).blocks
        } == {"llsa"}


@pytest.mark.parametrize(
    "dense_blocks, message",
    [
        (
            [0, 4],
            r"attention.dense_blocks=\[0, 4\]: 4 is not a block index; allowed: .*from 0 to 3 \(the model has depth 4\)",
        ),
        ([-1], r"-1 is not a block index.*depth 4"),
        (["0", 1.0], r"'0', 1.0 are not block indices.*depth 4"),
        ([True], r"True is not a block index"),
        (3, r"attention.dense_blocks=3 must be a list of block indices.*depth 4"),
        ([1, 1], r"lists a block twice.*depth 4"),
    ],
)
def test_bad_dense_blocks_are_one_named_error_before_any_block_is_built(dense_blocks, message, monkeypatch):
    from pixdit.models import dit

    built = []
    monkeypatch.setattr(dit.DiTBlock, "__init__", lambda self, *args: built.append(args))
    with pytest.raises(PixditError, match=message):
        build_model("DiT-T", input_size=16, attention={"name": "llsa", "dense_blocks": dense_blocks})
    assert built == []


def test_dense_blocks_is_not_a_backend_option():
    """Building one backend from a config that carries the schedule (configs/attention/*.yaml always do) builds the
    configured backend; the schedule is the model's."""
    backend = build_attention({"name": "llsa", "dense_blocks": [0]}, dim=64, num_heads=2)
    assert backend.name == "llsa"
    for name in ("full", "llsa", "vsa", "sla"):
        assert list(OmegaConf.load(CONFIGS / f"attention/{name}.yaml").dense_blocks) == []  # shown in every config


def test_tokens_per_query_counts_what_each_backend_attends():
    """The attention FLOPs that MFU counts (scripts/bench_train.py): dense = every token; LLSA = llsa_check's count;
    VSA = K tiles + the coarse T x T stage; SLA = K blocks + the linear branch (head_dim)."""
    n = 64 * 64  # 4096 tokens, 256 tiles of 16
    assert build_attention({"name": "full"}, dim=64, num_heads=2).tokens_per_query(n) == n
    llsa = build_attention({"name": "llsa", "num_levels": 2, "topk": 8}, dim=64, num_heads=2)
    assert llsa.tokens_per_query(n) == 8 * 16 + 8 * 16 + n // 256  # fine + level-1 candidates + 16 coarsest tokens
    vsa = build_attention({"name": "vsa", "topk": 20}, dim=64, num_heads=2)
    assert vsa.tokens_per_query(n) == 20 * 16 + 256**2 / n
    sla = build_attention({"name": "sla", "topk": None, "topk_ratio": 0.25}, dim=64, num_heads=2)
    assert sla.tokens_per_query(n) == 64 * 16 + 32


@pytest.mark.parametrize(
    "attention", [{"name": "llsa"}, {"name": "vsa"}, {"name": "sla"}, {"name": "full", "kernel": "triton"}]
)
def test_a_head_dim_the_kernels_cannot_take_is_named_at_build(attention):
    """DiT-XL's 1152 / 16 heads = 72 is no head dim of the Triton kernels (16, 32, 64, 128): one error at build time
    that names the number of heads that fits (18 x 64, same parameters) instead of a ValueError in the first step."""
    with pytest.raises(
        PixditError,
        match=r"head dim in \(16, 32, 64, 128\).*1152 / num_heads 16 = 72; use "
        r"model.num_heads=18 \(head dim 64",
    ):
        build_model("DiT-XL", input_size=(16, 16), depth=1, attention=attention)
    build_model("DiT-XL", input_size=(16, 16), depth=1, attention=attention, num_heads=18)
    build_model("DiT-XL", input_size=(16, 16), depth=1, attention={"name": "full"})  # SDPA takes any head dim


@pytest.mark.parametrize("name", ["vsa", "sla"])
def test_topk_ratio_on_top_of_the_configs_topk_says_to_clear_topk(name):
    """configs/attention/{vsa,sla}.yaml set topk, so `attention.topk_ratio=0.1` alone gives both: the message says to
    pass attention.topk=null too; with it the ratio is used."""
    options = dict(OmegaConf.to_container(OmegaConf.load(CONFIGS / f"attention/{name}.yaml")), topk_ratio=0.1)
    with pytest.raises(PixditError, match=rf"attention={name}: topk=32 and topk_ratio=0.1 are both set.*topk=null"):
        build_attention(options, dim=64, num_heads=2)
    backend = build_attention({**options, "topk": None}, dim=64, num_heads=2)
    extra = {"vsa": 256**2 / 4096, "sla": 32}[name]  # VSA's coarse stage, SLA's linear branch (head dim 32)
    assert backend.tokens_per_query(64 * 64) == 26 * 16 + extra  # K = ceil(0.1 * 256 tiles) = 26, not 32

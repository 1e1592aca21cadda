"""The sampler's fast path: batch size "auto", one static batch shape (the last batch padded) and its checks. The
compiled forward itself runs on CUDA only (tests/test_train_gpu.py times nothing; scripts/bench_sampling.py does)."""

import os
import subprocess
import sys

import pytest
import torch

from pixdit.errors import PixditError
from pixdit.eval.sampling import (
    AUTO_BATCH_CAP,
    SAMPLING_INDUCTOR_OPTIONS,
    auto_batch_size,
    check_batch_size,
    generate_uint8,
    sampling_model,
)
from pixdit.flow import RectifiedFlow
from pixdit.models import build_model

SIZE = (8, 8)


def tiny_model():
    torch.manual_seed(0)
    return build_model(
        "DiT-T", input_size=SIZE, num_classes=3, zero_init=False, depth=2, hidden_size=32, num_heads=2
    ).eval()


def images(batch_size, compile=False, count=7):
    out = dict(
        generate_uint8(
            tiny_model(),
            RectifiedFlow(image_size=SIZE),
            range(count),
            image_size=SIZE,
            seed=3,
            steps=2,
            num_classes=3,
            cfg_scale=1.5,
            batch_size=batch_size,
            compile=compile,
        )
    )
    return torch.cat(list(out.values())), torch.cat(list(out.keys()))


def test_padded_static_batches_and_auto_give_the_same_images():
    reference, order = images(3)  # 3 + 3 + 1
    for batch_size, compile in ((3, True), ("auto", False), ("auto", True), (100, True)):
        got, got_order = images(batch_size, compile)
        assert torch.equal(got_order, order) and torch.equal(got, reference), (batch_size, compile)


def test_auto_batch_size_is_the_cap_on_cpu():
    assert auto_batch_size(tiny_model(), SIZE, "cpu", "fp32", num_classes=3) == AUTO_BATCH_CAP


@pytest.mark.parametrize("bad", [0, -2, 2.5, "big", True, None])
def test_batch_size_must_be_a_positive_int_or_auto(bad):
    with pytest.raises(PixditError, match=r"my\.batch_size=.* must be a positive int or auto"):
        check_batch_size(bad, "my.batch_size")
    assert check_batch_size(4) == 4 and check_batch_size("auto") == "auto"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["full", "llsa"])
def test_compiled_auto_batch_on_cuda_matches_eager(attention):
    """The fast path on the GPU (compiled forward, batch size from free memory, padded last batch) gives the images of
    the eager sampler up to bf16 rounding: the mean pixel differs by < 1 level and at most 1% of pixels by > 8."""
    size = (32, 32)
    torch.manual_seed(0)
    model = (
        build_model("DiT-T", input_size=size, num_classes=3, zero_init=False, depth=2, attention={"name": attention})
        .eval()
        .cuda()
    )

    def sample(batch_size, compile):
        out = dict(
            generate_uint8(
                model,
                RectifiedFlow(image_size=size),
                range(10),
                image_size=size,
                seed=3,
                steps=4,
                num_classes=3,
                cfg_scale=1.5,
                batch_size=batch_size,
                device="cuda",
                precision="bf16",
                compile=compile,
            )
        )
        return torch.cat(list(out.values())).float(), torch.cat(list(out.keys()))

    eager, order = sample(4, False)
    fast, fast_order = sample("auto", True)
    assert torch.equal(fast_order, order) and fast.shape == eager.shape == (10, 3, *size)
    difference = (fast - eager).abs()
    assert difference.mean() < 1.0 and (difference > 8).float().mean() < 0.01, difference.mean()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention", ["full", "llsa"])
def test_fused_qkv_gemm_samples_the_images_of_the_two_ops(attention, monkeypatch):
    """``Attention.fuse_inference_qkv`` (the projection with qk-norm + RoPE + means in one GEMM) in the compiled
    sampler: the images of the two-launch form up to bf16 rounding, and the fused kernel did run."""
    from pixdit.models import dit

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)

    fused = dit.qkv_norm_rope
    monkeypatch.setattr(dit, "qkv_norm_rope", counted)
    size = (64, 64)
    torch.manual_seed(0)
    model = build_model("DiT-T", input_size=size, zero_init=False, depth=2, attention={"name": attention}).eval()
    model = model.cuda()

    def sample(fuse):
        monkeypatch.setattr(dit.Attention, "fuse_inference_qkv", fuse)
        torch.compiler.reset()
        out = generate_uint8(
            model, RectifiedFlow(image_size=size), range(6), image_size=size, seed=3, steps=4, batch_size=6,
            device="cuda", precision="bf16", compile=True,
        )  # fmt: skip
        model._compiled_call_impl = None  # compile anew with the other setting
        return torch.cat(list(dict(out).values())).float()

    two_ops = sample(False)
    assert not calls
    one_gemm = sample(True)
    assert calls  # traced into the compiled graph (the custom op runs inside it)
    difference = (one_gemm - two_ops).abs()
    assert difference.mean() < 1.0 and (difference > 8).float().mean() < 0.01, difference.mean()


@pytest.mark.parametrize(
    "mode, mode_options",
    [(None, {}), ("max-autotune-no-cudagraphs", {"max_autotune": True, "coordinate_descent_tuning": True})],
)
def test_sampling_model_compiles_with_the_modes_options_and_ours(monkeypatch, mode, mode_options):
    model = tiny_model()
    calls = []
    monkeypatch.setattr(model, "compile", lambda **kwargs: calls.append(kwargs))
    assert sampling_model(model, "cpu", compile=True, mode=mode) is model and calls == []  # CPU: never compiled
    sampling_model(model, "cuda", compile=True, mode=mode)  # nothing runs: model.compile is the spy
    options = {**mode_options, "triton.multi_kernel": 1, "fx_graph_cache": False}
    assert calls == [dict(dynamic=False, options=options)]


def test_sampling_inductor_options_are_inductor_settings():
    # torch.compile checks the option names when it is called, before anything is compiled
    torch.compile(torch.nn.Linear(2, 2), options=SAMPLING_INDUCTOR_OPTIONS)
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        torch.compile(torch.nn.Linear(2, 2), options={"triton.multi_kernels": 1})


SECOND_PROCESS = """
import torch
from pixdit.eval.sampling import sampling_model
from pixdit.models import build_model
from pixdit.runtime import autocast

torch.manual_seed(0)
size = (32, 32)
model = build_model("DiT-T", input_size=size, depth=2, hidden_size=384, num_heads=6, attention={"name": "llsa"})
model = sampling_model(model.eval().cuda(), "cuda", compile=True)
x, t = torch.randn(2, 3, *size, device="cuda"), torch.full((2,), 500.0, device="cuda")
with torch.no_grad(), autocast("cuda", "bf16"):
    out = model(x, t, None)
assert torch.isfinite(out).all()
print("sampled", tuple(out.shape))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_sampler_in_a_second_process_on_the_same_machine(tmp_path):
    """A second evaluation on a machine compiles the sampler where the first one left Inductor's on-disk caches: with
    the FX graph cache on, torch 2.11 crashed loading the multi-kernels of the cached graph (SAMPLING_INDUCTOR_OPTIONS).
    Two processes, one cache folder; the first must have generated multi-kernels, or this test tests nothing."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    for run in ("first", "second"):
        done = subprocess.run([sys.executable, "-c", SECOND_PROCESS], env=env, capture_output=True, text=True)
        assert done.returncode == 0 and "sampled (2, 3, 32, 32)" in done.stdout, f"{run}: {done.stderr[-3000:]}"
        if run == "first":
            code = [p.read_text(errors="replace") for p in (tmp_path / "inductor").rglob("*.py")]
            assert any("multi_kernel(" in text for text in code), "no multi-kernel in the generated code"

"""torch.compile of the DiT with every attention backend gives the eager model's output and gradients.

The kernels are torch custom ops, opaque to torch.compile, which traces everything around them: the whole model
compiles as one graph (``fullgraph=True``, no graph break; see the pixdit.kernels docstring). On CPU the check runs
Dynamo + AOTAutograd without code generation (backend "aot_eager": no C++ compiler needed) over the kernels' PyTorch
path; on CUDA it runs Inductor, the real ``compile=true`` of train.py, over the Triton kernels under bf16 autocast.

    .venv/bin/python -m pytest tests/test_compile.py            # CPU part
    .venv/bin/python -m pytest -m gpu tests/test_compile.py     # CUDA part
"""

from __future__ import annotations

import copy

import pytest
import torch

from pixdit.models import build_model

BACKENDS = {
    "full": {"name": "full"},
    "llsa": {"name": "llsa", "num_levels": 2, "topk": 4},
    "vsa": {"name": "vsa", "topk": 8},
    "sla": {"name": "sla", "topk": 8},
}


def live_model(attention: dict, side: int, device: str) -> torch.nn.Module:
    """DiT-T whose every parameter matters: the reference init (no adaLN-Zero) plus noise on all weights, so that the
    zero-initialised gates of VSA / SLA and the attention outputs reach the loss."""
    torch.manual_seed(0)
    model = build_model(
        "DiT-T", input_size=side, attention=attention, zero_init=False, num_classes=10, class_dropout=0.0
    )  # no label dropout: no random draw to differ
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.to(device)


def loss_and_grads(model, x, t, y, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(x, t, y)
    loss = (out.float() ** 2).mean()
    loss.backward()
    return out.detach().float(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def check_compiled_matches_eager(attention: dict, device: str, backend: str, side: int, tolerance: float):
    eager = live_model(attention, side, device)
    compiled = copy.deepcopy(eager)
    torch._dynamo.reset()
    compiled.compile(backend=backend, fullgraph=True)  # no graph break: the kernels are custom ops
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, side, side, generator=generator).to(device)
    t = (torch.rand(2, generator=generator) * 1000).to(device)
    y = torch.tensor([3, 7], device=device)
    autocast = device == "cuda"
    out_ref, grads_ref = loss_and_grads(eager, x, t, y, autocast)
    out, grads = loss_and_grads(compiled, x, t, y, autocast)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()

    assert out_ref.abs().max() > 0 and rel(out, out_ref) < tolerance
    for name, grad_ref in grads_ref.items():
        assert grad_ref.abs().max() > 0, f"{name} gets no gradient: the check would be vacuous"
        assert rel(grads[name], grad_ref) < tolerance, f"{attention['name']}: gradient of {name} differs"


@pytest.mark.parametrize("name", list(BACKENDS))
def test_compile_cpu_matches_eager(name):
    check_compiled_matches_eager(BACKENDS[name], "cpu", "aot_eager", side=32, tolerance=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(BACKENDS))
def test_compile_gpu_matches_eager(name):
    # bf16 autocast: Inductor fuses (and so rounds) differently from eager, hence a bf16-sized tolerance
    check_compiled_matches_eager(BACKENDS[name], "cuda", "inductor", side=64, tolerance=3e-2)

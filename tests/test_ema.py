"""EMA maths against an independent scalar recurrence: .venv/bin/python -m pytest tests/test_ema.py"""

import torch
from torch import nn

from pixdit.ema import EMA


def test_ema_matches_recipe_recurrence():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ema = EMA(model, max_decay=0.9999, power=0.75)
    expected = [p.detach().double().clone() for p in model.parameters()]
    for n in range(1, 60):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        decay = min(0.9999, 1.0 - n**-0.75)
        for e, p in zip(expected, model.parameters()):
            e.sub_((1.0 - decay) * (e - p.detach().double()))
        used = ema.update(model)
        assert abs(used - decay) < 1e-15
    for e, p in zip(expected, ema.model.parameters()):
        torch.testing.assert_close(p.double(), e, rtol=0, atol=1e-6)
    assert int(ema.num_updates) == 59


def test_first_update_copies_weights_and_decay_caps():
    model = nn.Linear(4, 4)
    ema = EMA(model)
    with torch.no_grad():
        model.weight.fill_(3.0)
    assert ema.update(model) == 0.0  # 1 - 1^(-3/4) = 0: the first update is a copy
    assert torch.equal(ema.model.weight, model.weight)
    assert ema.decay(10**9) == 0.9999  # capped
    assert abs(ema.decay(44_000) - (1 - 44_000**-0.75)) < 1e-12  # ~0.9997 after 44k updates


def test_ema_is_fp32_frozen_saved_and_restored():
    model = nn.Linear(4, 4).to(torch.bfloat16)
    ema = EMA(model)
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in ema.model.parameters())
    ema.update(model)
    ema.update(model)
    state = ema.state_dict()
    assert int(state["num_updates"]) == 2
    other = EMA(nn.Linear(4, 4).to(torch.bfloat16))
    other.load_state_dict(state)
    assert int(other.num_updates) == 2 and other.update_count == 2
    assert other.update(model) == other.decay(3)  # the loaded count goes on
    assert int(other.num_updates) == 3
    assert torch.equal(other.model.weight, ema.model.weight)
    other.train()
    assert not other.model.training  # the average never runs in training mode
    other.reset(model)
    assert int(other.num_updates) == 0 == other.update_count and torch.equal(other.model.weight, model.weight.float())

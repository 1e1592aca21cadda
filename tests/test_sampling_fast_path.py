"""The sampler's fast path: batch size "auto", one static batch shape (the last batch padded) and its checks. The
compiled forward itself runs on CUDA only (tests/test_train_gpu.py times nothing; scripts/bench_sampling.py does)."""

import pytest
import torch

from pixdit.errors import PixditError
from pixdit.eval.sampling import AUTO_BATCH_CAP, auto_batch_size, check_batch_size, generate_uint8
from pixdit.flow import RectifiedFlow
from pixdit.models import build_model

SIZE = (8, 8)


def tiny_model():
    torch.manual_seed(0)
    return build_model("DiT-T", input_size=SIZE, num_classes=3, zero_init=False, depth=2, hidden_size=32,
                       num_heads=2).eval()


def images(batch_size, compile=False, count=7):
    out = dict(generate_uint8(tiny_model(), RectifiedFlow(image_size=SIZE), range(count), image_size=SIZE, seed=3,
                              steps=2, num_classes=3, cfg_scale=1.5, batch_size=batch_size, compile=compile))
    return torch.cat(list(out.values())), torch.cat(list(out.keys()))


def test_padded_static_batches_and_auto_give_the_same_images():
    reference, order = images(3)                 # 3 + 3 + 1
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

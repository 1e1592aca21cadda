"""A stand-in for the Inception weights file (inception-2015-12-05.pt), with the same TorchScript interface.

The real file is a 100 MB download this CI machine cannot make. The stand-in replaces only the weights file: a small
scripted module with the attributes and call signature the real one has: `layers`, a sequence of named blocks on
(x - 128) / 128 normalised 299x299 input ending in [b, 2048, 1, 1], whose block `mixed_6` has a `conv` branch with a
17x17 output (the sFID node); `output` = Linear(2048 -> 1008); and
`forward(img, return_features=False, use_fp16=False, no_output_bias=False)` that resizes to 299 the way the real file
does (TF's bilinear resize, emulated with an affine grid) and returns features or softmax probabilities. Everything
else in the tests - clean-fid's loader `InceptionV3W`, its resize, our statistics - is the real code path.
"""

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pixdit.errors import PixditError
from pixdit.eval import INCEPTION_FILENAME, InceptionFeatureExtractor
from pixdit.eval.inception import tensorflow_bilinear_resize

# Only the first 64 of the 2048 features vary (the rest are exactly 0): frechet_distance drops dimensions without
# variance (exactly), so a 2048-d FID costs milliseconds here instead of ~10 s of eigen-solves on a 2-core CPU.
ACTIVE_FEATURES = 64


class _CornerConv(nn.Module):
    """1x1 conv + ReLU whose output is 0 outside the top-left 4x4 of the 17x17 grid: like ACTIVE_FEATURES, this keeps
    the 2023-d sFID covariances cheap (112 varying dimensions)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 8, 1)
        mask = torch.zeros(1, 1, 17, 17)
        mask[..., :4, :4] = 1
        self.register_buffer("mask", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv(x)) * self.mask


class _Mixed6(nn.Module):
    """Two branches concatenated, like the real block; `conv` is the branch sFID reads."""

    def __init__(self):
        super().__init__()
        self.conv = _CornerConv()
        self.tower = nn.Sequential(nn.Conv2d(8, 8, 1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.conv(x), self.tower(x)], dim=1)


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16 * 4 * 4, ACTIVE_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.proj(x.flatten(1)))
        return F.pad(features, (0, 2048 - features.shape[1])).reshape(-1, 2048, 1, 1)


def _standin_layers() -> nn.Sequential:
    return nn.Sequential(
        OrderedDict(
            pool0=nn.AdaptiveAvgPool2d(17),
            conv=nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU()),
            mixed_6=_Mixed6(),
            pool2=nn.AdaptiveAvgPool2d(4),
            head=_Head(),
        )
    )


class _StandinInception(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = _standin_layers()
        self.output = nn.Linear(2048, 1008)

    def forward(
        self, img: torch.Tensor, return_features: bool = False, use_fp16: bool = False, no_output_bias: bool = False
    ) -> torch.Tensor:
        b, c, height, width = img.shape
        theta = torch.eye(2, 3, device=img.device)
        theta[0, 2] += theta[0, 0] / width - theta[0, 0] / 299
        theta[1, 2] += theta[1, 1] / height - theta[1, 1] / 299
        grid = F.affine_grid(theta.unsqueeze(0).repeat(b, 1, 1), [b, c, 299, 299], align_corners=False)
        x = F.grid_sample(img.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
        features = self.layers((x - 128.0) / 128.0).reshape(-1, 2048)
        if return_features:
            return features
        logits = F.linear(features, self.output.weight) if no_output_bias else self.output(features)
        return torch.softmax(logits, dim=1)


def write_standin_inception(folder) -> Path:
    """Save the scripted stand-in as <folder>/inception-2015-12-05.pt and return the path."""
    torch.manual_seed(1234)
    path = Path(folder) / INCEPTION_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.script(_StandinInception().eval()).save(str(path))
    return path


def test_extractor_uses_clean_resize_and_matches_the_networks_own_outputs(tmp_path):
    from cleanfid.resize import build_resizer

    path = write_standin_inception(tmp_path)
    extractor = InceptionFeatureExtractor(path)
    images = torch.randint(0, 256, (3, 3, 40, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    features, logits = extractor(images)
    assert features.shape == (3, 2048) and logits.shape == (3, 1008)
    # The clean resize is clean-fid's (PIL bicubic on float32), image by image.
    resize = build_resizer("clean")
    expected = torch.stack(
        [torch.from_numpy(resize(im.permute(1, 2, 0).numpy()).transpose(2, 0, 1).copy()) for im in images]
    )
    assert torch.equal(extractor.resize_batch(images), expected)
    # Features and bias-free class probabilities agree with the TorchScript module's own forward on the resized input.
    network = torch.jit.load(str(path))
    torch.testing.assert_close(features, network(expected, return_features=True))
    torch.testing.assert_close(torch.softmax(logits, 1), network(expected, no_output_bias=True))


@pytest.mark.parametrize("mode", ["clean", "legacy_tensorflow"])
def test_spatial_features_are_mixed_6_conv_first_7_channels_in_tf_order(tmp_path, mode):
    path = write_standin_inception(tmp_path)
    extractor = InceptionFeatureExtractor(path, mode=mode, spatial=True)
    images = torch.randint(0, 256, (3, 3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    out = extractor.extract(images)
    assert out["spatial"].shape == (3, 7 * 17 * 17)
    # Independently: the network's own forward for the pool features, and mixed_6.conv on the normalised input
    network = torch.jit.load(str(path))
    resized = extractor.resize_batch(images)
    if mode == "legacy_tensorflow":
        torch.testing.assert_close(out["pool"], network(images.float(), return_features=True))
        resized = tensorflow_bilinear_resize(resized, 299)
    else:
        torch.testing.assert_close(out["pool"], network(resized, return_features=True))
    x = (resized - 128) / 128
    x = network.layers.conv(network.layers.pool0(x))
    mixed_6_conv = network.layers.mixed_6.conv(x)  # [b, 8, 17, 17]
    expected = mixed_6_conv[:, :7].permute(0, 2, 3, 1).reshape(3, -1)  # (h, w, c) as TF's NHWC flatten
    torch.testing.assert_close(out["spatial"], expected)
    assert out["spatial"][0, :7].tolist() == pytest.approx(mixed_6_conv[0, :7, 0, 0].tolist())


def test_spatial_features_refuse_a_file_whose_blocks_do_not_chain(tmp_path):
    class NotSequential(_StandinInception):  # same block names, but its forward does not simply chain them
        def forward(
            self, img: torch.Tensor, return_features: bool = False, use_fp16: bool = False, no_output_bias: bool = False
        ) -> torch.Tensor:
            return torch.zeros(img.shape[0], 2048)

    class Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.pool0, self.conv, self.mixed_6 = nn.AdaptiveAvgPool2d(17), nn.Conv2d(3, 8, 1), _Mixed6()
            self.pool2, self.head = nn.AdaptiveAvgPool2d(4), _Head()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.pool2(self.mixed_6(self.conv(self.pool0(-x)))))  # not a plain chain

    module = NotSequential()
    module.layers = Layers()
    path = tmp_path / INCEPTION_FILENAME
    torch.jit.script(module.eval()).save(str(path))
    InceptionFeatureExtractor(path)  # FID alone does not need the block structure
    with pytest.raises(PixditError, match="(?s)mixed_6/conv.*leave sfid out"):
        InceptionFeatureExtractor(path, spatial=True)

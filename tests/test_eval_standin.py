"""A stand-in for the Inception weights file (inception-2015-12-05.pt), with the same TorchScript interface.

The real file is a 100 MB download this CI machine cannot make. The stand-in replaces only the weights file: a small
scripted module with the attributes and call signature the real one has (`layers(x) -> [b, 2048, 1, 1]` on
(x - 128) / 128 normalised 299x299 input, `output` = Linear(2048 -> 1008), and
`forward(img, return_features=False, use_fp16=False, no_output_bias=False)` that resizes to 299 and returns features
or softmax probabilities). Everything else in the tests - clean-fid's loader `InceptionV3W`, its resize, our
statistics - is the real code path.
"""

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pixdit.eval import INCEPTION_FILENAME, InceptionFeatureExtractor

# Only the first 64 of the 2048 features vary (the rest are exactly 0): frechet_distance drops dimensions without
# variance (exactly), so a 2048-d FID costs milliseconds here instead of ~10 s of eigen-solves on a 2-core CPU.
ACTIVE_FEATURES = 64


class _StandinLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.proj = nn.Linear(3 * 4 * 4, ACTIVE_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = torch.relu(self.proj(self.pool(x).flatten(1)))
        return F.pad(features, (0, 2048 - features.shape[1])).reshape(-1, 2048, 1, 1)


class _StandinInception(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = _StandinLayers()
        self.output = nn.Linear(2048, 1008)

    def forward(self, img: torch.Tensor, return_features: bool = False, use_fp16: bool = False,
                no_output_bias: bool = False) -> torch.Tensor:
        x = F.interpolate(img.float(), size=(299, 299), mode="bilinear", align_corners=False)
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
    expected = torch.stack([torch.from_numpy(resize(im.permute(1, 2, 0).numpy()).transpose(2, 0, 1).copy())
                            for im in images])
    assert torch.equal(extractor.resize_batch(images), expected)
    # Features and bias-free class probabilities agree with the TorchScript module's own forward on the resized input.
    network = torch.jit.load(str(path))
    torch.testing.assert_close(features, network(expected, return_features=True))
    torch.testing.assert_close(torch.softmax(logits, 1), network(expected, no_output_bias=True))

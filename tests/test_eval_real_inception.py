"""Checks against the REAL Inception weights file; skipped when it is absent (CI has no network to download it).

Runs when `inception-2015-12-05.pt` is in /tmp (where clean-fid keeps it) or PIXDIT_INCEPTION_PATH points to it:
  * our features == clean-fid's own folder pipeline (`get_folder_features` with `build_feature_extractor("clean")`)
    on PNG files, i.e. the same resize, network and normalisation;
  * our IS class probabilities == the TorchScript module's own `forward(x, no_output_bias=True)` on the 299x299
    resized batch (its internal resize is the identity at 299);
  * the sFID features can be read from the file: its blocks run one by one reproduce its output (checked by the
    extractor when built with spatial=True), in both Inception modes, and mixed_6/conv gives 7 x 17 x 17 values.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pixdit.eval import INCEPTION_FILENAME, InceptionFeatureExtractor

WEIGHTS = Path(os.environ.get("PIXDIT_INCEPTION_PATH", f"/tmp/{INCEPTION_FILENAME}"))
pytestmark = pytest.mark.skipif(not WEIGHTS.is_file(), reason=f"real Inception weights not at {WEIGHTS}")


def test_features_and_probabilities_match_cleanfid_and_the_network(tmp_path):
    from cleanfid.features import build_feature_extractor
    from cleanfid.fid import get_folder_features

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (6, 48, 40, 3), dtype=np.uint8)
    for i, image in enumerate(images):
        Image.fromarray(image).save(tmp_path / f"{i:03d}.png")
    extractor = InceptionFeatureExtractor(WEIGHTS, device=device)
    features, logits = extractor(torch.from_numpy(images).permute(0, 3, 1, 2))
    if WEIGHTS.parent == Path("/tmp"):  # clean-fid's own pipeline loads the file from /tmp only
        reference = get_folder_features(
            str(tmp_path),
            build_feature_extractor("clean", device, use_dataparallel=False),
            num_workers=0,
            batch_size=6,
            device=device,
            verbose=False,
        )
        np.testing.assert_allclose(features.cpu().numpy(), reference, rtol=1e-4, atol=1e-4)
    resized = extractor.resize_batch(torch.from_numpy(images).permute(0, 3, 1, 2)).to(device)
    network = torch.jit.load(str(WEIGHTS)).to(device).eval()
    with torch.no_grad():
        probabilities = network(resized, no_output_bias=True)
    torch.testing.assert_close(torch.softmax(logits, 1), probabilities, rtol=1e-4, atol=1e-5)
    assert logits.shape == (6, 1008)


@pytest.mark.parametrize("mode", ["clean", "legacy_tensorflow"])
def test_spatial_features_from_the_real_file(mode):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    extractor = InceptionFeatureExtractor(WEIGHTS, device=device, mode=mode, spatial=True)  # checks the block pass
    images = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (4, 3, 64, 64), dtype=np.uint8))
    out = extractor.extract(images)
    assert out["spatial"].shape == (4, 2023) and out["pool"].shape == (4, 2048)
    torch.testing.assert_close(
        out["pool"], extractor.network(extractor.resize_batch(images).to(device)).float(), rtol=1e-4, atol=1e-4
    )

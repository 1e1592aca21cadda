"""The metric suite: sFID, precision/recall, FD-DINOv2, ADM-format batches as references, and the start-up checks.

Uses the stand-in Inception file (tests/test_eval_standin.py) and a small random-weight DINOv2 (timm's ViT-L/14
architecture with depth 1 and width 32): the real weights are downloads this machine cannot make.
"""

import numpy as np
import pytest
import torch
from test_eval_pipeline import SIZE, tiny_model, write_tiny_shards
from test_eval_standin import write_standin_inception

from pixdit.errors import PixditError
from pixdit.eval import (
    DINOV2_FILENAME,
    DINOV2_URL,
    DINOv2FeatureExtractor,
    InceptionFeatureExtractor,
    MetricSuite,
    build_suite,
    evaluate_generator,
    generate_uint8,
    load_reference,
    save_adm_npz,
    summarize_seeds,
)
from pixdit.eval.dinov2 import resample_pos_embed_like_dinov2
from pixdit.eval.metrics import complete_reference
from pixdit.eval.reference import make_reference_stats
from pixdit.flow import RectifiedFlow

TINY_DINOV2 = dict(depth=1, embed_dim=32, num_heads=2)
GENERATION = dict(num_samples=16, image_size=SIZE, steps=2, seed=5, num_classes=3, batch_size=8)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return write_standin_inception(tmp_path_factory.mktemp("inception"))


@pytest.fixture(scope="module")
def dinov2_file(tmp_path_factory):
    """Random weights of the small architecture, saved the way the official checkpoint is: with the mask token and
    position embeddings for 518 px (37 x 37 patches)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_large_patch14_dinov2", pretrained=False, num_classes=0, img_size=518, **TINY_DINOV2)
    state = model.state_dict()
    state["pos_embed"] = torch.randn_like(state["pos_embed"]) * 0.02
    state["mask_token"] = torch.zeros(1, TINY_DINOV2["embed_dim"])
    path = tmp_path_factory.mktemp("dinov2") / DINOV2_FILENAME
    torch.save(state, path)
    return path


def generated_adm_npz(path, steps=2, sampler="euler"):
    """The tiny model's samples 0..15 written in the ADM suite's format."""
    batches = list(
        generate_uint8(
            tiny_model(),
            RectifiedFlow(image_size=SIZE),
            range(16),
            image_size=SIZE,
            seed=5,
            steps=steps,
            sampler=sampler,
            num_classes=3,
        )
    )
    images = torch.cat([b for _, b in batches]).permute(0, 2, 3, 1).numpy()
    return save_adm_npz(path, images, np.arange(16) % 3), images


def test_adm_sample_batch_round_trips_as_a_reference(tmp_path, weights, dinov2_file):
    """Samples written by save_adm_npz, read back as the reference: the same generator's metrics against it are those
    of a set against itself (FID, sFID, FD-DINOv2 = 0; precision = recall = 1)."""
    path, images = generated_adm_npz(tmp_path / "samples.npz")
    with np.load(path) as data:
        assert sorted(data.files) == ["arr_0", "arr_1"] and data["arr_0"].dtype == np.uint8
        np.testing.assert_array_equal(data["arr_0"], images)
    reference = load_reference(str(path), resolution=8)
    assert reference.images.shape == (16, 8, 8, 3) and reference.mu is None and reference.id.startswith("adm:")
    metrics = ("fid", "sfid", "precision_recall", "fd_dinov2")
    inception = InceptionFeatureExtractor(weights, spatial=True)
    dinov2 = DINOv2FeatureExtractor(dinov2_file, **TINY_DINOV2)
    reference = complete_reference(reference, metrics, inception, dinov2)
    assert reference.mu_s.shape == (2023,) and reference.features.shape == (16, 2048)
    assert reference.description["computed_from_images"] == ["dinov2", "features", "pool", "spatial"]
    result = evaluate_generator(
        tiny_model(), RectifiedFlow(image_size=SIZE), MetricSuite(metrics, inception, reference, dinov2), **GENERATION
    )
    assert result["fid"] == pytest.approx(0, abs=1e-6) and result["sfid"] == pytest.approx(0, abs=1e-6)
    assert result["fd_dinov2"] == pytest.approx(0, abs=1e-6)
    assert result["precision"] == 1.0 and result["recall"] == 1.0
    # Another sampler's images differ: every distance becomes positive.
    other, _ = generated_adm_npz(tmp_path / "heun.npz", steps=3, sampler="heun")
    reference = complete_reference(load_reference(str(other)), metrics, inception, dinov2)
    result = evaluate_generator(
        tiny_model(), RectifiedFlow(image_size=SIZE), MetricSuite(metrics, inception, reference, dinov2), **GENERATION
    )
    assert result["fid"] > 0 and result["sfid"] > 0 and result["fd_dinov2"] > 0


def test_reference_statistics_from_shards_with_sfid_and_dinov2(tmp_path, weights, dinov2_file):
    write_tiny_shards(tmp_path / "shards", count=20)
    inception = InceptionFeatureExtractor(weights, spatial=True)
    dinov2 = DINOv2FeatureExtractor(dinov2_file, **TINY_DINOV2)
    path = make_reference_stats(
        tmp_path / "shards", inception, batch_size=8, dinov2=dinov2, kid=True, progress=lambda message: None
    )
    reference = load_reference(str(path), resolution=8)
    # Independent: all 20 images in one batch, numpy mean / covariance.
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8)).permute(0, 3, 1, 2)
    spatial = inception.extract(pixels)["spatial"].double().numpy()
    np.testing.assert_allclose(reference.mu_s, spatial.mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(reference.sigma_s, np.cov(spatial, rowvar=False), rtol=1e-4, atol=1e-7)
    dino = dinov2(pixels).double().numpy()
    np.testing.assert_allclose(reference.mu_dinov2, dino.mean(0), rtol=1e-5, atol=1e-6)
    assert reference.description["sfid"] and reference.description["dinov2"]
    assert reference.inception_mode == "clean" and reference.features.shape == (20, 2048)


def test_dinov2_extractor_is_the_edm2_pipeline(dinov2_file):
    """Features = class token after the final norm of the network on bicubic-antialiased 224 px, ImageNet-normalised
    input; the 37 x 37 position embeddings are resampled the way DINOv2's own model does it for 16 x 16."""
    extractor = DINOv2FeatureExtractor(dinov2_file, **TINY_DINOV2)
    state = torch.load(dinov2_file, weights_only=True)
    pos = extractor.model.pos_embed.detach()
    assert pos.shape == (1, 1 + 16 * 16, 32)
    torch.testing.assert_close(pos[:, 0], state["pos_embed"][:, 0])  # class token's embedding unchanged
    grid = state["pos_embed"][:, 1:].reshape(1, 37, 37, 32).permute(0, 3, 1, 2)
    official = torch.nn.functional.interpolate(grid, scale_factor=(16.1 / 37, 16.1 / 37), mode="bicubic")
    torch.testing.assert_close(pos[:, 1:], official.permute(0, 2, 3, 1).reshape(1, 256, 32))
    sized = torch.nn.functional.interpolate(grid, size=(16, 16), mode="bicubic", antialias=True)
    assert not torch.allclose(official, sized)  # timm's own resampling would give other features
    images = torch.randint(0, 256, (3, 3, 40, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    x = torch.nn.functional.interpolate(images.float(), size=(224, 224), mode="bicubic", antialias=True) / 255
    x = (x - torch.tensor([0.485, 0.456, 0.406]).reshape(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).reshape(
        1, 3, 1, 1
    )
    expected = extractor.model.forward_features(x)[:, 0]  # timm: tokens after the final norm; 0 = class token
    torch.testing.assert_close(extractor(images), expected)
    assert resample_pos_embed_like_dinov2(state["pos_embed"], 37) is state["pos_embed"]


def test_dinov2_weights_missing_or_wrong_are_named(tmp_path, dinov2_file):
    from pixdit.eval import resolve_dinov2_path

    with pytest.raises(PixditError, match=rf"(?s)eval.dinov2_path=/path/to/{DINOV2_FILENAME}.*{DINOV2_URL}"):
        resolve_dinov2_path(None)
    with pytest.raises(PixditError, match=rf"(?s)not found at {tmp_path}/{DINOV2_FILENAME}.*callbacks.fid.dinov2_path"):
        resolve_dinov2_path(str(tmp_path), config_prefix="callbacks.fid")
    with pytest.raises(PixditError, match="does not hold DINOv2 ViT-L/14 weights"):
        DINOv2FeatureExtractor(dinov2_file, depth=2, embed_dim=32, num_heads=2)  # a block missing
    (tmp_path / "broken.pth").write_bytes(b"<html>")
    with pytest.raises(PixditError, match="not a loadable DINOv2 checkpoint"):
        DINOv2FeatureExtractor(tmp_path / "broken.pth", **TINY_DINOV2)


def test_build_suite_checks_before_loading_anything(tmp_path, weights):
    path, _ = generated_adm_npz(tmp_path / "samples.npz")
    options = dict(resolution=8, inception_path=str(weights))
    with pytest.raises(PixditError, match="unknown metric.*'fud'.*allowed: fid, is, kid, sfid, precision_recall"):
        build_suite(["fid", "fud"], str(path), **options)
    with pytest.raises(PixditError, match="callbacks.fid.metrics='fid' must be a list"):
        build_suite("fid", str(path), prefix="callbacks.fid", **options)
    with pytest.raises(PixditError, match="resolution 8, but samples are 16"):
        build_suite(["fid"], str(path), **{**options, "resolution": 16})
    with pytest.raises(PixditError, match="(?s)fd_dinov2 needs the DINOv2.*eval.dinov2_path"):
        build_suite(["fid", "fd_dinov2"], str(path), **options)  # before the reference is even read
    with pytest.raises(PixditError, match="inception_mode='tf'; allowed: clean, legacy_tensorflow"):
        build_suite(["fid"], str(path), inception_mode="tf", **options)
    with pytest.raises(PixditError, match="fid, sfid need.*set eval.reference"):
        build_suite(["is", "fid", "sfid"], None, **options)
    suite = build_suite(["is"], None, **options)  # the Inception Score needs no reference
    assert suite.reference is None and suite.inception is not None and suite.dinov2 is None


def test_reference_of_the_wrong_kind_is_refused(tmp_path, weights):
    # An ADM reference batch: images plus statistics from the ADM suite's TF graph (legacy_tensorflow pipeline).
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (12, 8, 8, 3), dtype=np.uint8)
    stats = dict(mu=np.zeros(2048), sigma=np.eye(2048), mu_s=np.zeros(2023), sigma_s=np.eye(2023))
    np.savez(tmp_path / "VIRTUAL_ref.npz", arr_0=images, **stats)
    options = dict(resolution=8, inception_path=str(weights))
    with pytest.raises(PixditError, match="(?s)fid: .*'legacy_tensorflow'.*eval.inception_mode=legacy_tensorflow"):
        build_suite(["fid", "precision_recall"], str(tmp_path / "VIRTUAL_ref.npz"), **options)
    suite = build_suite(
        ["fid", "sfid", "precision_recall"],
        str(tmp_path / "VIRTUAL_ref.npz"),
        inception_mode="legacy_tensorflow",
        **options,
    )
    np.testing.assert_array_equal(suite.reference.mu, stats["mu"])  # the file's statistics are used as they are
    assert suite.reference.features.shape == (12, 2048)  # precision/recall: computed from arr_0
    # Our statistics without the spatial part cannot serve sFID; the message names the flag that adds it.
    write_tiny_shards(tmp_path / "shards", count=12)
    ours = make_reference_stats(
        tmp_path / "shards", InceptionFeatureExtractor(weights), batch_size=8, progress=lambda message: None
    )
    with pytest.raises(
        PixditError,
        match=r"(?s)sfid: the reference has no spatial statistics.*--sfid.*"
        r"precision_recall: .*--kid",
    ):
        build_suite(["fid", "sfid", "precision_recall"], str(ours), **options)
    np.savez(tmp_path / "nothing.npz", labels=np.arange(3))
    with pytest.raises(PixditError, match="neither statistics"):
        build_suite(["fid"], str(tmp_path / "nothing.npz"), **options)


def test_summary_over_seed_sets_has_mean_std_and_best():
    per_seed = [
        {"fid": 3.0, "is_mean": 10.0, "precision": 0.7, "recall": 0.5, "kid": None},
        {"fid": 2.0, "is_mean": 12.0, "precision": 0.6, "recall": 0.55, "kid": None},
        {"fid": 4.0, "is_mean": 11.0, "precision": 0.8, "recall": 0.52, "kid": None},
    ]
    summary = summarize_seeds(per_seed)
    assert summary["fid"] == pytest.approx(3.0) and summary["fid_std_over_seeds"] == pytest.approx(1.0)
    assert summary["best"] == {"fid": 2.0, "is_mean": 12.0, "precision": 0.8, "recall": 0.55}
    assert summary["best_seed_set"] == {"fid": 1, "is_mean": 1, "precision": 2, "recall": 1}
    assert "kid" not in summary

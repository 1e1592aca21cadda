"""Evaluation pipeline on a tiny DiT with the stand-in Inception file: seeding, ranks, reference statistics, errors."""

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_eval_standin import write_standin_inception

from pixdit.data.imageops import encode_image
from pixdit.data.shards import ShardWriter, write_manifest
from pixdit.errors import PixditError
from pixdit.eval import (
    INCEPTION_FILENAME,
    INCEPTION_URL,
    FeatureStatistics,
    InceptionFeatureExtractor,
    MetricSuite,
    evaluate_generator,
    frechet_distance,
    load_reference,
    noise_for_indices,
    resolve_inception_path,
)
from pixdit.eval.reference import make_reference_stats
from pixdit.flow import RectifiedFlow
from pixdit.models import build_model

SIZE = (8, 8)
TINY = dict(depth=2, hidden_size=32, num_heads=2)  # DiT-T made smaller still: the CPU suite has a time budget
SETTINGS = dict(num_samples=22, image_size=SIZE, steps=2, seed=7, num_classes=3, cfg_scale=1.5)
METRICS = ("fid", "is", "kid", "precision_recall")


def tiny_model():
    torch.manual_seed(0)
    return build_model("DiT-T", input_size=SIZE, num_classes=3, zero_init=False, **TINY).eval()


def run_evaluation(weights, reference, batch_size, rank_images=None):
    extractor = InceptionFeatureExtractor(weights)
    images = {}

    def keep(indices, batch):
        images.update({int(i): im for i, im in zip(indices, batch)})

    metrics = evaluate_generator(
        tiny_model(),
        RectifiedFlow(image_size=SIZE),
        MetricSuite(METRICS, extractor, reference),
        batch_size=batch_size,
        on_batch=keep,
        **SETTINGS,
    )
    return metrics, images


def _rank_main(rank, world_size, init_file, weights, reference_path, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        metrics, images = run_evaluation(weights, load_reference(reference_path), batch_size=4)
        torch.save({"metrics": metrics, "images": images}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _failing_rank_main(rank, world_size, init_file, weights, out_dir):
    import datetime

    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )  # without the fix rank 0 waits for this long
    try:

        def fail_on_rank1(indices, images):
            if rank == 1:
                raise PixditError("rank 1 failed")

        suite = MetricSuite(("fid", "is"), InceptionFeatureExtractor(weights), None)
        evaluate_generator(
            tiny_model(), RectifiedFlow(image_size=SIZE), suite, batch_size=4, on_batch=fail_on_rank1, **SETTINGS
        )
        outcome = "returned"
    except Exception as error:  # noqa: BLE001
        outcome = f"{type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"outcome{rank}.txt"), "w") as f:
        f.write(outcome)


def write_tiny_shards(folder, count=40, resolution=8):
    rng = np.random.default_rng(0)
    with ShardWriter(folder, "train", maxcount=16) as writer:
        for i in range(count):
            pixels = rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)
            writer.write(key=f"{i:08d}", image_bytes=encode_image(pixels), image_format="png")
    write_manifest(
        folder, resolution=resolution, image_format="png", splits={"train": writer.split_info()}, source="test"
    )


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return write_standin_inception(tmp_path_factory.mktemp("inception"))


@pytest.fixture(scope="module")
def reference_path(tmp_path_factory, weights):
    shards = tmp_path_factory.mktemp("shards")
    write_tiny_shards(shards)
    return make_reference_stats(
        shards, InceptionFeatureExtractor(weights), batch_size=16, kid=True, progress=lambda message: None
    )


def test_noise_depends_only_on_seed_and_index():
    full = noise_for_indices(range(10), (3, 4, 4), seed=3)
    assert torch.equal(full[[1, 3, 5, 7, 9]], noise_for_indices([1, 3, 5, 7, 9], (3, 4, 4), seed=3))
    assert not torch.equal(full, noise_for_indices(range(10), (3, 4, 4), seed=4))
    assert not torch.equal(full[0], full[1])
    # One per-index noise for evaluation and the fixed-noise validation loss (pixdit.runtime).
    from pixdit.module import validation_noise_and_sigma

    assert torch.equal(validation_noise_and_sigma(torch.arange(10), (3, 4, 4), seed=3)[0], full)


def test_precision_names():
    """One map of precision names: auto follows the trainer (FIDCallback) or the device (pixdit-evaluate)."""
    from pixdit.runtime import resolve_precision

    assert resolve_precision("auto", "cpu", trainer_precision="bf16-mixed") == "bf16"
    assert resolve_precision("auto", "cpu", trainer_precision="16-mixed") == "fp16"
    assert resolve_precision("auto", "cpu") == "fp32" and resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("fp16", "cpu", trainer_precision="bf16-mixed") == "fp16"
    with pytest.raises(PixditError, match="callbacks.fid.precision='bf32'; allowed: auto, fp32, bf16, fp16"):
        resolve_precision("bf32", "cpu", key="callbacks.fid.precision")


def test_reference_statistics_from_shards_are_exact_and_cached(tmp_path, weights):
    write_tiny_shards(tmp_path)
    extractor = InceptionFeatureExtractor(weights)
    path = make_reference_stats(tmp_path, extractor, batch_size=16, progress=lambda message: None)
    assert path == tmp_path / "fid_stats" / "clean_8.npz"
    # Independent computation: decode the same images, features in one batch, numpy mean / covariance.
    rng = np.random.default_rng(0)
    pixels = torch.from_numpy(rng.integers(0, 256, (40, 8, 8, 3), dtype=np.uint8)).permute(0, 3, 1, 2)
    features = extractor(pixels)[0].double().numpy()
    reference = load_reference(str(path), resolution=8)
    np.testing.assert_allclose(reference.mu, features.mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(reference.sigma, np.cov(features, rowvar=False), rtol=1e-4, atol=1e-7)
    assert reference.count == 40 and reference.description["resolution"] == 8
    assert "build_resizer('clean')" in reference.description["resize_pipeline"] and reference.description["date"]
    # Cached: a second run with the same shards and settings does not rewrite the file.
    mtime = path.stat().st_mtime_ns
    messages = []
    make_reference_stats(tmp_path, extractor, batch_size=16, progress=messages.append)
    assert path.stat().st_mtime_ns == mtime and "up to date" in messages[0]
    with pytest.raises(PixditError, match="resolution 8, but samples are 16"):
        load_reference(str(path), resolution=16)


def test_reference_statistics_report_a_corrupt_sample_instead_of_crashing(tmp_path, weights):
    rng = np.random.default_rng(0)
    with ShardWriter(tmp_path, "train", maxcount=16) as writer:
        for i in range(12):
            data = encode_image(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
            writer.write(key=f"{i:08d}", image_bytes=data[:40] if i == 5 else data, image_format="png")
    write_manifest(tmp_path, resolution=8, image_format="png", splits={"train": writer.split_info()}, source="test")
    extractor = InceptionFeatureExtractor(weights)
    with (
        pytest.warns(UserWarning, match="00000005"),
        pytest.raises(PixditError, match=r"(?s)lists 12 train images but only 11.*00000005 in .*train-000000.tar"),
    ):
        make_reference_stats(tmp_path, extractor, batch_size=4, progress=lambda message: None)
    # the first 5 images are all readable: a --max-images run over them works
    make_reference_stats(tmp_path, extractor, batch_size=4, max_images=5, progress=lambda message: None)


def test_same_images_and_metrics_for_any_batch_size_and_world_size(tmp_path, weights, reference_path):
    reference = load_reference(str(reference_path))
    metrics, images = run_evaluation(weights, reference, batch_size=SETTINGS["num_samples"])
    metrics_b3, images_b3 = run_evaluation(weights, reference, batch_size=3)
    assert sorted(images) == list(range(SETTINGS["num_samples"]))
    # CPU matmuls may round differently for other batch shapes: allow one grey level.
    for i in images:
        assert (images[i].int() - images_b3[i].int()).abs().max() <= 1
    for key in ("fid", "is_mean", "is_std", "kid", "precision", "recall"):
        assert metrics_b3[key] == pytest.approx(metrics[key], rel=1e-3), key
    assert metrics["num_samples"] == SETTINGS["num_samples"] and metrics["fid"] > 0

    # Two ranks (gloo): rank r generates indices r, r + 2, ...; features are gathered back in index order.
    # spawn, not fork: a forked child deadlocks on the parent's thread pools.
    mp.spawn(
        _rank_main,
        args=(2, str(tmp_path / "pg"), str(weights), str(reference_path), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert sorted(rank0["images"]) == list(range(0, 22, 2)) and sorted(rank1["images"]) == list(range(1, 22, 2))
    for i, image in {**rank0["images"], **rank1["images"]}.items():
        assert (image.int() - images[i].int()).abs().max() <= 1
    assert rank0["metrics"] == rank1["metrics"]  # computed once, broadcast
    for key in ("fid", "is_mean", "is_std", "kid", "precision", "recall"):
        assert rank0["metrics"][key] == pytest.approx(metrics[key], rel=1e-3), key


def test_a_failing_rank_stops_every_rank_instead_of_hanging_the_others(tmp_path, weights):
    mp.spawn(_failing_rank_main, args=(2, str(tmp_path / "pg"), str(weights), str(tmp_path)), nprocs=2, join=True)
    outcomes = [(tmp_path / f"outcome{r}.txt").read_text() for r in (0, 1)]
    assert outcomes == [
        "PixditError: the evaluation failed on another rank (its log has the error)",
        "PixditError: rank 1 failed",
    ]


def test_fid_against_own_statistics_is_zero(weights):
    extractor = InceptionFeatureExtractor(weights)
    model, flow = tiny_model(), RectifiedFlow(image_size=SIZE)
    stats = FeatureStatistics(2048)

    def accumulate(indices, images):
        stats.update(extractor(images)[0])

    metrics = evaluate_generator(
        model, flow, MetricSuite(("fid", "is"), extractor, None), batch_size=8, on_batch=accumulate, **SETTINGS
    )
    assert metrics["fid"] is None and metrics["is_mean"] >= 1.0
    mu, sigma = stats.mean_and_covariance()
    assert frechet_distance(mu, sigma, mu, sigma) == pytest.approx(0.0, abs=1e-6 * np.trace(sigma))


def test_missing_weights_fail_with_file_url_and_config_key(tmp_path):
    missing = tmp_path / "nowhere" / INCEPTION_FILENAME
    with pytest.raises(PixditError) as error:
        resolve_inception_path(str(missing))
    message = str(error.value)
    assert str(missing) in message and INCEPTION_URL in message and "eval.inception_path" in message
    with pytest.raises(PixditError, match="callbacks.fid.inception_path"):
        resolve_inception_path(str(missing), config_prefix="callbacks.fid")
    with pytest.raises(PixditError, match="--inception-path"):
        resolve_inception_path(str(missing), config_prefix="--")


def test_corrupt_weights_file_is_a_user_error(tmp_path):
    (tmp_path / INCEPTION_FILENAME).write_bytes(b"<html>proxy error</html>")
    with pytest.raises(PixditError, match="not a loadable TorchScript Inception file"):
        InceptionFeatureExtractor(resolve_inception_path(str(tmp_path)))


def test_missing_reference_statistics_messages(tmp_path):
    with pytest.raises(PixditError, match="(?s)ffhq_clean_trainval70k_256.npz not found.*clean-fid/stats/ffhq"):
        load_reference("cleanfid:ffhq_trainval70k", resolution=256, cleanfid_dir=str(tmp_path))
    # in training the keys live under callbacks.fid: the message must name those, not evaluate.py's eval.*
    with pytest.raises(PixditError, match=r"(?s)callbacks\.fid\.cleanfid_stats_dir.*callbacks\.fid\.download=true"):
        load_reference(
            "cleanfid:ffhq_trainval70k", resolution=256, cleanfid_dir=str(tmp_path), config_prefix="callbacks.fid"
        )
    with pytest.raises(PixditError, match="only at resolutions"):
        load_reference("cleanfid:ffhq_trainval70k", resolution=128, cleanfid_dir=str(tmp_path))
    with pytest.raises(PixditError, match="make_fid_stats.py"):
        load_reference(str(tmp_path / "missing.npz"), resolution=128)


def test_cleanfid_precomputed_statistics_are_read_from_the_cache_dir(tmp_path):
    mu, sigma = np.arange(4.0), np.eye(4)
    np.savez(tmp_path / "ffhq_clean_trainval70k_256.npz", mu=mu, sigma=sigma)
    reference = load_reference("cleanfid:ffhq_trainval70k", resolution=256, cleanfid_dir=str(tmp_path))
    assert reference.id.startswith("cleanfid:ffhq_clean_trainval70k_256@")
    np.testing.assert_array_equal(reference.mu, mu)
    assert json.dumps(reference.description)  # serialisable into metrics.json


def test_make_fid_stats_script(tmp_path, weights, capsys):
    from pixdit.cli import make_fid_stats as script

    write_tiny_shards(tmp_path / "shards", count=20)
    out = tmp_path / "stats.npz"
    args = ["--shards", str(tmp_path / "shards"), "--out", str(out), "--device", "cpu", "--batch-size", "8"]
    assert script.main([*args, "--inception-path", str(weights), "--kid"]) == 0
    reference = load_reference(str(out), resolution=8)
    assert reference.count == 20 and reference.features.shape == (20, 2048)
    assert script.main([*args, "--inception-path", str(tmp_path / "missing")]) == 2
    assert "--inception-path" in capsys.readouterr().err
    # --batch-size 0 never flushed (every image in one batch); --max-images 0 silently meant "all images"
    for bad in (["--batch-size", "0"], ["--max-images", "0"]):
        assert script.main([*args, "--inception-path", str(weights), "--force", *bad]) == 2
        assert "--batch-size must be >= 1 and --max-images >= 1" in capsys.readouterr().err

"""Reference (real-image) statistics: clean-fid's precomputed files, ours from scripts/make_fid_stats.py, and the ADM
evaluation suite's reference batches.

`eval.reference` (a string) names them:
  * `cleanfid:ffhq_trainval70k` - clean-fid's precomputed FFHQ statistics ("clean" mode) at the evaluation resolution
    (clean-fid publishes 256 and 1024). The file `ffhq_clean_trainval70k_<res>.npz` is looked up in
    `eval.cleanfid_stats_dir` (default: clean-fid's own `cleanfid/stats/` folder, where clean-fid caches downloads).
  * a path to an `.npz` written by `scripts/make_fid_stats.py --shards DIR` (default `DIR/fid_stats/clean_<res>.npz`):
    `mu`, `sigma` (Inception pool), `count`, `description` (JSON: source, Inception mode and resize pipeline,
    resolution, count, date), optionally `features` (pool features: KID, precision/recall), `mu_s`, `sigma_s` (sFID),
    `mu_dinov2`, `sigma_dinov2` (FD-DINOv2).
  * a path to an ADM-suite `.npz` (no `description`): a reference batch (`arr_0` uint8 [N, H, W, 3] images - 10k for
    ImageNet - plus `mu`, `sigma`, `mu_s`, `sigma_s` over the whole dataset) or a sample batch (`arr_0` only, e.g.
    another model's samples or ours from `save_npz=true`). Its statistics come from the ADM suite's TensorFlow
    Inception graph, which resizes with TF's bilinear resize, so they are marked `legacy_tensorflow` and need
    `eval.inception_mode=legacy_tensorflow`. Whatever else a metric needs (pool features for precision/recall,
    DINOv2 statistics, ...) is computed from `arr_0` by `pixdit.eval.metrics.complete_reference`, as the ADM
    evaluator computes the reference activations from arr_0.

Every loaded reference carries an `id` (name + content hash) that evaluate.py writes into metrics.json, so two FIDs
are comparable only when their reference ids match.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pixdit.errors import PixditError
from pixdit.eval.inception import download_file, option_name
from pixdit.files import atomic_write

CLEANFID_STATS_URL = "https://www.cs.cmu.edu/~clean-fid/stats"
CLEANFID_PREFIX = "cleanfid:"
# Precomputed "clean" statistics clean-fid publishes for FFHQ (name -> resolutions).
CLEANFID_PRECOMPUTED = {"ffhq_trainval70k": (256, 1024), "ffhq_trainval": (256, 1024), "ffhq_train": (256, 1024)}
# How images reach the feature network: the same for generated and reference images.
RESIZE_PIPELINE = (
    "uint8 RGB -> cleanfid.resize.build_resizer('clean') (PIL bicubic to 299x299 on float32, no quantisation) -> "
    "cleanfid InceptionV3W (inception-2015-12-05.pt) pool3 2048-d features"
)


@dataclass
class ReferenceStats:
    """Statistics of a reference set; any field may be missing (None) - `pixdit.eval.metrics.check_reference` says
    which metric needs which. Inception statistics are in `inception_mode`'s pipeline."""

    mu: np.ndarray | None  # Inception pool (FID)
    sigma: np.ndarray | None
    id: str
    count: int | None = None
    features: np.ndarray | None = None  # Inception pool features [n, 2048] (KID, precision/recall)
    description: dict = field(default_factory=dict)
    mu_s: np.ndarray | None = None  # Inception spatial features (sFID), the ADM suite's key names
    sigma_s: np.ndarray | None = None
    mu_dinov2: np.ndarray | None = None  # DINOv2 features (FD-DINOv2)
    sigma_dinov2: np.ndarray | None = None
    images: np.ndarray | None = None  # uint8 [n, H, W, 3] (an ADM batch's arr_0): the source of missing pieces
    inception_mode: str | None = "clean"  # pipeline of mu / sigma / mu_s / sigma_s / features
    resolution: int | None = None


# npz keys of the optional statistics (the same names in our files and the ADM suite's)
OPTIONAL_KEYS = ("mu_s", "sigma_s", "mu_dinov2", "sigma_dinov2")


def content_hash(mu: np.ndarray, sigma: np.ndarray) -> str:
    digest = hashlib.sha256()
    digest.update(np.ascontiguousarray(mu, dtype=np.float64).tobytes())
    digest.update(np.ascontiguousarray(sigma, dtype=np.float64).tobytes())
    return digest.hexdigest()[:12]


def default_stats_path(shard_dir: str | Path, resolution: int, inception_mode: str = "clean") -> Path:
    """Where make_fid_stats.py writes (and the callback looks for) the statistics of a shard folder."""
    return Path(shard_dir) / "fid_stats" / f"{inception_mode}_{int(resolution)}.npz"


def cleanfid_stats_dir(configured: str | None = None) -> Path:
    if configured:
        return Path(os.path.expanduser(str(configured)))
    import cleanfid

    return Path(os.path.dirname(cleanfid.__file__)) / "stats"


def _load_cleanfid(
    name: str, resolution: int | None, stats_dir: str | None, download: bool, config_prefix: str
) -> ReferenceStats:
    if name not in CLEANFID_PRECOMPUTED:
        raise PixditError(
            f"{option_name(config_prefix, 'reference')}={CLEANFID_PREFIX}{name}: unknown clean-fid statistics; allowed: "
            f"{sorted(CLEANFID_PREFIX + n for n in CLEANFID_PRECOMPUTED)}, or a path made by scripts/make_fid_stats.py"
        )
    if resolution not in CLEANFID_PRECOMPUTED[name]:
        raise PixditError(
            f"{option_name(config_prefix, 'reference')}={CLEANFID_PREFIX}{name} exists only at resolutions {CLEANFID_PRECOMPUTED[name]}, "
            f"not {resolution}; make your own with: python scripts/make_fid_stats.py --shards DIR --resolution {resolution}"
        )
    dataset, split = name.split("_", 1)
    filename = f"{dataset}_clean_{split}_{resolution}.npz"
    folder = cleanfid_stats_dir(stats_dir)
    path = folder / filename
    if not path.is_file():
        url = f"{CLEANFID_STATS_URL}/{filename}"
        if download:
            try:
                download_file(url, path)
            except Exception as error:  # noqa: BLE001
                raise PixditError(f"could not download {url} to {path}: {type(error).__name__}: {error}") from None
        else:
            raise PixditError(
                f"clean-fid reference statistics {filename} not found in {folder}.\n"
                f"  Download {url} into that folder (or set {option_name(config_prefix, 'cleanfid_stats_dir')} to "
                f"where it is), or set {option_name(config_prefix, 'download')}=true on a machine with network access."
            )
    with np.load(path) as data:
        mu, sigma = data["mu"].astype(np.float64), data["sigma"].astype(np.float64)
    features = None
    kid_path = folder / filename.replace(".npz", "_kid.npz")
    if kid_path.is_file():
        with np.load(kid_path) as data:
            features = data["feats"]
    return ReferenceStats(
        mu=mu,
        sigma=sigma,
        id=f"{CLEANFID_PREFIX}{filename[:-4]}@{content_hash(mu, sigma)}",
        features=features,
        description={
            "source": f"clean-fid precomputed {url_or_path(path)}",
            "resize_pipeline": RESIZE_PIPELINE,
            "resolution": resolution,
        },
        resolution=resolution,
    )


def url_or_path(path: Path) -> str:
    return f"{CLEANFID_STATS_URL}/{path.name} (cached at {path})"


def load_reference(
    reference: str,
    resolution: int | None = None,
    cleanfid_dir: str | None = None,
    download: bool = False,
    config_prefix: str = "eval",
) -> ReferenceStats:
    """Load reference statistics named by `<config_prefix>.reference` (see the module docstring)."""
    if not reference:
        raise PixditError(
            f"{option_name(config_prefix, 'reference')} is not set: give cleanfid:ffhq_trainval70k (FFHQ 256/1024) or the .npz written by "
            "python scripts/make_fid_stats.py --shards DIR"
        )
    reference = str(reference)
    if reference.startswith(CLEANFID_PREFIX):
        return _load_cleanfid(reference[len(CLEANFID_PREFIX) :], resolution, cleanfid_dir, download, config_prefix)
    path = Path(os.path.expanduser(reference))
    if not path.is_file():
        raise PixditError(
            f"{option_name(config_prefix, 'reference')}={reference}: file not found. Make it with: python scripts/make_fid_stats.py "
            f"--shards DIR --resolution {resolution or 'R'} --out {reference}, or give an ADM reference batch (.npz)"
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            keys = set(data.files)
            if "description" in keys:
                reference_stats = _read_pixdit_npz(data, path)
            elif "arr_0" in keys or "mu" in keys:
                reference_stats = _read_adm_npz(data, path)
            else:
                raise PixditError(
                    f"{option_name(config_prefix, 'reference')}={reference}: an .npz with neither "
                    f"statistics (mu, sigma) nor images (arr_0); keys: {sorted(keys)}"
                )
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:  # cut short, not an .npz, no mu
        raise PixditError(
            f"{option_name(config_prefix, 'reference')}={reference}: not readable FID statistics ({type(error).__name__}: "
            f"{error}); make them again with: python scripts/make_fid_stats.py --shards DIR --resolution "
            f"{resolution or 'R'} --out {reference}"
        ) from None
    stored = reference_stats.resolution
    if resolution and stored and int(stored) != int(resolution):
        raise PixditError(
            f"{option_name(config_prefix, 'reference')}={reference} was made at resolution {stored}, but samples are {resolution}; "
            f"make matching statistics with: python scripts/make_fid_stats.py --shards DIR --resolution {resolution}"
        )
    return reference_stats


def _optional(data, key: str):
    return data[key].astype(np.float64) if key in data.files else None


def _read_pixdit_npz(data, path: Path) -> ReferenceStats:
    mu, sigma = data["mu"].astype(np.float64), data["sigma"].astype(np.float64)
    description = json.loads(str(data["description"]))
    return ReferenceStats(
        mu=mu,
        sigma=sigma,
        id=f"{path.name}@{content_hash(mu, sigma)}",
        count=int(data["count"]) if "count" in data.files else None,
        features=data["features"] if "features" in data.files else None,
        description=description,
        **{key: _optional(data, key) for key in OPTIONAL_KEYS},
        inception_mode=description.get("inception_mode", "clean"),  # files from before the option were all clean
        resolution=description.get("resolution"),
    )


def _read_adm_npz(data, path: Path) -> ReferenceStats:
    images = data["arr_0"] if "arr_0" in data.files else None
    if images is not None and (images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3):
        raise PixditError(
            f"{path}: arr_0 must be uint8 [N, H, W, 3] images (the ADM suite's format), got "
            f"{images.dtype} {images.shape}"
        )
    mu, sigma = _optional(data, "mu"), _optional(data, "sigma")
    digest = content_hash(mu, sigma) if mu is not None else hashlib.sha256(images.tobytes()).hexdigest()[:12]
    has_statistics = mu is not None or "mu_s" in data.files
    return ReferenceStats(
        mu=mu,
        sigma=sigma,
        id=f"adm:{path.name}@{digest}",
        count=len(images) if images is not None else None,
        description={
            "source": f"ADM evaluation-suite batch {path.resolve()}",
            "format": "adm",
            "keys": sorted(data.files),
            "images": len(images) if images is not None else 0,
            "statistics": "ADM suite (TensorFlow Inception graph, its own bilinear resize)"
            if has_statistics
            else "none: computed from arr_0",
        },
        mu_s=_optional(data, "mu_s"),
        sigma_s=_optional(data, "sigma_s"),
        images=images,
        inception_mode="legacy_tensorflow" if has_statistics else None,
        resolution=int(images.shape[1]) if images is not None else None,
    )


def save_reference(
    path: str | Path,
    mu: np.ndarray,
    sigma: np.ndarray,
    count: int,
    description: dict,
    features: np.ndarray | None = None,
    **optional: np.ndarray | None,
) -> Path:
    """Write statistics atomically (temporary file + rename) so an interrupted run leaves no half file.
    `optional`: any of OPTIONAL_KEYS (mu_s, sigma_s, mu_dinov2, sigma_dinov2)."""
    unknown = set(optional) - set(OPTIONAL_KEYS)
    if unknown:
        raise ValueError(f"save_reference: unknown arrays {sorted(unknown)}; allowed: {OPTIONAL_KEYS}")
    path = Path(path)
    arrays = {"mu": mu, "sigma": sigma, "count": np.int64(count), "description": np.array(json.dumps(description))}
    if features is not None:
        arrays["features"] = features
    arrays.update({key: value for key, value in optional.items() if value is not None})
    with atomic_write(path) as f:
        np.savez(f, **arrays)
    return path


def save_adm_npz(path: str | Path, images: np.ndarray, labels: np.ndarray | None = None) -> Path:
    """Samples in the ADM evaluation suite's input format: `arr_0` uint8 [N, H, W, 3] (+ `arr_1` int labels), written
    atomically. The suite's evaluator.py (and `eval.reference=PATH` here) read it."""
    images = np.asarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"save_adm_npz: images must be uint8 [N, H, W, 3], got {images.dtype} {images.shape}")
    arrays = {"arr_0": images}
    if labels is not None:
        arrays["arr_1"] = np.asarray(labels)
    with atomic_write(path) as f:
        np.savez(f, **arrays)
    return path


def _shards_fingerprint(manifest: dict, split: str) -> str:
    digest = hashlib.sha256()
    for shard in manifest["splits"][split]["shards"]:
        digest.update(f"{shard['name']}:{shard.get('sha256', '')}:{shard['count']};".encode())
    return digest.hexdigest()[:16]


def make_reference_stats(
    root: str | Path,
    extractor,
    *,
    resolution: int | None = None,
    split: str = "train",
    batch_size: int = 64,
    kid: bool = False,
    out: str | Path | None = None,
    force: bool = False,
    max_images: int | None = None,
    progress=print,
    dinov2=None,
) -> Path:
    """Stream the shards of `root` (a pixdit shard folder) through the FID pipeline and save their statistics.

    Images are decoded from the shards as stored (uint8); when `resolution` differs from the shards' own, they are
    resized with the data pipeline's `center_crop_arr` first (the way the training data were made). Cached: when `out`
    exists and describes the same shards (checksums), split, resolution, image count and settings, nothing runs.
    kid: also store the pool features (KID, precision/recall). An extractor built with spatial=True adds the sFID
    statistics (mu_s, sigma_s); a `dinov2` extractor (pixdit.eval.dinov2) adds FD-DINOv2's (mu_dinov2, sigma_dinov2).
    """
    import datetime

    import torch
    from PIL import Image

    from pixdit.data.imageops import center_crop_arr, decode_image
    from pixdit.data.shards import IMAGE_FORMATS, iter_shard_samples, read_manifest
    from pixdit.eval.inception import SPATIAL_DIM
    from pixdit.eval.stats import FeatureStatistics

    if batch_size < 1 or (max_images is not None and max_images < 1):
        raise PixditError(
            f"--batch-size must be >= 1 and --max-images >= 1 (or unset); got batch_size={batch_size}, "
            f"max_images={max_images}"
        )
    root = Path(root)
    manifest = read_manifest(root)
    if split not in manifest["splits"]:
        raise PixditError(f"--split {split}: {root}/manifest.json has splits {sorted(manifest['splits'])}")
    stored_resolution = int(manifest["resolution"])
    resolution = int(resolution or stored_resolution)
    out = Path(out) if out else default_stats_path(root, resolution, extractor.mode)
    total = int(manifest["splits"][split]["count"])
    count = min(total, max_images) if max_images is not None else total
    description = {
        "source": str(root.resolve()),
        "dataset": manifest.get("source"),
        "split": split,
        "shards_fingerprint": _shards_fingerprint(manifest, split),
        "stored_resolution": stored_resolution,
        "resolution": resolution,
        "data_resize": "none"
        if resolution == stored_resolution
        else "pixdit.data.imageops.center_crop_arr (box halvings + bicubic + centre crop)",
        "inception_mode": extractor.mode,
        "resize_pipeline": RESIZE_PIPELINE
        if extractor.mode == "clean"
        else "float RGB at its own size -> the Inception TorchScript file's TF-style bilinear resize to 299x299 -> pool3",
        "count": count,
        "kid_features": bool(kid),
        "sfid": bool(extractor.spatial),
        "dinov2": dinov2 is not None,
    }
    if out.is_file() and not force:
        with np.load(out) as data:
            cached = json.loads(str(data["description"])) if "description" in data else {}
        if all(cached.get(k) == v for k, v in description.items() if k != "source"):
            progress(f"{out}: up to date ({count} images at {resolution}px), nothing to do (--force recomputes)")
            return out

    stats = FeatureStatistics(2048, device=extractor.device)
    spatial_stats = FeatureStatistics(SPATIAL_DIM, device=extractor.device) if extractor.spatial else None
    dinov2_stats = FeatureStatistics(dinov2.feature_dim, device=dinov2.device) if dinov2 is not None else None
    features, batch, seen = [], [], 0

    def flush():
        images = torch.from_numpy(np.stack(batch)).permute(0, 3, 1, 2)
        out = extractor.extract(images)
        stats.update(out["pool"])
        if spatial_stats is not None:
            spatial_stats.update(out["spatial"])
        if dinov2_stats is not None:
            dinov2_stats.update(dinov2(images))
        if kid:
            features.append(out["pool"].cpu().numpy())
        batch.clear()

    unreadable = []  # "key in shard: reason" of samples that could not be decoded (reported, skipped)
    for shard in manifest["splits"][split]["shards"]:
        if seen >= count:
            break  # --max-images reached: the remaining shards are not opened
        for sample in iter_shard_samples(root / shard["name"]):
            if seen >= count:
                break
            try:
                data = next((sample[k] for k in IMAGE_FORMATS if k in sample), None)
                if data is None:
                    raise ValueError("no png/jpg image in the sample")
                pixels = decode_image(data)
            except Exception as error:  # corrupt sample: report it, keep going, fail below with the full list
                unreadable.append(f"{sample.get('__key__')} in {root / shard['name']}: {error}")
                warnings.warn(f"make_fid_stats: skipping unreadable sample {unreadable[-1]}", stacklevel=2)
                continue
            if pixels.shape[:2] != (resolution, resolution):
                pixels = center_crop_arr(Image.fromarray(pixels), resolution)
            batch.append(pixels)
            seen += 1
            if len(batch) == batch_size:
                flush()
                if seen % (batch_size * 50) == 0:
                    progress(f"{seen}/{count} images")
    if batch:
        flush()
    if seen != count:
        raise PixditError(
            f"{root}: manifest lists {count} {split} images but only {seen} were readable"
            + "".join(f"\n  unreadable: {entry}" for entry in unreadable)
            + "\n  check the shards with pixdit.data.shards.verify_checksums, or re-run prepare_data.py"
        )
    mu, sigma = stats.mean_and_covariance()
    optional = {}
    if spatial_stats is not None:
        optional["mu_s"], optional["sigma_s"] = spatial_stats.mean_and_covariance()
    if dinov2_stats is not None:
        optional["mu_dinov2"], optional["sigma_dinov2"] = dinov2_stats.mean_and_covariance()
    description["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    save_reference(out, mu, sigma, count, description, np.concatenate(features) if kid else None, **optional)
    progress(f"wrote {out} ({count} images at {resolution}px)")
    return out

"""Which metrics an evaluation computes, what each one needs, and the networks + reference that serve them.

    suite = build_suite(["fid", "sfid", "precision_recall"], "VIRTUAL_imagenet256_labeled.npz", resolution=256,
                        device="cuda", inception_path="/data/inception-2015-12-05.pt",
                        inception_mode="legacy_tensorflow")
    metrics = evaluate_generator(model, flow, suite, num_samples=50_000, ...)      # pixdit.eval.evaluator

`build_suite` does every check that can fail before a sample is generated, cheapest first: metric names, the
reference (resolution, which statistics it holds, in which Inception pipeline), the weights files (a look-up that may
download), then loads the networks
and computes what the reference lacks from its images (an ADM batch's arr_0), as the ADM evaluator does.

Metrics (names for `eval.metrics` / `callbacks.fid.metrics`; keys in metrics.json):
  fid               Fréchet distance of Inception pool features (2048-d)                       fid
  is                Inception Score, 10 splits (no reference needed)                           is_mean, is_std
  kid               Kernel Inception Distance (clean-fid's)                                     kid
  sfid              Fréchet distance of Inception spatial features (mixed_6/conv, 2023-d; ADM) sfid
  precision_recall  improved precision / recall, k = 3, on Inception pool features (ADM)       precision, recall
  fd_dinov2         Fréchet distance of DINOv2 ViT-L/14 features (EDM2)                         fd_dinov2
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from pixdit.errors import PixditError
from pixdit.eval.inception import (
    INCEPTION_MODES,
    SPATIAL_DIM,
    InceptionFeatureExtractor,
    option_name,
    resolve_inception_path,
)
from pixdit.eval.reference import ReferenceStats, load_reference

METRICS = ("fid", "is", "kid", "sfid", "precision_recall", "fd_dinov2")
INCEPTION_METRICS = frozenset({"fid", "is", "kid", "sfid", "precision_recall"})
# metric -> its keys in the results (and whether lower is better, for the best of several seed sets)
RESULT_KEYS = {
    "fid": ("fid",),
    "is": ("is_mean", "is_std"),
    "kid": ("kid",),
    "sfid": ("sfid",),
    "precision_recall": ("precision", "recall"),
    "fd_dinov2": ("fd_dinov2",),
}
LOWER_IS_BETTER = {
    "fid": True,
    "is_mean": False,
    "kid": True,
    "sfid": True,
    "precision": False,
    "recall": False,
    "fd_dinov2": True,
}
PR_NEIGHBOURS = 3  # k of Kynkäänniemi et al. (and the ADM suite)
STATS_HINT = "python scripts/make_fid_stats.py --shards DATA_DIR"


def check_metric_names(metrics: Sequence[str], prefix: str = "eval") -> tuple[str, ...]:
    """The metric names as a tuple (order kept, duplicates dropped); a PixditError listing the allowed names."""
    if isinstance(metrics, str) or metrics is None:
        raise PixditError(
            f"{option_name(prefix, 'metrics')}={metrics!r} must be a list of metric names, e.g. "
            f"[fid, is]; allowed: {', '.join(METRICS)}"
        )
    names = tuple(dict.fromkeys(str(m) for m in metrics))
    unknown = [m for m in names if m not in METRICS]
    if unknown or not names:
        raise PixditError(
            f"{option_name(prefix, 'metrics')}: unknown metric(s) {unknown or '(empty list)'}; "
            f"allowed: {', '.join(METRICS)}"
        )
    return names


def check_reference(
    reference: ReferenceStats | None, metrics: Sequence[str], inception_mode: str, prefix: str = "eval"
) -> None:
    """Every metric finds what it needs in the reference, from the same Inception pipeline; one PixditError listing
    all problems otherwise."""
    key = option_name(prefix, "reference")
    needs_reference = [m for m in metrics if m != "is"]
    if reference is None:
        if needs_reference:
            raise PixditError(f"{', '.join(needs_reference)} need(s) reference statistics: set {key}")
        return
    has_images = reference.images is not None
    problems = []

    def precomputed(metric: str, present: bool, what: str, flag: str) -> None:
        if present:
            if metric != "fd_dinov2" and reference.inception_mode != inception_mode:
                problems.append(
                    f"{metric}: the reference's {what} come from the Inception pipeline "
                    f"'{reference.inception_mode}', but {option_name(prefix, 'inception_mode')}={inception_mode}: "
                    f"set {option_name(prefix, 'inception_mode')}={reference.inception_mode} (the ADM suite's and "
                    f"EDM's statistics are legacy_tensorflow), or make statistics in your pipeline with "
                    f"`{STATS_HINT} --inception-mode {inception_mode}`"
                )
        elif not has_images:
            problems.append(
                f"{metric}: the reference has no {what} and no images (arr_0) to compute them from; "
                f"make them with `{STATS_HINT}{flag}`"
            )

    for metric in metrics:
        if metric == "fid":
            precomputed(metric, reference.mu is not None, "pool statistics (mu, sigma)", "")
        elif metric == "sfid":
            precomputed(metric, reference.mu_s is not None, "spatial statistics (mu_s, sigma_s)", " --sfid")
        elif metric in ("kid", "precision_recall"):
            precomputed(metric, reference.features is not None, "pool features", " --kid")
        elif metric == "fd_dinov2":
            precomputed(
                metric,
                reference.mu_dinov2 is not None,
                "DINOv2 statistics (mu_dinov2, sigma_dinov2)",
                " --dinov2-path DINOV2_FILE",
            )
    if problems:
        raise PixditError(f"{key}={reference.id} cannot serve the metrics:\n  " + "\n  ".join(problems))


@torch.no_grad()
def complete_reference(
    reference: ReferenceStats | None,
    metrics: Sequence[str],
    inception: InceptionFeatureExtractor | None,
    dinov2=None,
    batch_size: int = 64,
):
    """Compute from the reference's images (arr_0) whatever the metrics need and the file does not hold (pool
    statistics / features, spatial statistics, DINOv2 statistics); returns a new ReferenceStats."""
    from pixdit.eval.stats import FeatureStatistics

    if reference is None or reference.images is None:
        return reference
    need = {
        "pool": "fid" in metrics and reference.mu is None,
        "features": ("kid" in metrics or "precision_recall" in metrics) and reference.features is None,
        "spatial": "sfid" in metrics and reference.mu_s is None,
        "dinov2": "fd_dinov2" in metrics and reference.mu_dinov2 is None,
    }
    if not any(need.values()):
        return reference
    pool = FeatureStatistics(2048, device=inception.device) if need["pool"] else None
    spatial = FeatureStatistics(SPATIAL_DIM, device=inception.device) if need["spatial"] else None
    dino = FeatureStatistics(dinov2.feature_dim, device=dinov2.device) if need["dinov2"] else None
    features = []
    for start in range(0, len(reference.images), batch_size):
        images = torch.from_numpy(np.ascontiguousarray(reference.images[start : start + batch_size])).permute(
            0, 3, 1, 2
        )
        if need["pool"] or need["features"] or need["spatial"]:
            out = inception.extract(images)
            if pool is not None:
                pool.update(out["pool"])
            if spatial is not None:
                spatial.update(out["spatial"])
            if need["features"]:
                features.append(out["pool"].cpu().numpy())
        if dino is not None:
            dino.update(dinov2(images))
    changes = {}
    if pool is not None:
        changes["mu"], changes["sigma"] = pool.mean_and_covariance()
    if spatial is not None:
        changes["mu_s"], changes["sigma_s"] = spatial.mean_and_covariance()
    if dino is not None:
        changes["mu_dinov2"], changes["sigma_dinov2"] = dino.mean_and_covariance()
    if features:
        changes["features"] = np.concatenate(features)
    computed = sorted(k for k, v in need.items() if v)
    description = {
        **reference.description,
        "computed_from_images": computed,
        "computed_inception_mode": inception.mode if inception is not None else None,
    }
    return dataclasses.replace(reference, description=description, **changes)


@dataclasses.dataclass
class MetricSuite:
    """The metrics of one evaluation and what computes them (networks on one device, a completed reference)."""

    metrics: tuple[str, ...]
    inception: InceptionFeatureExtractor | None
    reference: ReferenceStats | None
    dinov2: object | None = None  # pixdit.eval.dinov2.DINOv2FeatureExtractor

    def describe(self) -> dict:
        """What metrics.json records about the feature networks."""
        out = {"metrics": list(self.metrics)}
        if self.inception is not None:
            out["inception"] = (
                f"clean-fid InceptionV3W (inception-2015-12-05.pt), mode {self.inception.mode}, IS "
                f"from bias-free logits"
                + (", sFID: mixed_6/conv first 7 channels (2023-d)" if self.inception.spatial else "")
            )
        if "precision_recall" in self.metrics:
            out["precision_recall"] = f"Kynkäänniemi et al. 2019, k = {PR_NEIGHBOURS}, Inception pool features"
        if self.dinov2 is not None:
            out["dinov2"] = (
                "DINOv2 ViT-L/14 (timm architecture), 224 px bicubic antialiased, ImageNet normalisation, "
                "class token after the final norm (EDM2)"
            )
        return out


def build_suite(
    metrics: Sequence[str],
    reference: str | None,
    *,
    resolution: int,
    device="cpu",
    inception_path: str | None = None,
    cache_dir: str | None = None,
    inception_mode: str = "clean",
    dinov2_path: str | None = None,
    cleanfid_stats_dir: str | None = None,
    download: bool = False,
    prefix: str = "eval",
) -> MetricSuite:
    """Check everything, cheapest first, then load the networks and complete the reference (see the module
    docstring). `prefix` is the config section named in messages (`eval`, `callbacks.fid`)."""
    from pixdit.eval.dinov2 import DINOv2FeatureExtractor, resolve_dinov2_path

    names = check_metric_names(metrics, prefix)
    if inception_mode not in INCEPTION_MODES:
        raise PixditError(
            f"{option_name(prefix, 'inception_mode')}={inception_mode!r}; allowed: {', '.join(INCEPTION_MODES)}"
        )
    uses_inception = bool(INCEPTION_METRICS & set(names))
    reference_stats = None
    if reference:  # before the weights: a bad reference file is found without looking up (or downloading) a network
        reference_stats = load_reference(
            reference, resolution=resolution, cleanfid_dir=cleanfid_stats_dir, download=download, config_prefix=prefix
        )
    check_reference(reference_stats, names, inception_mode, prefix)
    inception_weights = resolve_inception_path(inception_path, cache_dir, download, prefix) if uses_inception else None
    dinov2_weights = resolve_dinov2_path(dinov2_path, download, prefix) if "fd_dinov2" in names else None
    inception = (
        InceptionFeatureExtractor(
            inception_weights, device=device, config_prefix=prefix, mode=inception_mode, spatial="sfid" in names
        )
        if uses_inception
        else None
    )
    dinov2 = DINOv2FeatureExtractor(dinov2_weights, device=device, config_prefix=prefix) if dinov2_weights else None
    reference_stats = complete_reference(reference_stats, names, inception, dinov2)
    return MetricSuite(names, inception, reference_stats, dinov2)


def summarize_seeds(per_seed: list[dict]) -> dict:
    """Over the seed sets: the mean of each metric, its sample std (ddof=1; more than one set) as
    `<key>_std_over_seeds`, and `best`: the best set's value per metric (lowest distance, highest IS / precision /
    recall), as EDM2-style tables report the best of several sample sets; `best_seed_set` says which set."""
    summary, best, best_index = {}, {}, {}
    keys = [
        k
        for k in ("fid", "is_mean", "is_std", "kid", "sfid", "precision", "recall", "fd_dinov2")
        if any(m.get(k) is not None for m in per_seed)
    ]
    for key in keys:
        values = [m[key] for m in per_seed if m.get(key) is not None]
        summary[key] = float(np.mean(values))
        if len(values) > 1:
            summary[f"{key}_std_over_seeds"] = float(np.std(values, ddof=1))
        if key in LOWER_IS_BETTER:
            index = int(np.argmin(values) if LOWER_IS_BETTER[key] else np.argmax(values))
            best[key], best_index[key] = float(values[index]), index
    summary["best"] = best
    summary["best_seed_set"] = best_index
    return summary

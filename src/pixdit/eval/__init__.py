"""Evaluation: FID / IS / KID / sFID / precision-recall / FD-DINOv2, from the EMA model, on any number of GPUs.

    from pixdit.eval import build_suite, evaluate_generator, FIDCallback
    python scripts/evaluate.py ckpt=PATH num_samples=50000 sampler.name=heun eval.metrics=[fid,is,sfid,precision_recall]
    python scripts/make_fid_stats.py --shards data/ffhq256                       # reference statistics of a dataset

Modules: stats (FeatureStatistics, frechet_distance, inception_score, kernel_inception_distance, precision_recall),
inception (weights lookup + clean-fid feature network, spatial features), dinov2 (DINOv2 features for FD-DINOv2),
sampling (per-index seeded generation), reference (reference statistics, ADM batches), metrics (metric names, checks,
MetricSuite, seed-set summaries), evaluator (one distributed evaluation), callback (FIDCallback).
"""

from pixdit.eval.dinov2 import DINOV2_FILENAME, DINOV2_URL, DINOv2FeatureExtractor, resolve_dinov2_path
from pixdit.eval.evaluator import evaluate_generator, gather_by_index
from pixdit.eval.inception import (
    INCEPTION_FILENAME,
    INCEPTION_MODES,
    INCEPTION_URL,
    InceptionFeatureExtractor,
    images_to_uint8,
    resolve_inception_path,
)
from pixdit.eval.metrics import METRICS, MetricSuite, build_suite, check_metric_names, summarize_seeds
from pixdit.eval.reference import (
    ReferenceStats,
    default_stats_path,
    load_reference,
    save_adm_npz,
    save_reference,
)
from pixdit.eval.sampling import generate_uint8, labels_for_indices, noise_for_indices, rank_indices
from pixdit.eval.stats import (
    FeatureStatistics,
    frechet_distance,
    inception_score,
    kernel_inception_distance,
    precision_recall,
)

__all__ = [
    "DINOV2_FILENAME",
    "DINOV2_URL",
    "INCEPTION_FILENAME",
    "INCEPTION_MODES",
    "INCEPTION_URL",
    "METRICS",
    "DINOv2FeatureExtractor",
    "FeatureStatistics",
    "InceptionFeatureExtractor",
    "MetricSuite",
    "ReferenceStats",
    "build_suite",
    "check_metric_names",
    "default_stats_path",
    "evaluate_generator",
    "frechet_distance",
    "gather_by_index",
    "generate_uint8",
    "images_to_uint8",
    "inception_score",
    "kernel_inception_distance",
    "labels_for_indices",
    "load_reference",
    "noise_for_indices",
    "precision_recall",
    "rank_indices",
    "resolve_dinov2_path",
    "resolve_inception_path",
    "save_adm_npz",
    "save_reference",
    "summarize_seeds",
]

"""One evaluation: generate samples on every rank, extract features, combine across ranks, compute the metrics.

Each rank generates the indices rank, rank + W, ... (see pixdit.eval.sampling) and, per metric of the suite
(pixdit.eval.metrics), accumulates streaming float64 `FeatureStatistics` (FID: Inception pool, sFID: spatial,
FD-DINOv2: DINOv2; summed over ranks with all_reduce) and keeps per-sample rows only where a metric needs them: the
1008 logits (IS) and the 2048-d pool features (KID, precision/recall). Those are all_gathered (uneven counts are
padded) and put back in sample-index order, so the Inception Score splits are the same for any number of GPUs.
Metrics are computed once, on rank 0, and broadcast, so every rank returns (and logs) the same numbers.

    metrics = evaluate_generator(ema_model, flow, suite, num_samples=50_000, image_size=(256, 256), steps=20,
                                 sampler="heun", seed=0, device="cuda", precision="bf16")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from pixdit.errors import PixditError
from pixdit.eval.inception import FEATURE_DIM, SPATIAL_DIM
from pixdit.eval.metrics import PR_NEIGHBOURS, MetricSuite
from pixdit.eval.sampling import generate_uint8, rank_indices
from pixdit.eval.stats import (
    FeatureStatistics,
    frechet_distance,
    inception_score,
    kernel_inception_distance,
    precision_recall,
)
from pixdit.runtime import rank_and_world_size


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on at least one (a collective; just `flag` without a process group)."""
    if rank_and_world_size()[1] == 1:
        return flag
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def gather_by_index(rows: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """all_gather rows `[n_r, d]` with their global sample indices `[n_r]` from every rank (n_r may differ) and return
    all rows `[sum n_r, d]` sorted by index, on every rank."""
    rank, world_size = rank_and_world_size()
    indices = indices.to(rows.device)
    if world_size > 1:
        count = torch.tensor([rows.shape[0]], device=rows.device)
        counts = [torch.zeros_like(count) for _ in range(world_size)]
        dist.all_gather(counts, count)
        counts = [int(c.item()) for c in counts]
        max_count = max(counts)
        padded_rows = rows.new_zeros((max_count, *rows.shape[1:]))
        padded_rows[: rows.shape[0]] = rows
        padded_indices = indices.new_full((max_count,), -1)
        padded_indices[: indices.shape[0]] = indices
        all_rows = [torch.empty_like(padded_rows) for _ in range(world_size)]
        all_indices = [torch.empty_like(padded_indices) for _ in range(world_size)]
        dist.all_gather(all_rows, padded_rows)
        dist.all_gather(all_indices, padded_indices)
        rows = torch.cat([r[:c] for r, c in zip(all_rows, counts)])
        indices = torch.cat([i[:c] for i, c in zip(all_indices, counts)])
    order = torch.argsort(indices)
    if not torch.equal(indices[order], torch.unique(indices)):
        raise RuntimeError("gather_by_index: duplicate sample indices across ranks")
    return rows[order]


@torch.no_grad()
def evaluate_generator(
    model: torch.nn.Module,
    flow,
    suite: MetricSuite,
    *,
    num_samples: int,
    image_size: Sequence[int],
    steps: int,
    sampler: str = "euler",
    cfg_interval: Sequence[float] | None = None,
    seed: int = 0,
    cfg_scale: float = 1.0,
    num_classes: int = 0,
    index_offset: int = 0,
    batch_size: int | str = 64,
    device: torch.device | str = "cpu",
    precision: str = "fp32",
    compile: bool = False,
    inception_splits: int = 10,
    on_batch: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> dict:
    """Generate samples index_offset .. index_offset + num_samples - 1 and return {"num_samples", <the suite's
    metric keys> (pixdit.eval.metrics.RESULT_KEYS)}; metrics that need a reference are None without one.

    on_batch(indices, uint8 images) is called on each rank for its own batches (PNG grid / samples.npz writers).
    Collective: every rank of the default process group must call it with the same arguments.
    """
    rank, world_size = rank_and_world_size()
    metrics = suite.metrics
    if num_samples < max(2, inception_splits if "is" in metrics else 2):
        raise PixditError(
            f"num_samples={num_samples} must be at least 2 and at least inception_splits ({inception_splits})"
        )
    inception, dinov2 = suite.inception, suite.dinov2
    stats_device = inception.device if inception is not None else dinov2.device
    pool_stats = FeatureStatistics(FEATURE_DIM, device=stats_device) if "fid" in metrics else None
    spatial_stats = FeatureStatistics(SPATIAL_DIM, device=stats_device) if "sfid" in metrics else None
    dinov2_stats = FeatureStatistics(dinov2.feature_dim, device=stats_device) if "fd_dinov2" in metrics else None
    keep_logits = "is" in metrics
    keep_features = "kid" in metrics or "precision_recall" in metrics
    local_indices, local_logits, local_features = [], [], []
    was_training = model.training
    model.eval()
    local_error = None
    try:
        for indices, images in generate_uint8(
            model,
            flow,
            rank_indices(num_samples, rank, world_size, index_offset),
            image_size=image_size,
            seed=seed,
            steps=steps,
            sampler=sampler,
            cfg_interval=cfg_interval,
            cfg_scale=cfg_scale,
            num_classes=num_classes,
            batch_size=batch_size,
            device=device,
            precision=precision,
            compile=compile,
        ):
            if on_batch is not None:
                on_batch(indices, images)
            local_indices.append(indices)
            if inception is not None:
                out = inception.extract(images)
                if pool_stats is not None:
                    pool_stats.update(out["pool"])
                if spatial_stats is not None:
                    spatial_stats.update(out["spatial"])
                if keep_logits:
                    local_logits.append(out["logits"])
                if keep_features:
                    local_features.append(out["pool"])
            if dinov2_stats is not None:
                dinov2_stats.update(dinov2(images))
    except Exception as error:  # noqa: BLE001 - re-raised below, after the other ranks have been told
        local_error = error
    finally:
        model.train(was_training)
    # A rank that failed (e.g. out of memory at batch size 1) must not leave the others waiting in all_reduce.
    if _any_rank(local_error is not None, stats_device):
        if local_error is not None:
            raise local_error
        raise PixditError("the evaluation failed on another rank (its log has the error)")

    for stats in (pool_stats, spatial_stats, dinov2_stats):
        if stats is not None:
            stats.all_reduce()
    indices = torch.cat(local_indices) if local_indices else torch.empty(0, dtype=torch.int64)
    logits = features = None
    if keep_logits:
        logits = torch.cat(local_logits) if local_logits else torch.empty(0, inception.num_classes, device=stats_device)
        logits = gather_by_index(logits, indices)
    if keep_features:
        features = torch.cat(local_features) if local_features else torch.empty(0, FEATURE_DIM, device=stats_device)
        features = gather_by_index(features, indices)

    # Rank 0 computes; the result - or the error - goes to every rank, so no rank is left waiting in a collective.
    payload = [None, None]
    if rank == 0:
        try:
            payload[0] = _metrics(
                metrics,
                suite.reference,
                num_samples,
                pool_stats,
                spatial_stats,
                dinov2_stats,
                logits,
                features,
                inception_splits,
            )
        except Exception as error:  # noqa: BLE001 - re-raised below on every rank
            payload[1] = error
    if world_size > 1:
        dist.broadcast_object_list(payload, src=0)
    if payload[1] is not None:
        raise payload[1]
    return payload[0]


def _frechet_to(stats: FeatureStatistics, mu, sigma) -> float:
    mean, covariance = stats.mean_and_covariance()
    return frechet_distance(mean, covariance, mu, sigma)


def _metrics(
    metrics, reference, num_samples, pool_stats, spatial_stats, dinov2_stats, logits, features, inception_splits
) -> dict:
    result = {"num_samples": int(num_samples)}
    if "fid" in metrics:
        result["fid"] = _frechet_to(pool_stats, reference.mu, reference.sigma) if reference is not None else None
    if "is" in metrics:
        result["is_mean"], result["is_std"] = inception_score(torch.softmax(logits.double(), dim=1), inception_splits)
    if "kid" in metrics:
        # None: the reference has no pool features (make_fid_stats.py --kid stores them)
        result["kid"] = (
            kernel_inception_distance(reference.features, features)
            if reference is not None and reference.features is not None
            else None
        )
    if "sfid" in metrics:
        result["sfid"] = (
            _frechet_to(spatial_stats, reference.mu_s, reference.sigma_s) if reference is not None else None
        )
    if "precision_recall" in metrics:
        if reference is not None and reference.features is not None:
            real = torch.as_tensor(reference.features).to(features.device)
            result["precision"], result["recall"] = precision_recall(real, features, k=PR_NEIGHBOURS)
        else:
            result["precision"] = result["recall"] = None
    if "fd_dinov2" in metrics:
        result["fd_dinov2"] = (
            _frechet_to(dinov2_stats, reference.mu_dinov2, reference.sigma_dinov2) if reference is not None else None
        )
    return result

"""``pixdit-evaluate`` (= ``python scripts/evaluate.py``): FID / IS / KID / sFID / precision-recall / FD-DINOv2 of a
checkpoint, with every setting that changes the numbers recorded.

    python scripts/evaluate.py ckpt=outputs/ffhq256_llsa/RUN/checkpoints/last.ckpt num_samples=50000 sampler.steps=20 \
        eval.reference=cleanfid:ffhq_trainval70k eval.inception_path=/data/inception-2015-12-05.pt
    python scripts/evaluate.py ckpt=outputs/imagenet256/RUN cfg_scale=1.5 seeds=3 save_npz=true   # mean ± std
    python scripts/evaluate.py ckpt=... sampler.name=heun cfg_interval=[0.0,0.7] eval.inception_mode=legacy_tensorflow \
        eval.reference=VIRTUAL_imagenet256_labeled.npz eval.metrics=[fid,is,sfid,precision_recall]     # ADM suite
    torchrun --nproc_per_node=8 scripts/evaluate.py ckpt=...      # any GPU count gives the same images and numbers

Config: configs/eval/evaluate.yaml (the package pixdit.configs.eval). The weights come from the EMA artifact
X.ema.pt next to the checkpoint X.ckpt (pixdit.checkpoint); use_ema=false reads the raw weights from X.ckpt, and so
does a run saved before the artifact existed. Writes into out_dir
(default RUN/eval/<ckpt>_n<N>_<sampler><steps>_cfg<C>[_in<lo>-<hi>]_<ema|raw>):
  metrics.json  the metrics (eval.metrics), per-seed values, the mean and, with seeds > 1, the std over seeds and the
                best seed set; plus the settings: checkpoint, the file read and its step, EMA or raw weights, sampler,
                steps, CFG scale and interval, precision, seeds and sample-index ranges, sample count, reference id,
                feature networks, world size
  grid.png      the first `grid_samples` samples (of the first seed)
  samples.npz   with save_npz=true: uint8 [N, H, W, 3] `arr_0` (+ `arr_1` labels for class-conditional models), the
                ADM evaluation suite's input format (first seed)
  config.yaml   the composed config
Samples are seeded per index (seed, i), so results do not depend on the GPU count or batch size; repeat r of
`seeds=R` uses indices [r*N, (r+1)*N).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.distributed as dist
import torchvision.utils
from omegaconf import DictConfig, OmegaConf

from pixdit.checkpoint import EMA_SUFFIX
from pixdit.cli import fail
from pixdit.errors import PixditError
from pixdit.eval import (
    build_suite,
    check_metric_names,
    default_stats_path,
    evaluate_generator,
    gather_by_index,
    save_adm_npz,
    summarize_seeds,
)
from pixdit.eval.sampling import check_batch_size, labels_for_indices
from pixdit.files import write_json
from pixdit.flow import check_sampler
from pixdit.runtime import rank_and_world_size, resolve_compile, resolve_precision


def setup_distributed(device_option: str) -> tuple[int, int, torch.device]:
    """torchrun / Lightning-style env (RANK, WORLD_SIZE, LOCAL_RANK) -> process group; else a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device_option == "auto" else device_option.startswith("cuda")
    if device_option not in ("auto", "cpu") and not device_option.startswith("cuda"):
        raise PixditError(f"device={device_option!r}; allowed: auto, cpu, cuda")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank_and_world_size()[0], world_size, device


def resolve_checkpoint(ckpt: str) -> Path:
    """A run directory -> RUN/checkpoints/last.ckpt; a file is taken as it is (pixdit.checkpoint.load_weights reads
    X.ckpt's EMA artifact X.ema.pt when there is one, and says what is missing when neither exists)."""
    path = Path(ckpt)
    return path / "checkpoints" / "last.ckpt" if path.is_dir() else path


def default_reference(ckpt: Path, resolution: int, inception_mode: str) -> str:
    """<data root>/fid_stats/<inception_mode>_<res>.npz from the run's saved Hydra config (RUN/.hydra/config.yaml)."""
    run_config = ckpt.parent.parent / ".hydra" / "config.yaml"
    hint = (
        "set eval.reference=cleanfid:ffhq_trainval70k (FFHQ 256/1024 px) or eval.reference=PATH of an .npz made by "
        "`python scripts/make_fid_stats.py --shards DATA_DIR`"
    )
    if not run_config.is_file():
        raise PixditError(f"eval.reference is not set and {run_config} (the run's data config) is missing: {hint}")
    root = OmegaConf.load(run_config).get("data", {}).get("root")
    path = default_stats_path(root, resolution, inception_mode) if root else None
    if path is None or not path.is_file():
        raise PixditError(
            f"eval.reference is not set and {path} does not exist. Make it with:\n"
            f"    python scripts/make_fid_stats.py --shards {root} --resolution {resolution}\n  or {hint}"
        )
    return str(path)


def evaluate(cfg: DictConfig) -> dict | None:
    if OmegaConf.is_missing(cfg, "ckpt"):
        raise PixditError(
            "ckpt= is required: a run directory (RUN/checkpoints/last.ckpt is read), a .ckpt file or "
            "its EMA artifact .ema.pt, e.g. ckpt=outputs/quickstart/<time>"
        )
    rank, world_size, device = setup_distributed(str(cfg.device))
    precision = resolve_precision(str(cfg.precision), device)
    if cfg.seeds < 1 or cfg.num_samples < cfg.eval.inception_splits or cfg.sampler.steps < 1:
        raise PixditError(
            f"need seeds >= 1, num_samples >= eval.inception_splits ({cfg.eval.inception_splits}), "
            f"sampler.steps >= 1; got seeds={cfg.seeds}, num_samples={cfg.num_samples}, "
            f"sampler.steps={cfg.sampler.steps}"
        )
    check_batch_size(cfg.batch_size)
    use_compile = resolve_compile(cfg.compile, device.type)
    # Start-up checks first, cheapest first: nothing is generated before the metric names, the sampler, the weights
    # files and the reference are known to be good (build_suite, below).
    metric_names = check_metric_names(cfg.eval.metrics)
    cfg_interval = check_sampler(cfg.sampler.name, cfg.cfg_interval)
    ckpt = resolve_checkpoint(str(cfg.ckpt))

    from pixdit.module import load_generator

    model, flow, weights = load_generator(ckpt, use_ema=bool(cfg.use_ema))
    model = model.to(device)
    image_size = tuple(weights.config["image_size"])
    num_classes = model.num_classes
    resolution = int(image_size[0])
    reference = cfg.eval.reference
    if not reference and set(metric_names) != {"is"}:
        reference = default_reference(ckpt, resolution, cfg.eval.inception_mode)
    suite = build_suite(
        metric_names,
        reference,
        resolution=resolution,
        device=device,
        inception_path=cfg.eval.inception_path,
        cache_dir=cfg.eval.cache_dir,
        inception_mode=cfg.eval.inception_mode,
        dinov2_path=cfg.eval.dinov2_path,
        cleanfid_stats_dir=cfg.eval.cleanfid_stats_dir,
        download=cfg.eval.download,
    )

    name = ckpt.name.removesuffix(".ckpt").removesuffix(EMA_SUFFIX)
    interval_tag = "" if cfg_interval is None else f"_in{cfg_interval[0]:g}-{cfg_interval[1]:g}"
    tag = (
        f"{name}_n{cfg.num_samples}_{cfg.sampler.name}{cfg.sampler.steps}_cfg{cfg.cfg_scale:g}{interval_tag}"
        f"_{weights.source}"
    )
    out_dir = Path(cfg.out_dir) if cfg.out_dir else ckpt.parent.parent / "eval" / tag
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, out_dir / "config.yaml")
    height, width = image_size
    npz_rows = None
    if cfg.save_npz:
        npy_path = out_dir / "samples_uint8.npy"
        if rank == 0:
            np.lib.format.open_memmap(npy_path, mode="w+", dtype=np.uint8, shape=(cfg.num_samples, height, width, 3))
        if world_size > 1:
            dist.barrier()
        npz_rows = np.lib.format.open_memmap(npy_path, mode="r+")

    per_seed = []
    for repeat in range(cfg.seeds):
        offset = repeat * cfg.num_samples
        grid_indices, grid_images = [], []

        def on_batch(
            indices, images, offset=offset, first=(repeat == 0), grid_indices=grid_indices, grid_images=grid_images
        ):
            if not first:
                return
            keep = indices < offset + cfg.grid_samples
            grid_indices.append(indices[keep])
            grid_images.append(images[keep])
            if npz_rows is not None:
                npz_rows[(indices - offset).numpy()] = images.permute(0, 2, 3, 1).numpy()

        metrics = evaluate_generator(
            model,
            flow,
            suite,
            num_samples=cfg.num_samples,
            image_size=image_size,
            steps=cfg.sampler.steps,
            sampler=cfg.sampler.name,
            cfg_interval=cfg_interval,
            seed=cfg.seed,
            cfg_scale=cfg.cfg_scale,
            num_classes=num_classes,
            index_offset=offset,
            batch_size=cfg.batch_size,
            device=device,
            precision=precision,
            compile=use_compile,
            inception_splits=cfg.eval.inception_splits,
            on_batch=on_batch,
        )
        per_seed.append({**metrics, "sample_indices": [offset, offset + cfg.num_samples]})
        if repeat == 0 and cfg.grid_samples > 0:
            # Grid images live on the ranks that generated them: gather them (uint8) in index order.
            indices = torch.cat(grid_indices) if grid_indices else torch.empty(0, dtype=torch.int64)
            images = torch.cat(grid_images) if grid_images else torch.empty(0, 3, height, width, dtype=torch.uint8)
            images = gather_by_index(images.to(device), indices.to(device)).cpu()
            if rank == 0:
                torchvision.utils.save_image(
                    images.float() / 255, out_dir / "grid.png", nrow=max(1, int(len(images) ** 0.5)), padding=2
                )
        if rank == 0:
            print(
                f"seed range {repeat}: "
                + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if isinstance(v, float)),
                flush=True,
            )

    if npz_rows is not None:
        npz_rows.flush()
        if world_size > 1:
            dist.barrier()
        if rank == 0:
            labels = labels_for_indices(range(cfg.num_samples), num_classes)
            save_adm_npz(
                out_dir / "samples.npz",
                np.lib.format.open_memmap(npy_path, mode="r"),
                labels.numpy() if labels is not None else None,
            )
            os.remove(npy_path)

    if rank != 0:
        return None
    result = {
        **summarize_seeds(per_seed),
        "per_seed": per_seed,
        "settings": {
            "checkpoint": str(ckpt.resolve()),
            "weights_file": str(weights.path.resolve()),  # the EMA artifact next to the checkpoint when it exists
            "global_step": weights.global_step,
            "weights": weights.source,
            "sampler": str(cfg.sampler.name),
            "steps": int(cfg.sampler.steps),
            "cfg_scale": float(cfg.cfg_scale),
            "cfg_interval": list(cfg_interval) if cfg_interval is not None else None,
            "cfg_interval_convention": "guidance where lo <= sigma <= hi; sigma = 1 pure noise, 0 data",
            "precision": precision,
            "seed": int(cfg.seed),
            "seeds": int(cfg.seeds),
            "noise_seeding": "sample i: torch.Generator seeded by mixed_seed(seed, i) (pixdit.runtime)",
            "num_samples": int(cfg.num_samples),
            "class_balance": f"label = i % {num_classes}" if num_classes else "unconditional",
            "image_size": list(image_size),
            "flow": repr(flow),
            "reference_id": suite.reference.id if suite.reference is not None else None,
            "reference": suite.reference.description if suite.reference is not None else None,
            "feature_networks": {**suite.describe(), "inception_splits": int(cfg.eval.inception_splits)},
            "world_size": world_size,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    write_json(out_dir / "metrics.json", result)  # summarize_sweep.py must never read half a file
    shown = ", ".join(
        f"{key} {result[key]:.4g}"
        + (f" ± {result[key + '_std_over_seeds']:.3g}" if key + "_std_over_seeds" in result else "")
        for key in ("fid", "is_mean", "kid", "sfid", "precision", "recall", "fd_dinov2")
        if result.get(key) is not None
    )
    print(f"{shown} ({cfg.seeds} x {cfg.num_samples} samples) -> {out_dir}/metrics.json", flush=True)
    return result


@hydra.main(version_base="1.3", config_path="pkg://pixdit.configs.eval", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    """The ``pixdit-evaluate`` command: the command line is Hydra's (``ckpt=... num_samples=...``)."""
    try:
        evaluate(cfg)
    except PixditError as error:
        fail(str(error))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()

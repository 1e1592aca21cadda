"""DiffusionModule: the LightningModule that trains a pixel DiT with noise-rescaled rectified flow
(docs/algorithms.md, "Flow matching with noise rescaling").

What it owns (``DiffusionModule.from_config(cfg, image_size)`` builds it from a run's config; see configs/train.yaml
for every key):

* the model (``pixdit.models.build_model``: model config + attention config + the data's image size) and the flow
  (``pixdit.flow.RectifiedFlow``: training loss and Euler sampler);
* AdamW with the recipe defaults (lr 1e-4, betas (0.9, 0.999), weight decay 0.01 on all parameters, eps 1e-8), a
  constant learning rate with optional linear warm-up (stepped every optimizer step); gradient clipping is the
  Trainer's ``gradient_clip_val`` (1.0 in configs/trainer), applied by the module itself for fused AdamW under bf16
  (Lightning's AMP plugin refuses it there);
* an fp32 EMA of the weights (``pixdit.ema``; decay ``min(0.9999, 1 - n^-3/4)``), updated after every optimizer step,
  saved in checkpoints and used for samples and ``val/loss_ema``;
* the divergence guard: before every optimizer update the gradient norm is computed (logged as ``train/grad_norm``)
  and, with the loss, checked in one host sync; a NaN / inf stops the run with a PixditError (step, which quantity,
  the last good checkpoint, what to try) before the update touches the weights, so no checkpoint ever holds them.
  ``optimizer.skip_nonfinite_steps=N`` drops up to N such updates (weights and EMA unchanged) before stopping;
* the **validation loss at fixed noise and fixed timesteps**: held-out image number ``i`` always gets the same noise
  (a generator seeded with ``(validation.seed, i)``) and the same ``sigma`` (a low-discrepancy sequence in ``i``), so
  ``val/loss`` is identical across runs, attention backends, batch sizes and devices (up to numerics) and is directly
  comparable between them;
* exact resume: the training noise, timesteps and label dropout of optimizer step ``n`` on rank ``r`` come from a
  private random stream seeded by ``(seed, r, n, micro-batch)``, so they never depend on what else consumed random
  numbers (data loaders, validation, sampling) and a resumed run draws exactly what the straight run drew. The global
  torch / CUDA / numpy / python RNG states are saved too and restored on resume (rank 0's, for code that uses them).

    module = DiffusionModule(model=cfg.model, attention=cfg.attention, image_size=(32, 32))
    trainer.fit(module, datamodule)
"""

from __future__ import annotations

import contextlib
import math
import random
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn

from pixdit.checkpoint import Weights, load_weights, newest_intact_checkpoint, read_checkpoint
from pixdit.config import construct, plain
from pixdit.ema import EMA
from pixdit.errors import PixditError
from pixdit.flow import RectifiedFlow
from pixdit.fsdp import FSDPStrategy, shard_model
from pixdit.models import build_model
from pixdit.runtime import mixed_seed, noise_for_indices

GOLDEN = (math.sqrt(5) - 1) / 2  # low-discrepancy step for the fixed validation timesteps
# The sections of configs/train.yaml that DiffusionModule.from_config reads.
CONFIG_SECTIONS = ("model", "attention", "flow", "optimizer", "ema", "validation", "seed")


def validation_noise_and_sigma(indices: torch.Tensor, shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed noise [n, *shape] and sigma [n] for held-out images with the given dataset indices (CPU, fp32).

    Depends only on (seed, index): not on the batch size, the rank, the device or anything drawn before.
    sigma_i = 0.001 + 0.999 * frac(0.5 + i * golden ratio) covers [0.001, 1) evenly for any number of images.
    """
    noise = noise_for_indices(indices.tolist(), shape, seed)
    frac = torch.remainder(0.5 + indices.double() * GOLDEN, 1.0)
    sigma = (0.001 + 0.999 * frac).float()
    return noise, sigma


def adamw_options(
    lr: float = 1e-4,
    betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.01,
    eps: float = 1e-8,
    warmup_steps: int = 0,
    fused: bool | None = None,
    skip_nonfinite_steps: int = 0,
) -> dict:
    """The ``optimizer`` section: AdamW's arguments (defaults: the paper's recipe, docs/algorithms.md "Flow matching
    with noise rescaling"), the linear LR warm-up and the divergence guard's allowance. Built through ``pixdit.config.construct``, so an unknown key or a word for a
    number is a clear error; values AdamW would refuse only at the first step are refused here."""

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(number(b) and 0 <= b < 1 for b in betas):
        raise PixditError(f"optimizer.betas={betas!r} must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("eps", eps)):
        if not number(value) or value < 0:
            raise PixditError(f"optimizer.{name}={value!r} must be a number >= 0")
    for name, value in (("warmup_steps", warmup_steps), ("skip_nonfinite_steps", skip_nonfinite_steps)):
        if not count(value):
            raise PixditError(f"optimizer.{name}={value!r} must be a whole number >= 0")
    return dict(
        lr=lr,
        betas=tuple(betas),
        weight_decay=weight_decay,
        eps=eps,
        warmup_steps=warmup_steps,
        fused=fused,
        skip_nonfinite_steps=skip_nonfinite_steps,
    )


def validation_options(seed: int = 0) -> dict:
    """The ``validation`` section: the seed of the fixed validation noise and timesteps."""
    return dict(seed=check_seed(seed, "validation.seed"))


def check_seed(seed, name: str = "seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise PixditError(f"{name}={seed!r} must be a non-negative integer")
    return seed


def build_model_and_flow(
    model: dict, attention: dict | None, image_size: int | tuple[int, int], flow: dict | None
) -> tuple[torch.nn.Module, RectifiedFlow]:
    """The DiT and the rectified flow of a run's ``model`` / ``attention`` / ``flow`` config sections at the data's
    image size: what DiffusionModule trains, and what ``load_generator`` rebuilds from a checkpoint for sampling."""
    image_size = (image_size, image_size) if isinstance(image_size, int) else tuple(plain(image_size))
    return (
        build_model(**plain(model), attention=plain(attention) or {"name": "full"}, input_size=image_size),
        construct(RectifiedFlow, plain(flow) or {}, "flow", image_size=image_size),
    )


def load_generator(
    path: str | Path, use_ema: bool = True, key: str = "ckpt"
) -> tuple[torch.nn.Module, RectifiedFlow, Weights]:
    """The model (eval mode, on the CPU) and flow of a run's checkpoint, for sampling, with the weights' origin:
    the EMA weights by default, read from the EMA artifact next to the checkpoint when there is one
    (``pixdit.checkpoint.load_weights``). pixdit-evaluate and scripts/llsa_recall.py load checkpoints here."""
    weights = load_weights(path, use_ema=use_ema, key=key)
    if weights.config is None:
        raise PixditError(
            f"{key}={str(path)!r} has no model config (hyper_parameters): not a pixdit training run's checkpoint"
        )
    config = weights.config
    model, flow = build_model_and_flow(config["model"], config["attention"], config["image_size"], config["flow"])
    model.load_state_dict(weights.state_dict)
    return model.eval(), flow, weights


class DiffusionModule(L.LightningModule):
    """Pixel DiT + rectified flow + AdamW + EMA; each argument is one section of configs/train.yaml (see there)."""

    def __init__(
        self,
        model: dict,
        attention: dict | None = None,
        image_size: int | tuple[int, int] = 32,
        flow: dict | None = None,
        optimizer: dict | None = None,
        ema: dict | None = None,
        validation: dict | None = None,
        seed: int = 0,
        compile: bool = False,
    ):
        super().__init__()
        model, attention, flow = plain(model), plain(attention) or {"name": "full"}, plain(flow) or {}
        optimizer, ema, validation = plain(optimizer) or {}, plain(ema) or {}, plain(validation) or {}
        image_size = tuple(plain(image_size)) if not isinstance(image_size, int) else (image_size, image_size)
        self.save_hyperparameters(
            dict(
                model=model,
                attention=attention,
                image_size=image_size,
                flow=flow,
                optimizer=optimizer,
                ema=ema,
                validation=validation,
                seed=seed,
                compile=compile,
            )
        )
        self.image_size = image_size
        self.model, self.flow = build_model_and_flow(model, attention, image_size, flow)
        self.optimizer_options = construct(adamw_options, optimizer, "optimizer")
        self.ema = construct(EMA, ema, "ema", model=self.model)
        # Attention backends whose behaviour follows the optimizer step (VSA's dense-to-sparse annealing).
        self._step_scheduled = [m for m in self.model.modules() if hasattr(m, "set_training_step")]
        self.validation_seed = construct(validation_options, validation, "validation")["seed"]
        self.seed = check_seed(seed)
        if compile:
            # In place (keeps parameter names, so checkpoints load into uncompiled models); the EMA copy stays eager.
            self.model.compile()
        self._val_seen = 0
        self.validated_at_step = -1  # optimizer step of the last validation (train.py validates the final step)
        # divergence guard (on_before_optimizer_step): the micro-batch losses of the step being accumulated, and the
        # updates dropped so far in the run (checkpointed)
        self._step_losses: list[torch.Tensor] = []
        self._drop_update = False
        self.nonfinite_steps_skipped = 0

    @classmethod
    def from_config(cls, cfg, image_size: int | tuple[int, int], compile: bool = False) -> DiffusionModule:
        """The module of a run's config (configs/train.yaml: the CONFIG_SECTIONS; a missing one takes its defaults)
        at the data's image size. The one place a run's module is built: pixdit-train, the sweep's pre-launch check
        (on the meta device) and scripts/bench_train.py."""
        sections = {key: cfg.get(key) for key in CONFIG_SECTIONS if cfg.get(key) is not None}
        return cls(**sections, image_size=image_size, compile=compile)

    def configure_model(self) -> None:
        """Lightning calls this on every rank before building the optimizer: under trainer=fsdp the model is sharded
        (pixdit.fsdp; the EMA copy stays whole); with any other strategy nothing happens."""
        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            shard_model(self.model, self.trainer.strategy.device_mesh)

    # ------------------------------------------------------------------ sizes
    @property
    def num_classes(self) -> int:
        return self.model.num_classes

    @property
    def tokens_per_image(self) -> int:
        h, w = self.model.grid_size(*self.image_size)
        return h * w

    # ------------------------------------------------------------------ training
    @contextlib.contextmanager
    def _step_rng(self, batch_idx: int):
        """Private random stream for one training micro-batch, keyed by (seed, rank, step, micro-batch)."""
        accumulate = self.trainer.accumulate_grad_batches if self._trainer is not None else 1
        rank = self.global_rank if self._trainer is not None else 0
        step = self.trainer.global_step if self._trainer is not None else 0
        step_seed = mixed_seed(self.seed, rank, step, batch_idx % accumulate)
        cuda = self.device.type == "cuda"
        with torch.random.fork_rng(devices=[self.device] if cuda else [], device_type="cuda"):
            torch.random.default_generator.manual_seed(step_seed)
            if cuda:
                torch.cuda.default_generators[self.device.index or 0].manual_seed(step_seed)
            yield

    def _labels(self, batch) -> torch.Tensor | None:
        if self.num_classes == 0:
            return None
        if "label" not in batch:
            raise PixditError(
                f"model.num_classes={self.num_classes} needs labelled data, but the batches have no "
                f"'label' (use a labelled dataset or model.num_classes=0)"
            )
        return batch["label"]

    def on_train_batch_start(self, batch, batch_idx) -> None:
        for module in self._step_scheduled:
            module.set_training_step(self.trainer.global_step)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images = batch["image"]
        with self._step_rng(batch_idx):
            loss = self.flow.loss(self.model, images, y=self._labels(batch))
        self._step_losses.append(loss.detach())
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False, batch_size=images.shape[0])
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        """The divergence guard, after the step's backward pass(es) and before clipping and the update (see the module
        doc). With fp16's GradScaler an inf gradient is the scaler's business (it skips that update and lowers its
        scale), so only the loss is checked there."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor of per-shard partial norms; this reduces them
            norm = norm.full_tensor()
        self.log("train/grad_norm", norm, on_step=True, on_epoch=False)
        losses = torch.stack(self._step_losses) if self._step_losses else torch.zeros(1, device=self.device)
        self._step_losses = []
        bad_loss, bad_norm = torch.stack([~torch.isfinite(losses).all(), ~torch.isfinite(norm)]).tolist()  # one sync
        bad_norm = bad_norm and not self._has_grad_scaler()
        bad = bad_loss or bad_norm
        if self.trainer.world_size > 1:  # the ranks' losses differ: every rank must take the same decision
            bad = self.trainer.strategy.reduce_boolean_decision(bad, all=False)
        self._drop_update = bad
        if not bad:
            return
        what = "the loss" if bad_loss else "the gradient norm" if bad_norm else "the loss on another rank"
        values = f"loss {', '.join(f'{v:g}' for v in losses.float().cpu().tolist())}, gradient norm {float(norm):g}"
        step = self.trainer.global_step
        allowed = self.optimizer_options["skip_nonfinite_steps"]
        if self.nonfinite_steps_skipped < allowed:
            self.nonfinite_steps_skipped += 1
            optimizer.zero_grad(set_to_none=True)  # the optimizer then leaves every parameter as it is
            rank_zero_warn(
                f"step {step}: {what} of the next update is NaN or inf ({values}); the update was dropped "
                f"({self.nonfinite_steps_skipped} of optimizer.skip_nonfinite_steps={allowed})"
            )
            return
        raise PixditError(self._divergence_message(step, what, values, allowed))

    def _divergence_message(self, step: int, what: str, values: str, allowed: int) -> str:
        trainer = self.trainer
        callback = trainer.checkpoint_callback
        candidates = [newest_intact_checkpoint(callback.dirpath) if callback is not None and callback.dirpath else None]
        if trainer.ckpt_path is not None:  # the checkpoint this run resumed from
            candidates.append((Path(trainer.ckpt_path), int(read_checkpoint(trainer.ckpt_path)["global_step"])))
        found = max((c for c in candidates if c is not None), key=lambda c: c[1], default=None)
        kept = (
            f"The last good checkpoint is {found[0]} (step {found[1]}): resume from it with ckpt_path={found[0]}"
            if found
            else "No checkpoint had been written yet: start again"
        )
        options = self.optimizer_options
        fp32 = (
            "" if str(trainer.precision) == "32-true" else f", or trainer.precision=32-true (now {trainer.precision})"
        )
        return (
            f"training diverged at step {step}: {what} of the next update is NaN or inf ({values}). The weights "
            f"were not updated with it and no checkpoint was written after it. {kept} after changing what made "
            f"it diverge: a smaller optimizer.lr (now {options['lr']:g}), a longer optimizer.warmup_steps (now "
            f"{options['warmup_steps']}), gradient clipping (trainer.gradient_clip_val, now "
            f"{trainer.gradient_clip_val}){fp32}. optimizer.skip_nonfinite_steps=N drops up to N such updates "
            f"instead of stopping (now {allowed})."
        )

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        # After every optimizer step (not every micro-batch), as the recipe does; not after a dropped update.
        if not self._drop_update:
            self.ema.update(self.model)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self.trainer.global_step % max(1, self.trainer.log_every_n_steps) == 0:
            self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)
            self.log("train/ema_decay", self.ema.decay(max(1, self.ema.update_count)), on_step=True, on_epoch=False)
            skipped = getattr(self.trainer.datamodule, "skipped_samples", None)
            if skipped is not None:  # unreadable images left out so far (ShardDataModule), summed over the ranks
                self.log(
                    "data/skipped_images", float(skipped), on_step=True, on_epoch=False, reduce_fx="sum", sync_dist=True
                )

    def configure_optimizers(self):
        options = dict(self.optimizer_options)
        warmup_steps = int(options.pop("warmup_steps"))
        fused = options.pop("fused")
        if fused is None:  # fp16-mixed's GradScaler must unscale before clipping: only the unfused AdamW allows it
            fused = self.device.type == "cuda" and not self._has_grad_scaler()
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params,
            lr=options["lr"],
            betas=tuple(options["betas"]),
            weight_decay=options["weight_decay"],
            eps=options["eps"],
            fused=fused,
        )
        # Linear warm-up: lr * (step + 1) / warmup_steps for steps 0 .. warmup_steps - 1, then lr (constant).
        scheduler = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1 / max(1, warmup_steps), total_iters=max(0, warmup_steps - 1)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _has_grad_scaler(self) -> bool:
        trainer = self._trainer  # None when the module is used outside a Trainer
        return trainer is not None and getattr(trainer.precision_plugin, "scaler", None) is not None

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        # Lightning's AMP plugin refuses to clip for an optimizer that unscales its own gradients (fused AdamW),
        # because under fp16 the gradients would still carry the GradScaler's factor. bf16 autocast has no scaler:
        # the gradients are true ones, so clip them here with the same rule the Trainer would apply.
        if (
            gradient_clip_val
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and not self._has_grad_scaler()
        ):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if gradient_clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------------ validation
    def on_validation_epoch_start(self) -> None:
        self._val_seen = 0

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self.validated_at_step = self.trainer.global_step

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        images = batch["image"]
        b = images.shape[0]
        # Dataset index of each image: from the batch when the loader provides it, else the running count (the
        # validation loader's order is fixed, so the count is the index).
        indices = batch["index"].cpu() if "index" in batch else torch.arange(self._val_seen, self._val_seen + b)
        self._val_seen += b
        noise, sigma = validation_noise_and_sigma(indices, images.shape[1:], self.validation_seed)
        noise, sigma = noise.to(images.device), sigma.to(images.device)
        y = self._labels(batch)
        loss = self.flow.loss(self.model, images, y=y, noise=noise, sigma=sigma)
        loss_ema = self.flow.loss(self.ema.model, images, y=y, noise=noise, sigma=sigma)
        self.log("val/loss", loss, on_epoch=True, sync_dist=True, batch_size=b, prog_bar=True)
        self.log("val/loss_ema", loss_ema, on_epoch=True, sync_dist=True, batch_size=b)

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def sample_images(
        self,
        num_samples: int,
        steps: int = 20,
        seed: int = 0,
        cfg_scale: float = 1.0,
        use_ema: bool = True,
        sampler: str = "euler",
        cfg_interval=None,
    ) -> torch.Tensor:
        """Images in [-1, 1] from fixed noise (seed), with the EMA model by default; labels 0, 1, 2, ... if
        class-conditional. sampler / cfg_interval: see RectifiedFlow.sample."""
        h, w = self.image_size
        noise = torch.randn((num_samples, 3, h, w), generator=torch.Generator().manual_seed(seed)).to(self.device)
        y = torch.arange(num_samples, device=self.device) % self.num_classes if self.num_classes else None
        model = self.ema.model if use_ema else self.model
        was_training = model.training
        model.eval()
        autocast = (
            self.trainer.precision_plugin.forward_context() if self._trainer is not None else contextlib.nullcontext()
        )
        with autocast:
            images = self.flow.sample(
                model, noise, steps, y=y, cfg_scale=cfg_scale, sampler=sampler, cfg_interval=cfg_interval
            )
        model.train(was_training)
        return images.float()

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning does not save RNG states. Ours (rank 0's): the training noise does not depend on them (see the
        # module docstring), but anything else that draws from the global generators resumes where it was.
        # Stored as tensors / plain Python values so the checkpoint loads with torch.load(weights_only=True).
        kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        version, python_state, gauss_next = random.getstate()
        checkpoint["nonfinite_steps_skipped"] = self.nonfinite_steps_skipped
        checkpoint["rng_states"] = {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached_gaussian)],
            "python": [version, torch.tensor(python_state, dtype=torch.int64), gauss_next],
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.nonfinite_steps_skipped = int(checkpoint.get("nonfinite_steps_skipped", 0))
        states = checkpoint.get("rng_states")
        if states is None:
            return
        torch.set_rng_state(states["torch"])
        if states["cuda"] and torch.cuda.is_available() and len(states["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states["cuda"])
        kind, keys, pos, has_gauss, cached_gaussian = states["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
        version, python_state, gauss_next = states["python"]
        random.setstate((version, tuple(python_state.tolist()), gauss_next))

    def init_from(self, path: str | Path, use_ema: bool = True) -> str:
        """Start from another run's weights (e.g. the 32-px model for a 128-px run: RoPE and no absolute positions
        make the weights resolution-independent). Loads the EMA weights (from the EMA artifact next to a checkpoint
        when there is one; or the raw ones with use_ema=False) into the model and restarts the EMA from them; the
        optimizer, LR schedule and step count start fresh. Returns the message that train.py logs."""
        loaded = load_weights(path, use_ema=use_ema, key="init_from")
        path, weights = loaded.path, loaded.state_dict
        own = self.model.state_dict()
        wrong = [
            f"{k}: {tuple(v.shape)} in the checkpoint vs {tuple(own[k].shape)} here"
            for k, v in weights.items()
            if k in own and own[k].shape != v.shape
        ]
        if wrong:
            raise PixditError(
                f"init_from={str(path)!r} does not fit this model (different architecture?): " + "; ".join(wrong[:5])
            )
        result = self.model.load_state_dict(weights, strict=False)
        self.ema.reset(self.model)
        source = "EMA" if loaded.source == "ema" else "raw"
        message = (
            f"init_from: loaded {len(weights) - len(result.unexpected_keys)} {source} weight tensors from {path}; "
            f"optimizer, LR schedule, EMA and step count start fresh"
        )
        if result.missing_keys:
            message += f"; newly initialised (not in the checkpoint): {result.missing_keys}"
        if result.unexpected_keys:
            message += f"; ignored (not in this model): {result.unexpected_keys}"
        return message

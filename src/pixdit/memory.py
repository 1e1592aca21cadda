"""GPU memory of a training run: an analytic estimate before the first step, and what to turn when it does not fit.

    estimate = estimate_training_memory(model, batch_size=8, precision="bf16-mixed")
    print(estimate.summary())            # weights 0.5 + gradients 0.5 + ... = 41.2-63.0 GiB
    check_fits(model, estimate, free_bytes)   # PixditError naming the knobs when even the low estimate exceeds free memory
    with explain_out_of_memory(model, estimate, trainer):
        trainer.fit(...)                 # a CUDA out-of-memory error becomes one PixditError with the same advice

train.py does both (``check_training_memory`` before ``fit``). The formula, per GPU, P = parameters, p = bytes of a
weight (4, or 2 for bf16-true / 16-true), a = bytes of an activation value (2 under bf16 / fp16, else 4),
n = pixel tokens per GPU per step (batch x tokens per image), d = hidden size:

    persistent   weights p*P + gradients p*P + AdamW moments 2p*P + fp32 EMA 4P
                 + bf16 copies of the weights that autocast keeps for the backward 2P (mixed precision)
                 + DDP's gradient buckets p*P, or with FSDP over W GPUs: weights, gradients and AdamW / W, plus
                 the gathered fp32 weights of 3 blocks (the one running, the next, and its gradients)
    activations  n * d * a * sum over blocks of the values kept per token (KEPT below; depends on
                 model.grad_checkpointing) + n * d * a * (4 + the values one block recomputes in the backward + 8
                 of backward workspace) + n * 72 bytes of fp32 pixel tensors (image, noise, target, ...)

KEPT counts the tensors a DiT block saves for its backward pass, in units of d per token. High = eager PyTorch: LN
input (fp32 under autocast: 2) + its output, the qkv input, qkv (3), q, k, v, o (4), the proj input, the attention
output for the gate, then the same LN / modulation / fc1 input, fc1 output (4), GELU output (4) and MLP output = 26.
Low = what any fusion must keep (torch.compile recomputes the elementwise ops): the matmul inputs, qkv and q, k, v, o
for the opaque kernels, and the two residual inputs = 16. The truth lies between: the check refuses to start only
when the *low* estimate exceeds the free memory, and the first step's out-of-memory error carries the same advice.
Measured on the H200 (max_memory_allocated; docs/benchmarks.md, "Model sizes"): eager DiT-B at 256^2 with LLSA, 4
images per step, peaked at 122.8 GiB against a high estimate of 124.2 GiB (+1%). Compiled, without checkpointing,
DiT-S/B/L/XL at 128^2 and 256^2 (8 runs, LLSA and full attention alike) peaked 41-45% of the way from the low to the
high estimate; DiT-XL at 256^2 with grad_checkpointing=true at the low estimate (82.5 GB against 82.5-94.6), with mlp
at 28% of the way. So the low bound is not a safe batch size for a compiled run, and halfway ("mid") is above every
measured peak.
Not counted: the allocator's fragmentation (reserved > allocated), the CUDA context, the sparse kernels' selection
buffers, VSA's / SLA's own projections. scripts/bench_train.py prints both bounds next to every measured peak.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from pixdit.errors import PixditError
from pixdit.runtime import TRAINER_PRECISIONS

log = logging.getLogger("pixdit")
GiB = 2**30

# Values per token (units of the hidden size) a block keeps for the backward pass, (low, high), by what it
# recomputes (pixdit.models.checkpointing: None = nothing, "block" = all of it, "mlp", "attn").
KEPT = {None: (16, 26), "block": (1, 1), "mlp": (12, 18), "attn": (8, 18)}
# Values per token that come back to life while one block recomputes that part in the backward pass.
RECOMPUTED = {None: (0, 0), "block": (16, 26), "mlp": (4, 8), "attn": (8, 8)}
OUTSIDE_BLOCKS = 4  # values per token outside the blocks: embedding output, final LayerNorm / modulation / input
BACKWARD_WORKSPACE = 8  # values per token of one block's backward (gradients of its widest intermediates)
PIXEL_TENSORS = 6  # fp32 image-shaped tensors of the loss: x0, noise, x_sigma, target, prediction, difference
FSDP_GATHERED_BLOCKS = 3  # blocks whose full fp32 weights FSDP holds at once (running, prefetched, gradients)
STRATEGIES = ("single", "ddp", "fsdp")


@dataclass
class MemoryEstimate:
    """Bytes per GPU by part, each (low, high); the knobs it was estimated for are kept to say what to change."""

    parts: dict[str, tuple[float, float]]
    batch_size: int
    precision: str
    strategy: str
    world_size: int
    grad_checkpointing: dict = field(default_factory=dict)
    bytes_per_image: tuple[float, float] = (0.0, 0.0)  # the part that scales with the batch
    free_bytes: float | None = None  # the free GPU memory it was compared with (check_fits)

    @property
    def low(self) -> float:
        return sum(low for low, _ in self.parts.values())

    @property
    def high(self) -> float:
        return sum(high for _, high in self.parts.values())

    def summary(self) -> str:
        def gib(low, high):
            return f"{low / GiB:.1f}" if abs(high - low) < 0.05 * GiB else f"{low / GiB:.1f}-{high / GiB:.1f}"

        parts = " + ".join(f"{name} {gib(*bounds)}" for name, bounds in self.parts.items())
        return f"{parts} = {gib(self.low, self.high)} GiB per GPU"


def estimate_training_memory(
    model,
    batch_size: int,
    precision: str = "bf16-mixed",
    strategy: str = "single",
    world_size: int = 1,
    grad_checkpointing: dict | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of training ``model`` (a pixdit DiT) at its input size with ``batch_size`` images per GPU.

    ``precision``: the Trainer's (bf16-mixed, 32-true, ...); ``strategy``: single | ddp | fsdp (``world_size`` GPUs);
    ``grad_checkpointing``: a plan of pixdit.models.checkpointing (default: the model's own)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    plan = model.grad_checkpointing_plan if grad_checkpointing is None else grad_checkpointing
    mixed = str(precision).endswith("-mixed")
    half_weights = str(precision) in ("bf16-true", "16-true")
    a = 2 if TRAINER_PRECISIONS.get(str(precision), "fp32") != "fp32" else 4
    p = 2 if half_weights else 4
    P = sum(parameter.numel() for parameter in model.parameters())
    P_block = sum(parameter.numel() for parameter in model.blocks[0].parameters())
    depth, d = len(model.blocks), model.blocks[0].attn.qkv.in_features
    tokens_per_image = model.grid_size(*model.input_size)[0] * model.grid_size(*model.input_size)[1]
    pixels_per_token = model.in_channels * model.patch_size**2

    shards = world_size if strategy == "fsdp" else 1
    parts = {"weights": p * P / shards, "gradients": p * P / shards, "AdamW": 2 * p * P / shards, "EMA": 4 * P}
    if mixed:
        parts["autocast weight copies"] = 2 * P
    if strategy == "ddp":
        parts["DDP buckets"] = p * P
    if strategy == "fsdp":
        parts["FSDP gathered blocks"] = FSDP_GATHERED_BLOCKS * 4 * P_block
    persistent = {name: (value, value) for name, value in parts.items()}

    def per_image(bound: int) -> float:  # bound 0 = low, 1 = high
        kept = sum(KEPT[plan.get(index)][bound] for index in range(depth))
        transient = max(RECOMPUTED[plan.get(index)][bound] for index in range(depth)) + BACKWARD_WORKSPACE
        values = kept + OUTSIDE_BLOCKS + transient
        return tokens_per_image * (values * d * a + PIXEL_TENSORS * pixels_per_token * 4)

    image = (per_image(0), per_image(1))
    persistent["activations"] = (batch_size * image[0], batch_size * image[1])
    return MemoryEstimate(persistent, batch_size, str(precision), strategy, world_size, dict(plan), image)


BOUNDS = {"low": 0.0, "mid": 0.5, "high": 1.0}  # where between the two estimates: the fraction of (high - low)


def largest_batch(estimate: MemoryEstimate, free_bytes: float, bound: str = "high") -> int:
    """The largest batch whose estimate fits ``free_bytes``; 0 when not even one image. ``bound``: low | mid | high,
    mid = halfway between them (compiled runs peak at or below it, see the measurements above)."""
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {tuple(BOUNDS)}, got {bound!r}")
    f = BOUNDS[bound]
    total = estimate.low + f * (estimate.high - estimate.low)
    per_image = estimate.bytes_per_image[0] + f * (estimate.bytes_per_image[1] - estimate.bytes_per_image[0])
    fixed = total - estimate.batch_size * per_image
    return max(0, int((free_bytes - fixed) // per_image))


def advice(model, estimate: MemoryEstimate) -> str:
    """What to turn, each with its own estimate: batch size, grad checkpointing, precision, FSDP; and the compiled
    step's memory budget, with its measured effect (the estimate does not model it)."""

    def with_(**changes) -> str:
        options = dict(
            batch_size=estimate.batch_size,
            precision=estimate.precision,
            strategy=estimate.strategy,
            world_size=estimate.world_size,
            grad_checkpointing=estimate.grad_checkpointing,
        )
        options.update(changes)
        other = estimate_training_memory(model, **options)
        return f"{other.low / GiB:.1f}-{other.high / GiB:.1f} GiB"

    from pixdit.models.checkpointing import grad_checkpointing_plan

    depth = len(model.blocks)
    lines = ["Turn one of these knobs (estimated memory per GPU after the change):"]
    if estimate.free_bytes is not None:
        fits = largest_batch(estimate, estimate.free_bytes)
        fit_text = (
            f"at most {fits} image(s) per GPU fit by the high estimate"
            if fits
            else "not even one image fits without another knob"
        )
        lines.append(
            f"  data.batch_size={max(1, fits)} (now {estimate.batch_size}; {fit_text}); with several GPUs "
            f"trainer.devices keeps the global batch; or trainer.accumulate_grad_batches"
        )
    else:
        lines.append(
            f"  data.batch_size={max(1, estimate.batch_size // 2)} (now {estimate.batch_size}): "
            f"{with_(batch_size=max(1, estimate.batch_size // 2))}"
        )
    if len(estimate.grad_checkpointing) < depth or set(estimate.grad_checkpointing.values()) != {"block"}:
        lines.append(
            f"  model.grad_checkpointing=true (recompute every block in the backward, ~1/3 more compute): "
            f"{with_(grad_checkpointing=grad_checkpointing_plan(True, depth))}; mlp / attention / a number "
            f"of blocks recompute less and save less"
        )
    lines.append(
        "  compile_memory_budget=0.9 (with compile on: the compiled backward recomputes more of the forward; measured "
        "-20% peak memory for +9% time per step on DiT-S LLSA 256^2; not in these estimates)"
    )
    if TRAINER_PRECISIONS.get(estimate.precision, "fp32") == "fp32":
        lines.append(
            f"  trainer.precision=bf16-mixed (now {estimate.precision}; halves the activations): "
            f"{with_(precision='bf16-mixed')}"
        )
    if estimate.strategy != "fsdp":
        world = max(2, estimate.world_size)
        lines.append(
            f"  trainer=fsdp trainer.devices={world} (shards weights, gradients and AdamW over the GPUs; "
            f"activations stay per GPU): {with_(strategy='fsdp', world_size=world)}"
        )
    return "\n".join(lines)


def check_fits(model, estimate: MemoryEstimate, free_bytes: float, where: str = "the GPU") -> bool:
    """PixditError with the advice when even the low estimate exceeds ``free_bytes``; True when the high one fits
    too (False: it may not fit; the first step will tell). Records ``free_bytes`` in the estimate."""
    estimate.free_bytes = free_bytes
    if estimate.low > free_bytes:
        raise PixditError(
            f"this configuration does not fit {where}: it needs an estimated {estimate.summary()}, "
            f"but {free_bytes / GiB:.1f} GiB are free.\n{advice(model, estimate)}"
        )
    return estimate.high <= free_bytes


@contextlib.contextmanager
def explain_out_of_memory(model, estimate: MemoryEstimate | None, trainer=None):
    """Turn a CUDA out-of-memory error inside the block into one PixditError: where it happened, the estimate and the
    knobs to turn."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        step = f" at step {trainer.global_step}" if trainer is not None else ""
        first = str(error).strip().split("\n")[0].split(". ")[0]
        text = f"training ran out of GPU memory{step} ({first})."
        if estimate is not None:
            text += f" Estimated need: {estimate.summary()}.\n{advice(model, estimate)}"
        raise PixditError(text) from None


def free_memory(device: torch.device) -> float | None:
    """Free bytes on a CUDA device (what the driver reports, other processes included); None elsewhere."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def check_training_memory(trainer, model, batch_size: int) -> MemoryEstimate:
    """Before ``trainer.fit``: estimate this rank's memory and, on a CUDA device, compare it with the free memory
    (PixditError naming the knobs when it cannot fit). Returns the estimate for ``explain_out_of_memory``."""
    from lightning.pytorch.strategies import DDPStrategy

    from pixdit.fsdp import FSDPStrategy

    world_size = trainer.num_devices * trainer.num_nodes
    strategy = (
        "fsdp"
        if isinstance(trainer.strategy, FSDPStrategy)
        else "ddp"
        if isinstance(trainer.strategy, DDPStrategy) and world_size > 1
        else "single"
    )
    estimate = estimate_training_memory(model, batch_size, str(trainer.precision), strategy, world_size)
    device = trainer.strategy.root_device
    free_bytes = free_memory(device)
    if free_bytes is None:
        return estimate
    if check_fits(model, estimate, free_bytes, where=f"{device} ({free_bytes / GiB:.1f} GiB free)"):
        log.info("estimated GPU memory: %s (%.1f GiB free)", estimate.summary(), free_bytes / GiB)
    else:
        log.warning(
            "estimated GPU memory: %s, and %.1f GiB are free: the high estimate does not fit; if the first "
            "step runs out of memory, the error says which knob to turn",
            estimate.summary(),
            free_bytes / GiB,
        )
    return estimate

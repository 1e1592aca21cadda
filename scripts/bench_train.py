"""Training throughput of the pixel DiT for several models, attention variants, image sizes and grad-checkpointing
settings, measured in one process.

Per (model, size, grad checkpointing, variant): images/s, pixel tokens/s, ms/step, peak GPU memory next to the
estimate of pixdit.memory, MFU and the speed-up over full attention, as a markdown table (stdout), and with --out DIR
as bench_train.md, bench_train.json (both rewritten after every row, so a run cut short keeps its rows) and
bench_train.png (the LLSA paper's Fig. 3: speed-up over full attention vs tokens, and tokens/s vs tokens; with
several models instead tokens/s and MFU vs parameters).

    # the figure of docs/benchmarks.md (H200); scripts/device_suite.sh train runs this
    python scripts/bench_train.py --attention full llsa:num_levels=1 llsa:num_levels=2 llsa:num_levels=3 vsa sla \\
        --sizes 64 128 256 512 --warmup 3 --steps 10 --steps-at 512:1:3 --out bench/train
    # the model-size table (scripts/device_suite.sh grow)
    python scripts/bench_train.py --models DiT-S DiT-B DiT-L DiT-XL --attention full llsa:num_levels=2 \\
        --sizes 128 256 --compile --warmup 2 --steps 3 --out bench/grow
    python scripts/bench_train.py --models DiT-XL --attention llsa:num_levels=2 --sizes 256 --tokens-per-step 524288 \\
        --grad-checkpointing true mlp 14 --compile          # memory as a knob: one row per setting
    python scripts/bench_train.py --attention llsa --sizes 128 256             # one backend, table on stdout
    python scripts/bench_train.py --attention llsa:num_levels=2 --sizes 128 256 --profile   # + top CUDA ops per run
    python scripts/bench_train.py --attention llsa:num_levels=2 --sizes 256 --compile --means both   # an A/B
    python scripts/bench_train.py --plot-from bench/train/bench_train.json      # redraw the PNG only (no GPU needed)
    python scripts/bench_train.py --plot-from bench/grow128/bench_train.json bench/grow256/bench_train.json --out docs/img
    python scripts/bench_train.py --device cpu --quick --attention full llsa --out /tmp/bench   # CPU check

Variants (``--attention``): ``NAME`` trains with configs/attention/NAME.yaml, as ``train.py attention=NAME`` does;
``NAME:KEY=VALUE,KEY=VALUE`` overrides keys of that file (values are read as YAML: 2, 0.5, [8,4], null, true). Every
variant is built once by ``pixdit.attention.build_attention`` before anything is timed, so an unknown key stops the run
at once with an error naming the variant and the allowed keys. Backends that need Z-order tokens (llsa, vsa, sla) get
``model.token_order=zorder``. ``--grad-checkpointing`` takes the values of ``model.grad_checkpointing`` (false, true,
a number of blocks, mlp, attention; no value = true), one row each. ``--means both`` times each LLSA, VSA or SLA
variant of blocks of 16 twice: with its block means of q, k, v computed by the qk-norm + RoPE kernel (what the model
does) and by the backend itself (the variant's label then ends in "(means in backend)").

Every cell is a number or a one-line reason. A variant that cannot run at a size (LLSA with L=3 needs a multiple of
16^3 tokens) is a "skipped" row with the model's reason. Batch: ``--tokens-per-step`` / pixels per image (262,144:
64 at 64^2, 16 at 128^2, 4 at 256^2, 1 at 512^2). Where that cannot fit, the row runs the largest batch that does and
says so in its note: first the estimate (pixdit.memory, against the free GPU memory: the high bound for eager runs,
halfway between the bounds with --compile) picks the batch; a CUDA out-of-memory error then tries the largest batch
the high bound allows, and every further one halves it; at batch 1 the row is "OOM".

Each step is what DiffusionModule.training_step + the Trainer do per optimizer step: flow-matching loss under bf16
autocast, backward, gradient clipping at 1.0, AdamW step (fused on GPU), EMA update; on synthetic images (no data
loader: `scripts/bench_data.py` measures that side). Default: DiT-S, 5 warm-up steps, then the median of 20 steps
timed with CUDA events (``--steps-at SIDE:WARMUP:STEPS`` changes the counts at one size, e.g. 512:1:3 where full
attention takes ~10 s/step). ``--profile`` adds, per row, where a step's time goes: by phase (forward+loss,
backward, clip, optimizer, EMA; CUDA events between the phases, median of 3 steps), by kind of kernel (one step under
torch.profiler: matmul, sparse attention, selection, qk-norm + RoPE, Inductor's fused kernels, ...) and the ops with
the most self CUDA time; with ``--compile``, also Inductor's kernels ranked by the time they lose against a
bandwidth floor (Inductor's own byte estimate per kernel, moved at 4 TB/s; pixdit.report.bandwidth_table). The
tables also go into the JSON record (``profile``).

Speed-up: tokens/s of this row / tokens/s of the first ``full`` variant of ``--attention`` for the same model, size
and grad checkpointing ("-" when full was not measured). MFU: model FLOPs per step / step time / --peak-tflops (989 =
H100/H200 dense bf16). Model FLOPs, without the recomputation of grad checkpointing: 6 x the parameters that act on
every token x tokens (forward 2 + backward 4 per parameter and token), plus per block 3 x the attention forward
4 x tokens x keys per query x hidden, with the keys each query of the block's backend really attends to
(``AttentionBackend.tokens_per_query``: N for full attention, ~300-500 for LLSA). The adaLN modulation and the
timestep / class embedders run once per image, not per token, and are left out (a third of a DiT block's parameters;
counting them per token would inflate MFU by ~1.5x).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

if any(arg.startswith("--kernels-from") for arg in sys.argv):  # swap the kernel library before pixdit imports it
    from kernel_ab import apply_from_argv

    apply_from_argv(sys.argv)

from pixdit.attention.variants import (  # noqa: E402
    Variant,
    add_block_means_option,
    block_means_settings,
    parse_variant,
    read_options,
)
from pixdit.errors import PixditError  # noqa: E402
from pixdit.files import atomic_write, write_json  # noqa: E402
from pixdit.models import DIT_MODELS  # noqa: E402
from pixdit.models.checkpointing import grad_checkpointing_plan  # noqa: E402
from pixdit.models.dit import Attention  # noqa: E402
from pixdit.report import (  # noqa: E402
    bandwidth_report,
    enable_inductor_kernel_bytes,
    kernel_table,
    markdown_table,
    time_median,
)
from pixdit.runtime import set_compile_memory_budget  # noqa: E402

QUICK_MODEL = dict(hidden_size=64, depth=2, num_heads=2)  # --quick: a model small enough for a CPU check
# The model's conditioning modules: they run once per image, not per token (not in the per-token FLOP count).
PER_IMAGE_MODULES = ("adaLN_modulation", "t_embedders", "y_embedders")
GB = 1e9  # peak and estimated memory in the table: GB as torch.cuda.max_memory_allocated / 1e9


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument(
        "--models",
        "--model",
        nargs="+",
        default=["DiT-S"],
        metavar="MODEL",
        help=f"models: NAME or NAME:KEY=VALUE,... (DiT arguments, e.g. DiT-XL:num_heads=18); "
        f"names: {', '.join(DIT_MODELS)}",
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        default=["full"],
        metavar="VARIANT",
        help="attention variants: NAME or NAME:KEY=VALUE,KEY=VALUE (configs/attention/NAME.yaml)",
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=None, help="image sides in pixels (default 64 128 256; --quick: 16 32)"
    )
    parser.add_argument("--tokens-per-step", type=int, default=262_144, help="pixel tokens per step (sets the batch)")
    parser.add_argument("--patch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--steps-at",
        nargs="*",
        default=[],
        metavar="SIDE:WARMUP:STEPS",
        help="other warm-up / timed step counts at one image side, e.g. 512:1:3",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (as compile=true)")
    parser.add_argument(
        "--compile-mode",
        default=None,
        choices=["default", "max-autotune-no-cudagraphs", "max-autotune", "reduce-overhead"],
        help="torch.compile mode, with --compile (default: train.py's, the default mode). An experiment: "
        "max-autotune lets Inductor fuse elementwise epilogues into its own Triton matmuls",
    )
    parser.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        metavar="FRACTION",
        help="with --compile: torch's activation memory budget for the compiled step (torch._functorch.config."
        "activation_memory_budget, in (0, 1]; 1 = torch's default): below 1 the backward recomputes more of the "
        "forward to keep fewer activations. An experiment: peak GB against ms/step",
    )
    parser.add_argument(
        "--grad-checkpointing",
        nargs="*",
        default=None,
        metavar="SETTING",
        help="model.grad_checkpointing values, one row each: false, true, N (first N blocks), mlp, "
        "attention (the flag alone = true)",
    )
    parser.add_argument("--profile", action="store_true", help="after timing, profile one step and print the top ops")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    parser.add_argument("--out", default=None, help="directory for bench_train.md / .json / .png")
    add_block_means_option(parser)
    parser.add_argument(
        "--kernels-from",
        default=None,
        metavar="DIR",
        help="time the kernel library in DIR (another commit's kernels/) instead of the installed one",
    )
    parser.add_argument(
        "--plot-from",
        nargs="+",
        default=None,
        metavar="JSON",
        help="bench_train.json of earlier runs: only redraw the PNG of their rows together (into --out, else next to "
        "the first)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, sizes and step counts (CPU check)")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------- variants
@dataclass
class ModelSpec:
    label: str  # as typed, e.g. "DiT-XL:num_heads=18"
    config: dict  # the model config section: {"name": ..., overrides...}


def parse_model(spec: str) -> ModelSpec:
    name, options = read_options(spec, "--models", "DiT-XL:num_heads=18")
    if name not in DIT_MODELS:
        raise PixditError(f"--models {spec}: unknown model {name!r}; available: {', '.join(DIT_MODELS)}")
    return ModelSpec(spec, {"name": name, **options})


def grad_checkpointing_settings(values: list[str] | None) -> list:
    """--grad-checkpointing's words as model.grad_checkpointing values (absent: [False]; the bare flag: [True])."""
    if values is None:
        return [False]
    return [yaml.safe_load(value) for value in values] or [True]


def parse_steps_at(items: list[str]) -> dict[int, tuple[int, int]]:
    steps_at = {}
    for item in items:
        try:
            side, warmup, steps = (int(x) for x in item.split(":"))
        except ValueError:
            raise PixditError(f"--steps-at {item!r} must be SIDE:WARMUP:STEPS, e.g. 512:1:3") from None
        if warmup < 0 or steps < 1:
            raise PixditError(
                f"--steps-at {item!r}: WARMUP must be >= 0 and STEPS >= 1 (leave the size out of --sizes to skip it)"
            )
        steps_at[side] = (warmup, steps)
    return steps_at


# ---------------------------------------------------------------------------------------------------------- measuring
def training_flops_per_image(model, tokens: int) -> float:
    """Model FLOPs of one training step per image, without recomputation (see the module docstring): 6 x per-token
    parameters x tokens + per block 3 x 4 x tokens x keys per query x hidden."""
    per_image = {
        id(p)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in PER_IMAGE_MODULES
        for p in module.parameters()
    }
    per_token = sum(p.numel() for p in model.parameters() if id(p) not in per_image)
    attention = sum(
        3 * 4 * tokens * block.attn.backend.tokens_per_query(tokens) * block.attn.backend.dim for block in model.blocks
    )
    return 6.0 * per_token * tokens + attention


def module_config(args, model: ModelSpec, variant: Variant, grad_checkpointing) -> dict:
    return {
        "model": {
            **model.config,
            "patch_size": args.patch_size,
            "grad_checkpointing": grad_checkpointing,
            "token_order": variant.token_order,
            **(QUICK_MODEL if args.quick else {}),
        },
        "attention": variant.attention,
    }


def memory_estimate(args, side: int, batch: int, config: dict):
    """pixdit.memory's estimate of this row's training step (the module built on the meta device: no memory)."""
    from pixdit.memory import estimate_training_memory
    from pixdit.module import DiffusionModule

    with torch.device("meta"):
        model = DiffusionModule.from_config(config, side).model
    precision = "bf16-mixed" if args.device.startswith("cuda") else "32-true"
    return estimate_training_memory(model, batch, precision)


def measure(args, side: int, batch: int, config: dict, label: str, warmup: int, steps: int) -> dict:
    """Time the training step of one row; PixditError if the model or variant cannot handle this size."""
    from torch.profiler import record_function

    from pixdit.module import DiffusionModule

    device = torch.device(args.device)
    if args.compile:
        torch._dynamo.reset()  # a fresh model per run: stale graphs would count against dynamo's recompile limit
    module = DiffusionModule.from_config(config, side, compile=args.compile and not args.compile_mode).to(device)
    if args.compile and args.compile_mode:
        module.model.compile(mode=args.compile_mode)  # in place, as DiffusionModule does with the default mode
    model, flow, ema = module.model, module.flow, module.ema
    optimizer = module.configure_optimizers()["optimizer"]
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    images = torch.rand(batch, 3, side, side, device=device) * 2 - 1

    state = {}

    def forward_loss():
        with autocast:
            state["loss"] = flow.loss(model, images)

    def optimizer_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    phases = (
        ("forward+loss", forward_loss),
        ("backward", lambda: state.pop("loss").backward()),
        ("clip", lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)),
        ("optimizer", optimizer_step),
        ("ema", lambda: ema.update(model)),
    )

    def train_step():
        for name, phase in phases:
            with record_function(f"step/{name}"):  # costs nothing unless a profiler runs
                phase()

    step_s, peak_gb = time_median(train_step, warmup, steps, device)  # peak_gb: nan on CPU
    profile = None
    if args.profile:
        title = f"{label} at {side}x{side}, batch {batch}"
        profile = print_profile(train_step, phase_times(phases, device), device, title, args.inductor_dir)
    flops = batch * training_flops_per_image(model, module.tokens_per_image)
    return {
        "ms_per_step": 1000 * step_s,
        "images_per_s": batch / step_s,
        "tokens_per_s": batch * side * side / step_s,
        "peak_gb": peak_gb if device.type == "cuda" else None,
        "mfu_percent": 100 * flops / step_s / (args.peak_tflops * 1e12),
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        **({"profile": profile} if profile else {}),
    }


PHASE_STEPS = 3  # steps whose per-phase times give the --profile phase table's medians


def phase_times(phases, device: torch.device, steps: int = PHASE_STEPS) -> list[dict]:
    """Milliseconds of each phase of the step (median of ``steps`` steps): CUDA events between the phases, so the
    GPU time of the backward pass counts too (the profiler's ranges miss it: autograd runs it on its own thread)."""
    import statistics
    import time

    cuda = device.type == "cuda"
    samples = {name: [] for name, _ in phases}
    for _ in range(steps):
        if cuda:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(phases) + 1)]
            marks[0].record()
            for (_, phase), mark in zip(phases, marks[1:]):
                phase()
                mark.record()
            torch.cuda.synchronize(device)
            for (name, _), start, end in zip(phases, marks, marks[1:]):
                samples[name].append(start.elapsed_time(end))
        else:
            for name, phase in phases:
                start = time.perf_counter()
                phase()
                samples[name].append(1000 * (time.perf_counter() - start))
    times = {name: statistics.median(values) for name, values in samples.items()}
    total = sum(times.values())
    return [{"phase": name, "ms": ms, "share %": 100 * ms / total} for name, ms in times.items()]


def print_profile(
    train_step, phases: list[dict], device: torch.device, title: str, inductor_dir=None, row_limit: int = 25
) -> dict:
    """Where the step's time goes: ``phases`` (phase_times: forward, backward, clip, optimizer, EMA), then one more
    step under torch.profiler grouped by kind of kernel (device time; CPU time on CPU), then the ops with the most
    self time; with ``inductor_dir`` (``enable_inductor_kernel_bytes``), Inductor's kernels against the bandwidth
    floor. Returns the tables for the JSON record."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        train_step()
        if cuda:
            torch.cuda.synchronize(device)
    categories = kernel_table(prof, cuda)
    unit = "device" if cuda else "CPU"
    print(f"\n## profile: one training step of {title}")
    print(f"\n{unit} time by phase (median of {PHASE_STEPS} steps, {'CUDA events' if cuda else 'wall clock'}):\n")
    print(markdown_table(phases, ["phase", "ms", "share %"], cell=format_cell))
    print(f"\n{unit} time by kind of kernel:\n")
    print(markdown_table(categories, ["part", "ms", "share %"], cell=format_cell))
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"\ntop {row_limit} ops by {sort_by}:")
    print(
        prof.key_averages(group_by_input_shape=False).table(
            sort_by=sort_by, row_limit=row_limit, max_name_column_width=60
        ),
        flush=True,
    )
    record = {"phases": phases, "kernels": categories}
    rows, text = bandwidth_report(prof, inductor_dir if cuda else None, row_limit)
    if rows:
        print(f"\n{text}", flush=True)
        record["inductor"] = rows
    return record


def release_memory(device: torch.device) -> None:
    gc.collect()  # the model of a run that raised is only reachable through reference cycles of the traceback
    if device.type == "cuda":
        torch.cuda.empty_cache()


def first_batch(args, side: int, requested: int, config: dict) -> tuple[int, str, dict, int]:
    """The batch to try first: the requested one, or the largest that the estimate says fits the free memory (the
    high bound for eager runs, halfway between the bounds with --compile, where compiled runs peak at or below); with
    a note saying so, the estimate's columns, and the batch to try after an out-of-memory error (the largest that fits
    by the high bound; 0 = unknown: halve instead)."""
    from pixdit.memory import free_memory, largest_batch

    try:
        estimate = memory_estimate(args, side, requested, config)
    except PixditError:
        return requested, "", {}, 0  # measure() reports the reason
    digits = 1 if estimate.high >= GB else 3
    columns = {"est_gb": f"{estimate.low / GB:.{digits}f}-{estimate.high / GB:.{digits}f}"}
    free = free_memory(torch.device(args.device))
    if free is None:
        return requested, "", columns, 0
    safe = largest_batch(estimate, free, "high")
    fits = largest_batch(estimate, free, "mid" if args.compile else "high")
    if fits >= requested:
        return requested, "", columns, safe
    note = (
        f"{requested * side * side:,} tokens/step do not fit: estimated {columns['est_gb']} GB, {free / GB:.1f} GB free"
    )
    return max(1, fits), note, columns, safe


def run_row(args, model: ModelSpec, side: int, grad_checkpointing, variant: Variant, warmup: int, steps: int) -> dict:
    """One row: a number, or a one-line reason (skipped: the model's own; OOM: even batch 1 runs out of memory)."""
    device = torch.device(args.device)
    config = module_config(args, model, variant, grad_checkpointing)
    requested = max(1, args.tokens_per_step // (side * side))
    row = {
        "model": model.label + (" (quick)" if args.quick else ""),
        "grad_ckpt": str(grad_checkpointing).lower(),
        "side": side,
        "tokens_per_image": (side // args.patch_size) ** 2,
        "variant": variant.label,
        "warmup": warmup,
        "steps": steps,
        "status": "ok",
        "note": "",
        "requested_batch": requested,
    }
    batch, note, columns, after_oom = first_batch(args, side, requested, config)
    row.update(columns)
    notes = [note] if note else []
    while True:
        out_of_memory = False
        try:
            row.update(measure(args, side, batch, config, f"{model.label} {variant.label}", warmup, steps))
        except PixditError as error:
            row.update(status="skipped", note=" ".join(str(error).split()))
        except torch.OutOfMemoryError:
            out_of_memory = True
        release_memory(device)  # outside the except blocks, once the traceback (and the model it holds) is gone
        if not out_of_memory:
            break
        notes.append(f"OOM at batch {batch}")
        if batch == 1:
            row.update(status="OOM", note="CUDA out of memory at batch 1" + "".join(f"; {n}" for n in notes[:-1]))
            break
        # the high estimate's batch once (each try compiles anew, and halving can fall far below what fits), then halve
        batch = after_oom if 0 < after_oom < batch else batch // 2
        after_oom = 0
    row.update(batch=batch, tokens_per_step=batch * side * side)
    if row["status"] == "ok" and batch < requested:
        row["note"] = f"largest batch that fits: {batch} of {requested} ({'; '.join(notes)})"
    return row


def run(args, models: list[ModelSpec], variants: list[Variant], settings: list, on_row=None) -> list[dict]:
    steps_at = parse_steps_at(args.steps_at)
    rows = []
    for model in models:
        for side in args.sizes:
            warmup, steps = steps_at.get(side, (args.warmup, args.steps))
            for grad_checkpointing in settings:
                for variant, means in [(v, m) for v in variants for m in block_means_settings(args.means, v)]:
                    Attention.fuse_block_means = means == "prologue"  # a class switch, read at trace time
                    try:
                        rows.append(run_row(args, model, side, grad_checkpointing, variant, warmup, steps))
                    finally:
                        Attention.fuse_block_means = True
                    if means == "backend" and variant.block_means:
                        rows[-1]["variant"] += " (means in backend)"
                    add_speedups(rows, variants)
                    print(progress_line(rows[-1]), file=sys.stderr, flush=True)
                    if on_row is not None:
                        on_row(rows)
    return rows


def add_speedups(rows: list[dict], variants: list[Variant]) -> None:
    """speedup = tokens/s of the row / tokens/s of the first full-attention variant of the same model, size and grad
    checkpointing (the same ratio as ms/step when both ran the same batch)."""
    baseline = next((v.label for v in variants if v.attention["name"] == "full"), None)
    full = {
        (r["model"], r["side"], r["grad_ckpt"]): r["tokens_per_s"]
        for r in rows
        if r["variant"] == baseline and r["status"] == "ok"
    }
    for row in rows:
        key = (row["model"], row["side"], row["grad_ckpt"])
        if row["status"] == "ok" and key in full:
            row["speedup"] = row["tokens_per_s"] / full[key]


def progress_line(row: dict) -> str:
    what = f"{row['model']} {row['side']}x{row['side']} grad_ckpt={row['grad_ckpt']} {row['variant']}"
    if row["status"] != "ok":
        return f"{what}: {row['status']} ({row['note']})"
    peak = "" if row["peak_gb"] is None else f", peak {row['peak_gb']:.2f} GB (estimated {row.get('est_gb', '-')})"
    return (
        f"{what}: batch {row['batch']}, {row['ms_per_step']:.1f} ms/step, {row['tokens_per_s'] / 1e3:.1f}k "
        f"tokens/s{peak}, MFU {row['mfu_percent']:.1f}%"
    )


# ---------------------------------------------------------------------------------------------------------- reporting
# table header -> JSON row key
COLUMNS = {
    "model": "model",
    "params M": "params_m",
    "grad ckpt": "grad_ckpt",
    "size": "side",
    "tokens/img": "tokens_per_image",
    "tokens/step": "tokens_per_step",
    "batch": "batch",
    "variant": "variant",
    "images/s": "images_per_s",
    "tokens/s": "tokens_per_s",
    "ms/step": "ms_per_step",
    "peak GB": "peak_gb",
    "est. GB": "est_gb",
    "MFU %": "mfu_percent",
    "speed-up": "speedup",
    "note": "note",
}


def format_cell(column: str, value) -> str:
    if column == "note":
        return str(value).replace("|", "\\|")  # a '|' would end the markdown cell
    if value is None:
        return "-"
    if column == "size":
        return f"{value}x{value}"
    if column == "tokens/s":
        return f"{value / 1e3:,.1f}k"
    if column == "speed-up":
        return f"{value:.2f}x"
    if column == "params M":
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}" if column.startswith("tokens") else str(value)
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict]) -> str:
    def note(row):
        return row["note"] if row["status"] == "ok" else f"{row['status']}: {row['note']}"

    table_rows = [
        {header: (note(row) if key == "note" else row.get(key)) for header, key in COLUMNS.items()} for row in rows
    ]
    return markdown_table(table_rows, list(COLUMNS), cell=format_cell)


def settings_line(args, models: list[ModelSpec], settings: list) -> str:
    cuda = args.device.startswith("cuda")
    device = torch.cuda.get_device_name(args.device) if cuda else "CPU"
    precision = "bf16 autocast" if cuda else "float32 (autocast is off on CPU)"
    names = ", ".join(m.label for m in models)
    model = f"{names} (--quick: {QUICK_MODEL})" if args.quick else names
    steps = f"median of {args.steps} steps after {args.warmup} warm-up"
    steps += "".join(f"; at {side}^2: {n} after {w}" for side, (w, n) in parse_steps_at(args.steps_at).items())
    grad_ckpt = ", ".join(str(s).lower() for s in settings)
    compiled = f"{args.compile} ({args.compile_mode})" if args.compile and args.compile_mode else str(args.compile)
    if args.memory_budget is not None:
        compiled += f", activation memory budget {args.memory_budget:g}"
    return (
        f"{model}, patch {args.patch_size}, {args.tokens_per_step:,} pixel tokens per step where they fit, "
        f"{precision}, AdamW + clip + EMA, compile={compiled}, grad_checkpointing={grad_ckpt}, {device}, "
        f"torch {torch.__version__}; {steps}; MFU against {args.peak_tflops:g} TFLOP/s"
    )


def plot(rows: list[dict], path: Path) -> None:
    """The PNG of a run's measured rows: the model-size figure when they hold several models, else the token-count
    figure."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(f"matplotlib is missing: no {path.name} (redraw elsewhere with --plot-from bench_train.json)")
        return
    ok = [r for r in rows if r["status"] == "ok"]
    if len({r.get("params_m") for r in ok}) > 1:  # several model sizes: the model-size figure instead
        fig = plot_model_sizes(plt, ok)
    else:
        fig = plot_token_counts(plt, matplotlib.ticker, ok)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def plot_token_counts(plt, ticker, ok: list[dict]):
    """One model: speed-up over full attention (the LLSA paper's Fig. 3) and tokens/s, against tokens per image."""

    def line(row):  # one line per variant, or per (model, grad checkpointing, variant) when those vary
        model = f"{row.get('model', '')} " if len({r.get("model") for r in ok}) > 1 else ""
        ckpt = f"ckpt={row.get('grad_ckpt')} " if len({r.get("grad_ckpt") for r in ok}) > 1 else ""
        return f"{model}{ckpt}{row['variant']}"

    fig, (ax_speedup, ax_tokens) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, label in enumerate(dict.fromkeys(line(r) for r in ok)):
        style = dict(marker="o", label=label, color=f"C{index % 10}")  # one colour per line in both panels
        mine = sorted((r for r in ok if line(r) == label), key=lambda r: r["tokens_per_image"])
        with_speedup = [r for r in mine if r.get("speedup") is not None]
        if with_speedup:
            ax_speedup.plot(
                [r["tokens_per_image"] for r in with_speedup], [r["speedup"] for r in with_speedup], **style
            )
        ax_tokens.plot([r["tokens_per_image"] for r in mine], [r["tokens_per_s"] for r in mine], **style)
    ticks = {r["tokens_per_image"]: f"{r['tokens_per_image']:,}\n({r['side']}²)" for r in ok}
    ax_speedup.set_ylabel("training speed-up over full attention")
    ax_speedup.set_title("speed-up (same tokens per step)")
    ax_tokens.set_yscale("log")
    ax_tokens.set_ylabel("pixel tokens / s")
    ax_tokens.set_title("training throughput")
    for ax in (ax_speedup, ax_tokens):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ticks), list(ticks.values()))
        ax.xaxis.set_minor_locator(ticker.NullLocator())  # only the measured token counts
        ax.set_xlabel("tokens per image")
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if not ax_speedup.lines:
        ax_speedup.text(0.5, 0.5, "no full-attention baseline in this run", ha="center", transform=ax_speedup.transAxes)
    return fig


def plot_model_sizes(plt, ok: list[dict]):
    """Several models: tokens/s and MFU against parameters, one line per (size, grad checkpointing, variant); a
    point whose batch is smaller than requested is hollow (the largest batch that fit)."""

    def line(row):
        ckpt = f" ckpt={row.get('grad_ckpt')}" if len({r.get("grad_ckpt") for r in ok}) > 1 else ""
        return f"{row['side']}² {row['variant']}{ckpt}"

    fig, (ax_tokens, ax_mfu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, label in enumerate(dict.fromkeys(line(r) for r in sorted(ok, key=lambda r: r["side"]))):
        mine = sorted((r for r in ok if line(r) == label), key=lambda r: r["params_m"])
        params = [r["params_m"] for r in mine]
        for ax, key in ((ax_tokens, "tokens_per_s"), (ax_mfu, "mfu_percent")):
            ax.plot(params, [r[key] for r in mine], color=f"C{index % 10}", label=label)
            for row in mine:
                full = row["batch"] >= row.get("requested_batch", row["batch"])
                ax.plot(row["params_m"], row[key], "o", color=f"C{index % 10}", mfc=None if full else "white")
    names = {r["params_m"]: r["model"].split(":")[0] for r in ok}
    ax_tokens.set_yscale("log")
    ax_tokens.set_ylabel("pixel tokens / s")
    ax_tokens.set_title("training throughput")
    ax_mfu.set_ylabel("MFU % (no recomputation counted)")
    ax_mfu.set_title("model FLOPs utilisation (hollow: smaller batch than asked)")
    for ax in (ax_tokens, ax_mfu):
        ax.set_xscale("log")
        ax.set_xticks(list(names), [f"{name}\n{p:.0f}M" for p, name in names.items()])
        ax.minorticks_off()
        ax.set_xlabel("model (parameters)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def write_tables(out: Path, command: str, settings: str, variants: list[Variant], rows: list[dict]) -> None:
    """bench_train.md and bench_train.json (rewritten after every row: a run cut short keeps what it measured)."""
    out.mkdir(parents=True, exist_ok=True)
    configs = "\n".join(f"- `{v.label}`: {json.dumps(v.attention)}" for v in variants)
    # Atomic writes: a run stopped by a time limit leaves the previous complete table, never half of one.
    with atomic_write(out / "bench_train.md", "w") as f:
        f.write(f"```\n{command}\n```\n\n{settings}\n\n{markdown(rows)}\n\nAttention configs:\n\n{configs}\n")
    write_json(
        out / "bench_train.json",
        {
            "command": command,
            "settings": settings,
            "torch": torch.__version__,
            "variants": {v.label: v.attention for v in variants},
            "rows": rows,
        },
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        sources = [Path(name) for name in args.plot_from]
        rows = [row for source in sources for row in json.loads(source.read_text())["rows"]]
        plot(rows, Path(args.out or sources[0].parent) / "bench_train.png")
        return
    if args.quick:
        args.tokens_per_step, args.warmup, args.steps = 2048, 1, 3
    args.sizes = args.sizes or ([16, 32] if args.quick else [64, 128, 256])
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no CUDA device is visible; use --device cpu --quick to check the script")
    try:
        models = [parse_model(spec) for spec in args.models]
        variants = [parse_variant(spec) for spec in args.attention]
        settings = grad_checkpointing_settings(args.grad_checkpointing)
        for model in models:  # every setting must suit every model (a number of blocks up to its depth)
            depth = {**DIT_MODELS[model.config["name"]], **model.config, **(QUICK_MODEL if args.quick else {})}["depth"]
            for setting in settings:
                grad_checkpointing_plan(setting, depth)
        parse_steps_at(args.steps_at)
        if args.warmup < 0 or args.steps < 1:
            raise PixditError(f"--warmup must be >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
        if args.memory_budget is not None:  # read by AOTAutograd's partitioner when the step is compiled
            if not args.compile:
                raise PixditError(
                    "--memory-budget applies to the compiled step: add --compile (or drop --memory-budget)"
                )
            set_compile_memory_budget(args.memory_budget, "--memory-budget")
    except PixditError as error:
        sys.exit(f"error: {error}")
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py
    torch.backends.cudnn.allow_tf32 = True
    # the profile's bandwidth table of Inductor's kernels reads their byte estimates from the output code there
    args.inductor_dir = enable_inductor_kernel_bytes() if args.profile and args.compile else None
    command = "python scripts/bench_train.py " + " ".join(sys.argv[1:] if argv is None else argv)
    settings_text = settings_line(args, models, settings)
    out = Path(args.out) if args.out else None
    rows = run(
        args,
        models,
        variants,
        settings,
        on_row=(lambda rows: write_tables(out, command, settings_text, variants, rows)) if out else None,
    )
    print(f"\n{settings_text}\n\n{markdown(rows)}\n\ncommand: {command}")
    if out:
        print(f"wrote {out / 'bench_train.md'} and {out / 'bench_train.json'}")
        plot(rows, out / "bench_train.png")


if __name__ == "__main__":
    main()

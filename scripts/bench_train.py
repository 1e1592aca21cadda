"""Training throughput of the pixel DiT for several models, attention variants, image sizes and grad-checkpointing
settings, measured in one process.

Per (model, size, grad checkpointing, variant): images/s, pixel tokens/s, ms/step, peak GPU memory next to the
estimate of pixdit.memory, MFU and the speed-up over full attention, as a markdown table (stdout), and with --out DIR
as bench_train.md, bench_train.json (both rewritten after every row, so a run cut short keeps its rows) and
bench_train.png (the LLSA paper's Fig. 3: speed-up over full attention vs tokens; and tokens/s vs tokens).

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
    python scripts/bench_train.py --plot-from bench/train/bench_train.json      # redraw the PNG only (no GPU needed)
    python scripts/bench_train.py --device cpu --quick --attention full llsa --out /tmp/bench   # CPU check

Variants (``--attention``): ``NAME`` trains with configs/attention/NAME.yaml, as ``train.py attention=NAME`` does;
``NAME:KEY=VALUE,KEY=VALUE`` overrides keys of that file (values are read as YAML: 2, 0.5, [8,4], null, true). Every
variant is built once by ``pixdit.attention.build_attention`` before anything is timed, so an unknown key stops the run
at once with an error naming the variant and the allowed keys. Backends that need Z-order tokens (llsa, vsa, sla) get
``model.token_order=zorder``. ``--grad-checkpointing`` takes the values of ``model.grad_checkpointing`` (false, true,
a number of blocks, mlp, attention; no value = true), one row each.

Every cell is a number or a one-line reason. A variant that cannot run at a size (LLSA with L=3 needs a multiple of
16^3 tokens) is a "skipped" row with the model's reason. Batch: ``--tokens-per-step`` / pixels per image (262,144:
64 at 64^2, 16 at 128^2, 4 at 256^2, 1 at 512^2). Where that cannot fit, the row runs the largest batch that does and
says so in its note: first the estimate (pixdit.memory, against the free GPU memory: the high bound for eager runs,
the low one with --compile, which saves less) picks the batch, then each CUDA out-of-memory error halves it; at batch
1 the row is "OOM".

Each step is what DiffusionModule.training_step + the Trainer do per optimizer step: flow-matching loss under bf16
autocast, backward, gradient clipping at 1.0, AdamW step (fused on GPU), EMA update; on synthetic images (no data
loader: `scripts/bench_data.py` measures that side). Default: DiT-S, 5 warm-up steps, then the median of 20 steps
timed with CUDA events (``--steps-at SIDE:WARMUP:STEPS`` changes the counts at one size, e.g. 512:1:3 where full
attention takes ~10 s/step). ``--profile`` runs one more step per row under torch.profiler and prints the ops with
the most self CUDA time (the step's phases are marked "step/forward+loss", "step/backward", "step/clip",
"step/optimizer", "step/ema").

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

if any(arg.startswith("--kernels-from") for arg in sys.argv):   # swap the kernel library before pixdit imports it
    from kernel_ab import apply_from_argv
    apply_from_argv(sys.argv)

from pixdit.errors import PixditError  # noqa: E402
from pixdit.models import DIT_MODELS  # noqa: E402
from pixdit.report import markdown_table, time_median  # noqa: E402

ATTENTION_CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "attention"
QUICK_MODEL = dict(hidden_size=64, depth=2, num_heads=2)  # --quick: a model small enough for a CPU check


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="DiT-S", choices=list(DIT_MODELS))
    parser.add_argument("--attention", nargs="+", default=["full"], metavar="VARIANT",
                        help="attention variants: NAME or NAME:KEY=VALUE,KEY=VALUE (configs/attention/NAME.yaml)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256], help="image sides in pixels")
    parser.add_argument("--tokens-per-step", type=int, default=262_144, help="pixel tokens per step (sets the batch)")
    parser.add_argument("--patch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--steps-at", nargs="*", default=[], metavar="SIDE:WARMUP:STEPS",
                        help="other warm-up / timed step counts at one image side, e.g. 512:1:3")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (as compile=true)")
    parser.add_argument("--grad-checkpointing", action="store_true", help="recompute each block in the backward")
    parser.add_argument("--profile", action="store_true", help="after timing, profile one step and print the top ops")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    parser.add_argument("--out", default=None, help="directory for bench_train.md / .json / .png")
    parser.add_argument("--kernels-from", default=None, metavar="DIR",
                        help="time the kernel library in DIR (another commit's kernels/) instead of the installed one")
    parser.add_argument("--plot-from", default=None, metavar="JSON",
                        help="bench_train.json of an earlier run: only redraw its PNG (into --out, else next to it)")
    parser.add_argument("--quick", action="store_true", help="tiny model, sizes and step counts (CPU check)")
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------- variants
@dataclass
class Variant:
    label: str          # as typed on the command line, e.g. "llsa:num_levels=2"
    attention: dict     # the attention config section: {"name": ..., options...}
    token_order: str    # what the backend needs ("zorder" for the block-sparse methods), else "raster"


def split_options(text: str) -> list[str]:
    """'a=1,b=[8,4]' -> ['a=1', 'b=[8,4]']: commas inside brackets belong to a list value."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_variant(spec: str, model_name: str, quick: bool) -> Variant:
    """``NAME[:KEY=VALUE,...]`` -> Variant, checked by building the backend once (pixdit.attention.build_attention)."""
    from pixdit.attention import build_attention

    name, _, options = spec.partition(":")
    config_file = ATTENTION_CONFIGS / f"{name}.yaml"
    attention = yaml.safe_load(config_file.read_text()) if config_file.is_file() else {"name": name}
    for item in split_options(options):
        key, equals, value = item.partition("=")
        if not equals or not key.strip():
            raise PixditError(f"--attention {spec}: '{item}' is not KEY=VALUE (e.g. llsa:num_levels=2,topk=16)")
        attention[key.strip()] = yaml.safe_load(value)
    dims = QUICK_MODEL if quick else DIT_MODELS[model_name]
    try:
        backend = build_attention(attention, dim=dims["hidden_size"], num_heads=dims["num_heads"])
    except PixditError as error:
        raise PixditError(f"--attention {spec}: {error}") from None
    return Variant(spec, attention, backend.token_order or "raster")


def parse_steps_at(items: list[str]) -> dict[int, tuple[int, int]]:
    steps_at = {}
    for item in items:
        try:
            side, warmup, steps = (int(x) for x in item.split(":"))
        except ValueError:
            raise PixditError(f"--steps-at {item!r} must be SIDE:WARMUP:STEPS, e.g. 512:1:3") from None
        if warmup < 0 or steps < 1:
            raise PixditError(f"--steps-at {item!r}: WARMUP must be >= 0 and STEPS >= 1 (leave the size out of --sizes "
                              f"to skip it)")
        steps_at[side] = (warmup, steps)
    return steps_at


# ---------------------------------------------------------------------------------------------------------- measuring
def step_flops(batch: int, tokens: int, hidden: int, depth: int) -> float:
    forward = depth * (24 * tokens * hidden**2 + 4 * tokens**2 * hidden)
    return 3.0 * forward * batch


def measure(args, side: int, batch: int, variant: Variant, warmup: int, steps: int) -> dict:
    """Time the training step of one (size, variant); PixditError if the variant cannot handle this size."""
    from torch.profiler import record_function

    from pixdit.module import DiffusionModule

    device = torch.device(args.device)
    model_cfg = {"name": args.model, "patch_size": args.patch_size, "grad_checkpointing": args.grad_checkpointing,
                 "token_order": variant.token_order, **(QUICK_MODEL if args.quick else {})}
    if args.compile:
        torch._dynamo.reset()  # a fresh model per run: stale graphs would count against dynamo's recompile limit
    module = DiffusionModule.from_config({"model": model_cfg, "attention": variant.attention}, side,
                                         compile=args.compile).to(device)
    model, flow, ema = module.model, module.flow, module.ema
    optimizer = module.configure_optimizers()["optimizer"]
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    images = torch.rand(batch, 3, side, side, device=device) * 2 - 1

    def train_step():
        # The named ranges cost nothing unless a profiler runs; with --profile they split the step into its phases.
        with record_function("step/forward+loss"), autocast:
            loss = flow.loss(model, images)
        with record_function("step/backward"):
            loss.backward()
        with record_function("step/clip"):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        with record_function("step/optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with record_function("step/ema"):
            ema.update(model)

    step_s, peak_gb = time_median(train_step, warmup, steps, device)  # peak_gb: nan on CPU
    if args.profile:
        print_profile(train_step, device, f"{variant.label} at {side}x{side}, batch {batch}")
    hidden, depth = model.blocks[0].attn.qkv.in_features, len(model.blocks)
    tokens = module.tokens_per_image
    return {"ms_per_step": 1000 * step_s, "images_per_s": batch / step_s,
            "tokens_per_s": batch * side * side / step_s, "peak_gb": peak_gb if device.type == "cuda" else None,
            "mfu_percent": 100 * step_flops(batch, tokens, hidden, depth) / step_s / (args.peak_tflops * 1e12),
            "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def print_profile(train_step, device: torch.device, title: str, row_limit: int = 25) -> None:
    """One more step under torch.profiler: the ops with the most self device time (CPU time on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        train_step()
        if cuda:
            torch.cuda.synchronize(device)
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"\n## profile: one training step of {title} (top {row_limit} ops by {sort_by})")
    print(prof.key_averages(group_by_input_shape=False).table(sort_by=sort_by, row_limit=row_limit,
                                                                max_name_column_width=60), flush=True)


def free_memory(device: torch.device) -> None:
    gc.collect()  # the model of a run that raised is only reachable through reference cycles of the traceback
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args, variants: list[Variant]) -> list[dict]:
    device = torch.device(args.device)
    steps_at = parse_steps_at(args.steps_at)
    rows = []
    for side in args.sizes:
        warmup, steps = steps_at.get(side, (args.warmup, args.steps))
        batch = max(1, args.tokens_per_step // (side * side))
        tokens_per_image = (side // args.patch_size) ** 2
        for variant in variants:
            row = {"side": side, "tokens_per_image": tokens_per_image, "tokens_per_step": batch * side * side,
                   "batch": batch, "variant": variant.label, "warmup": warmup, "steps": steps, "status": "ok",
                   "note": ""}
            try:
                row.update(measure(args, side, batch, variant, warmup, steps))
            except PixditError as error:
                row.update(status="skipped", note=" ".join(str(error).split()))
            except torch.OutOfMemoryError:
                row.update(status="OOM", note="CUDA out of memory")
            free_memory(device)  # outside the except blocks, once the traceback (and the model it holds) is gone
            rows.append(row)
            print(progress_line(row), file=sys.stderr, flush=True)
    add_speedups(rows, variants)
    return rows


def add_speedups(rows: list[dict], variants: list[Variant]) -> None:
    """speedup = ms/step of the first full-attention variant at the same size / ms/step of the row."""
    baseline = next((v.label for v in variants if v.attention["name"] == "full"), None)
    full_ms = {r["side"]: r["ms_per_step"] for r in rows if r["variant"] == baseline and r["status"] == "ok"}
    for row in rows:
        if row["status"] == "ok" and row["side"] in full_ms:
            row["speedup"] = full_ms[row["side"]] / row["ms_per_step"]


def progress_line(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['side']}x{row['side']} {row['variant']}: {row['status']} ({row['note']})"
    peak = "" if row["peak_gb"] is None else f", peak {row['peak_gb']:.2f} GB"
    return (f"{row['side']}x{row['side']} {row['variant']}: {row['ms_per_step']:.1f} ms/step, "
            f"{row['tokens_per_s'] / 1e3:.1f}k tokens/s{peak}")


# ---------------------------------------------------------------------------------------------------------- reporting
# table header -> JSON row key
COLUMNS = {"size": "side", "tokens/img": "tokens_per_image", "tokens/step": "tokens_per_step", "batch": "batch",
           "variant": "variant", "images/s": "images_per_s", "tokens/s": "tokens_per_s", "ms/step": "ms_per_step",
           "peak GB": "peak_gb", "MFU %": "mfu_percent", "speed-up": "speedup", "note": "note"}


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
    if isinstance(value, int):
        return f"{value:,}" if column.startswith("tokens") else str(value)
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict]) -> str:
    def note(row):
        return row["note"] if row["status"] == "ok" else f"{row['status']}: {row['note']}"

    table_rows = [{header: (note(row) if key == "note" else row.get(key)) for header, key in COLUMNS.items()}
                  for row in rows]
    return markdown_table(table_rows, list(COLUMNS), cell=format_cell)


def settings_line(args) -> str:
    cuda = args.device.startswith("cuda")
    device = torch.cuda.get_device_name(args.device) if cuda else "CPU"
    precision = "bf16 autocast" if cuda else "float32 (autocast is off on CPU)"
    model = f"{args.model} (--quick: {QUICK_MODEL})" if args.quick else args.model
    steps = f"median of {args.steps} steps after {args.warmup} warm-up"
    steps += "".join(f"; at {side}^2: {n} after {w}" for side, (w, n) in parse_steps_at(args.steps_at).items())
    return (f"{model}, patch {args.patch_size}, {args.tokens_per_step:,} pixel tokens per step, {precision}, "
            f"AdamW + clip + EMA, compile={args.compile}, grad_checkpointing={args.grad_checkpointing}, {device}, "
            f"torch {torch.__version__}; {steps}")


def plot(rows: list[dict], path: Path) -> None:
    """Left: speed-up over full attention vs tokens per image (the LLSA paper's Fig. 3); right: tokens/s."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print(f"matplotlib is missing: no {path.name} (redraw elsewhere with --plot-from bench_train.json)")
        return
    ok = [r for r in rows if r["status"] == "ok"]
    fig, (ax_speedup, ax_tokens) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, label in enumerate(dict.fromkeys(r["variant"] for r in ok)):
        style = dict(marker="o", label=label, color=f"C{index % 10}")  # one colour per variant in both panels
        mine = sorted((r for r in ok if r["variant"] == label), key=lambda r: r["tokens_per_image"])
        with_speedup = [r for r in mine if r.get("speedup") is not None]
        if with_speedup:
            ax_speedup.plot([r["tokens_per_image"] for r in with_speedup], [r["speedup"] for r in with_speedup],
                            **style)
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
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # only the measured token counts
        ax.set_xlabel("tokens per image")
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if not ax_speedup.lines:
        ax_speedup.text(0.5, 0.5, "no full-attention baseline in this run", ha="center", transform=ax_speedup.transAxes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def write_outputs(out: Path, command: str, settings: str, variants: list[Variant], rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    configs = "\n".join(f"- `{v.label}`: {json.dumps(v.attention)}" for v in variants)
    (out / "bench_train.md").write_text(f"```\n{command}\n```\n\n{settings}\n\n{markdown(rows)}\n\n"
                                        f"Attention configs:\n\n{configs}\n")
    record = {"command": command, "settings": settings, "torch": torch.__version__,
              "variants": {v.label: v.attention for v in variants}, "rows": rows}
    (out / "bench_train.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'bench_train.md'} and {out / 'bench_train.json'}")
    plot(rows, out / "bench_train.png")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot_from:
        source = Path(args.plot_from)
        plot(json.loads(source.read_text())["rows"], Path(args.out or source.parent) / "bench_train.png")
        return
    if args.quick:
        args.sizes, args.tokens_per_step, args.warmup, args.steps = [16, 32], 2048, 1, 3
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no CUDA device is visible; use --device cpu --quick to check the script")
    try:
        variants = [parse_variant(spec, args.model, args.quick) for spec in args.attention]
        parse_steps_at(args.steps_at)
        if args.warmup < 0 or args.steps < 1:
            raise PixditError(f"--warmup must be >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
    except PixditError as error:
        sys.exit(f"error: {error}")
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py
    torch.backends.cudnn.allow_tf32 = True
    rows = run(args, variants)
    command = "python scripts/bench_train.py " + " ".join(sys.argv[1:] if argv is None else argv)
    settings = settings_line(args)
    print(f"\n{settings}\n\n{markdown(rows)}\n\ncommand: {command}")
    if args.out:
        write_outputs(Path(args.out), command, settings, variants, rows)


if __name__ == "__main__":
    main()

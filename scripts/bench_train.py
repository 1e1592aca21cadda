"""Training throughput of the pixel DiT: images/s, pixel tokens/s, peak GPU memory and MFU, as a markdown table.

Measures exactly what DiffusionModule.training_step + the Trainer do per optimizer step: flow-matching loss under bf16
autocast, backward, gradient clipping at 1.0, AdamW step (fused on GPU), EMA update; on synthetic images (no data
loader: `scripts/bench_data.py` measures that side). Default: DiT-S, attention=full, 262,144 pixel tokens per step
(batch 64 at 64^2, 16 at 128^2, 4 at 256^2), 5 warm-up steps, then the median of 20 steps timed with CUDA events.

    python scripts/bench_train.py                                   # H200: the table of docs/benchmarks.md
    python scripts/bench_train.py --attention llsa --sizes 128 256  # another backend (zorder is set for sparse ones)
    python scripts/bench_train.py --compile --grad-checkpointing
    python scripts/bench_train.py --device cpu --quick              # CPU smoke run of the script itself

MFU counts the matmul FLOPs of a dense transformer step (3 x forward; forward per image per block:
24 N d^2 for the projections and MLP + 4 N^2 d for full attention; sparse backends are still charged the dense
attention, so their "MFU" reads as a speed-up over dense) against --peak-tflops (989 = H100/H200 dense bf16).
"""

from __future__ import annotations

import argparse
import sys

import torch

from pixdit.models import DIT_MODELS
from pixdit.report import markdown_table, time_median


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="DiT-S", choices=list(DIT_MODELS))
    parser.add_argument("--attention", default="full", help="attention backend name (configs/attention/<name>.yaml)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256], help="image sides in pixels")
    parser.add_argument("--tokens-per-step", type=int, default=262_144, help="pixel tokens per step (sets the batch)")
    parser.add_argument("--patch-size", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (as compile=true)")
    parser.add_argument("--grad-checkpointing", action="store_true", help="recompute each block in the backward")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H100/H200: 989)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CPU check of the script)")
    return parser.parse_args(argv)


def step_flops(batch: int, tokens: int, hidden: int, depth: int) -> float:
    forward = depth * (24 * tokens * hidden**2 + 4 * tokens**2 * hidden)
    return 3.0 * forward * batch


def bench_size(args, side: int) -> dict:
    from pixdit.module import DiffusionModule

    device = torch.device(args.device)
    batch = max(1, args.tokens_per_step // (side * side))
    attention = {"name": args.attention}
    model_cfg = {"name": args.model, "patch_size": args.patch_size, "grad_checkpointing": args.grad_checkpointing,
                 "token_order": "raster" if args.attention == "full" else "zorder"}
    if args.quick:
        model_cfg.update(hidden_size=64, depth=2, num_heads=2)
    module = DiffusionModule(model=model_cfg, attention=attention, image_size=side, compile=args.compile).to(device)
    model, flow, ema = module.model, module.flow, module.ema
    optimizer = module.configure_optimizers()["optimizer"]
    params = [p for p in model.parameters() if p.requires_grad]
    cuda = device.type == "cuda"
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda)
    images = torch.rand(batch, 3, side, side, device=device) * 2 - 1

    def train_step():
        with autocast:
            loss = flow.loss(model, images)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.update(model)
        return loss

    step_s, peak_gb = time_median(train_step, args.warmup, args.steps, device)
    tokens = module.tokens_per_image
    hidden, depth = model.blocks[0].attn.qkv.in_features, len(model.blocks)
    flops = step_flops(batch, tokens, hidden, depth)
    result = {
        "size": f"{side}x{side}", "batch": batch, "tokens/img": tokens, "step ms": 1000 * step_s,
        "images/s": batch / step_s, "tokens/s": batch * side * side / step_s, "peak GB": peak_gb,
        "MFU %": 100 * flops / step_s / (args.peak_tflops * 1e12),
        "params M": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    del module, model, ema, optimizer, images
    if cuda:
        torch.cuda.empty_cache()
    return result


def format_cell(column: str, value) -> str:
    if column == "tokens/s":
        return f"{value / 1e3:,.1f}k"
    return f"{value:,.2f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict]) -> str:
    return markdown_table(rows, cell=format_cell)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.quick:
        args.sizes, args.tokens_per_step, args.warmup, args.steps = [16, 32], 2048, 1, 3
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no CUDA device is visible; use --device cpu --quick to check the script")
    torch.backends.cuda.matmul.allow_tf32 = True  # as train.py
    torch.backends.cudnn.allow_tf32 = True
    rows = []
    for side in args.sizes:
        try:
            rows.append(bench_size(args, side))
        except torch.OutOfMemoryError:
            rows.append({"size": f"{side}x{side}", "batch": "OOM"})
            torch.cuda.empty_cache()
        print(rows[-1], file=sys.stderr, flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"\n{args.model}, attention={args.attention}, patch {args.patch_size}, bf16 autocast, AdamW + clip + EMA, "
          f"compile={args.compile}, grad_checkpointing={args.grad_checkpointing}, {device}, torch {torch.__version__}; "
          f"median of {args.steps} steps after {args.warmup} warm-up\n")
    full_rows = [r for r in rows if "step ms" in r]
    print(markdown(full_rows) if full_rows else "all sizes ran out of memory")
    print(f"\ncommand: python scripts/bench_train.py {' '.join(sys.argv[1:] if argv is None else argv)}")


if __name__ == "__main__":
    main()

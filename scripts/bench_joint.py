"""The DiT block's two joints (gated residual + LayerNorm + adaLN modulation) compiled two ways, at a training step's
shape (default: DiT-S at 256², 4 x 65,536 tokens of 384): Inductor's backward of the block's plain ops against
``pixdit.kernels.adaln_joint``, whose Triton backward computes the per-sample shift / scale / gate gradients in the
LayerNorm's pass, recomputing the LayerNorm's row statistics or (``BACKWARD_FROM_STATS``) reading the forward's.
Then the Triton backward alone at every launch its autotuning may pick, with the bytes it must move and their rate:
the table that chooses the fixed launch and shows how far a launch is from the memory's pace.

    python scripts/bench_joint.py                         # DiT-S, 256², batch 4
    python scripts/bench_joint.py --dim 1152 --batch 2    # DiT-XL's width
    python scripts/bench_joint.py --per-kernel 8          # + each form's 8 largest kernels of one backward
    python scripts/bench_joint.py --quick --device cpu    # CPU check of the script (no launch table without a GPU)

The pair is timed as the block runs it: joint 1 (before the attention) gives h1; joint 2 adds gate1 x branch to the
residual (the branch is an input here, standing in for the attention's output) and gives x2 (the MLP's residual) and
h2; random upstream gradients reach h1, x2 and h2. "forward" is the compiled forward with autograd on, "backward"
the compiled backward of one forward (``autograd.grad`` with the graph retained), each a ``do_bench`` median. The last
column compares both forms' gradients: the largest difference relative to the largest value (fp32 sums in another
order: ~1e-3 in bf16 is rounding).
"""

from __future__ import annotations

import argparse

import torch
from kernel_ab import rel_diff, timer

from pixdit.kernels import adaln_joint as joint
from pixdit.kernels.common import INTERPRET
from pixdit.report import kernel_breakdown, markdown_table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", type=int, default=256, help="image side: side² tokens per sample (patch 1)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dim", type=int, default=384, help="the model's width (DiT-S 384, B 768, L 1024, XL 1152)")
    p.add_argument("--rep", type=int, default=200, help="milliseconds of timed calls per cell (do_bench)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="CPU check: 8², batch 2, width 48, launches of 2 stages")
    p.add_argument(
        "--per-kernel",
        type=int,
        default=0,
        metavar="N",
        help="GPU: also list each compiled form's N largest kernels of one backward (ms per call)",
    )
    args = p.parse_args(argv)
    if args.per_kernel and not args.device.startswith("cuda"):
        raise SystemExit(f"--per-kernel needs a CUDA device (the profiler's kernel times), got --device {args.device}")
    if args.quick:
        args.side, args.batch, args.dim, args.rep = 8, 2, 48, 1
    for name in ("side", "batch", "dim", "rep"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def plain_pair(x, branch, shift1, scale1, gate1, shift2, scale2):
    """The joints in the block's plain ops (what Inductor differentiates on main)."""
    _, h1 = joint.adaln_joint_forward(x, None, None, shift1, scale1, 1e-6)
    x2, h2 = joint.adaln_joint_forward(x, branch, gate1, shift2, scale2, 1e-5)
    return h1, x2, h2


def fused_pair(x, branch, shift1, scale1, gate1, shift2, scale2):
    """The joints as the compiled block runs them with adaln_joint."""
    x1, h1 = joint.adaln_joint(x, None, None, shift1, scale1, 1e-6)
    x2, h2 = joint.adaln_joint(x1, branch, gate1, shift2, scale2, 1e-5)
    return h1, x2, h2


def make_inputs(args, dtype):
    g = torch.Generator(device=args.device).manual_seed(0)
    shape = (args.batch, args.side**2, args.dim)

    def t(*size, s=1.0):
        return (torch.randn(*size, generator=g, device=args.device) * s).to(dtype).requires_grad_()

    leaves = [t(*shape), t(*shape)] + [t(args.batch, args.dim, s=0.3) for _ in range(5)]
    ups = [torch.randn(*shape, generator=g, device=args.device).to(dtype) for _ in range(3)]
    return leaves, ups


def pair_rows(args, dtype, time_ms) -> tuple[list[dict], dict[str, dict[str, float]]]:
    """One row per compiled form: forward and backward time, on a GPU also the backward's kernel time (the summed
    durations of its kernels, which run on one stream: the device's busy time; where it is well below the backward's
    time, the host's work around the launches is what the backward waits for), and the gradients' difference to the
    plain ops'; and each form's kernels of one backward (GPU: {form: {kernel: ms}})."""
    leaves, ups = make_inputs(args, dtype)
    results, rows, kernels = {}, [], {}
    forms = (
        ("Inductor (plain ops)", plain_pair, False),
        ("adaln_joint", fused_pair, False),
        ("adaln_joint, backward from the forward's statistics", fused_pair, True),  # BACKWARD_FROM_STATS
    )
    for name, fn, from_stats in forms:
        joint.BACKWARD_FROM_STATS = from_stats  # read when the forward is traced: each form compiles its own
        try:
            compiled = torch.compile(fn, fullgraph=True)
            out = compiled(*leaves)
            results[name] = torch.autograd.grad(out, leaves, ups, retain_graph=True)
            forward = time_ms(lambda compiled=compiled: compiled(*leaves), args.rep)
        finally:
            joint.BACKWARD_FROM_STATS = False

        def backward_call(out=out):
            return torch.autograd.grad(out, leaves, ups, retain_graph=True)

        backward = time_ms(backward_call, args.rep)
        rows.append({"form": name, "forward ms": f"{forward:.3f}", "backward ms": f"{backward:.3f}"})
        if args.device.startswith("cuda"):
            kernels[name] = kernel_breakdown(backward_call, calls=10)
            rows[-1]["backward kernel ms"] = f"{sum(kernels[name].values()):.3f}"
    base = results[forms[0][0]]
    rows[0]["max rel. diff of the gradients"] = "-"
    for row, (name, _, _) in zip(rows[1:], forms[1:]):
        row["max rel. diff of the gradients"] = f"{max(rel_diff(a, b) for a, b in zip(base, results[name])):.1e}"
        row["form"] += f" (backward {float(rows[0]['backward ms']) / float(row['backward ms']):.2f}x)"
    return rows, kernels


def launch_rows(args, dtype, time_ms) -> list[dict]:
    """The Triton backward alone per launch, both joints (with the residual's gradient, as in the block), recomputing
    the LayerNorm's statistics and reading the forward's (``BACKWARD_FROM_STATS``: 8 bytes more a row)."""
    (x, branch, _, scale, gate, _, _), (dh, dres, _) = make_inputs(args, dtype)
    x, branch, scale, gate = (t.detach() for t in (x, branch, scale, gate))
    fixed = joint.fixed_launch(args.dim)
    rows = []
    for with_branch in (False, True):
        tensors = 6 if with_branch else 4  # read dh, dres, x (+ branch); write dx (+ d branch)
        gb = tensors * x.numel() * x.element_size() / 1e9
        b_, g_ = (branch, gate) if with_branch else (None, None)
        _, _, mean, rstd = joint.adaln_joint_forward(x, b_, g_, scale, scale, 1e-5, with_stats=True)
        for launch in joint.backward_launches(args.dim):
            if args.quick and launch["NUM_STAGES"] != 2:  # the interpreter ignores stages
                continue
            row = {
                "joint": "after the attention" if with_branch else "before the attention",
                "rows/step": launch["BLOCK_ROWS"],
                "warps": launch["num_warps"],
                "stages": launch["NUM_STAGES"],
                "fixed launch": "yes" if launch == fixed else "",
            }
            for label, stats, extra in (
                ("", (None, None), 0),
                (" from stats", (mean, rstd), 8 * x.numel() // args.dim),
            ):
                ms = time_ms(
                    lambda launch=launch, s=stats: joint.joint_backward(dh, dres, x, b_, g_, scale, 1e-5, launch, *s),
                    args.rep,
                )
                moved = gb + extra / 1e9
                row |= {f"ms{label}": f"{ms:.3f}", f"GB{label}": f"{moved:.2f}", f"TB/s{label}": f"{moved / ms:.2f}"}
            rows.append(row)
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    time_ms = timer(args.device)
    tokens = args.batch * args.side**2
    print(f"# the joints of one DiT block: {args.batch} x {args.side}² tokens of {args.dim}, {dtype}\n", flush=True)
    rows, kernels = pair_rows(args, dtype, time_ms)
    print(markdown_table(rows), flush=True)
    for form, per_name in kernels.items() if args.per_kernel else ():
        top = sorted(per_name.items(), key=lambda item: -item[1])[: args.per_kernel]
        print(f"\n{form}: the {len(top)} largest kernels of one backward\n")
        print(markdown_table([{"kernel": name[:100], "ms": f"{ms:.3f}"} for name, ms in top]), flush=True)
    if args.device.startswith("cuda") or INTERPRET:
        print(f"\n# the Triton backward alone, per launch ({tokens:,} rows)\n")
        print(markdown_table(launch_rows(args, dtype, time_ms)))


if __name__ == "__main__":
    main()

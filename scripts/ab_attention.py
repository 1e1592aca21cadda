"""Interleaved A/B of the sparse attentions (LLSA, VSA, SLA): another commit's kernel library against the installed
one, in one process.

Separate benchmark processes with Triton autotuning differ by up to 20% on the H200 for the same kernels (the
timing-picked launch configuration and the card's state change between runs), more than a typical kernel change.
This script loads both libraries side by side (``kernel_ab.load_kernels_as``), alternates them for ``--rounds`` rounds
on the same inputs, and reports the median of the rounds' ``do_bench`` medians and their spread. Several
``--kernels-from`` folders (variants of one change) are each timed against the installed library in the same
process: one table row per case and folder (column "before"), and the device compiles the installed side once. Run
it with ``PIXDIT_KERNELS_AUTOTUNE=0`` so that both sides use one fixed launch configuration. ``--back-to-back N``
times an eager loop instead (N calls, one synchronisation at the end): wall and host milliseconds per call, where a
change to the launchers' host path shows (with autotuning on, the default, if the change is in that path).

    git archive HEAD~1 kernels | tar -x -C /tmp/base
    PIXDIT_KERNELS_AUTOTUNE=0 python scripts/ab_attention.py --kernels-from /tmp/base/kernels
    PIXDIT_KERNELS_AUTOTUNE=0 python scripts/ab_attention.py --kernels-from /tmp/base/kernels --cases vsa:256 sla:256
    PIXDIT_KERNELS_AUTOTUNE=0 python scripts/ab_attention.py --kernels-from /tmp/base/kernels --kernel-time  # GPU only
    python scripts/ab_attention.py --kernels-from /tmp/base/kernels --back-to-back 40  # eager loop, autotuned, host
    PIXDIT_KERNELS_AUTOTUNE=0 python scripts/ab_attention.py --kernels-from /tmp/v1/kernels /tmp/v2/kernels
    python scripts/ab_attention.py --kernels-from kernels --quick --device cpu   # CPU check of the script (PyTorch path)

Each call is timed as a model makes it: the output merged into ``[b, N, h * d]`` (the input of the output
projection) and its gradient handed back in that layout, so a library that writes its output tokens-major is
credited with the copies it saves, and one that does not pays them.

A case is ``METHOD:SIDE[:X[:B]]`` (tokens = SIDE², head_dim 64): ``llsa:256:2`` is LLSA with K = 8, L = 2 and blocks
of B = 16; ``llsa:256:2:32`` the same with B = 32; ``vsa:256`` / ``sla:256`` are VSA (gated) and SLA with 16-token tiles
and the K of ``bench_attention.py``'s VSA/SLA rows (``--baseline-topk``), ``vsa:256:64`` for K = 64; ``bsa:256:16`` is
``block_sparse_attention`` with K = 16 listed blocks of 128 tokens (``bsa:256:32:64``: K = 32 blocks of 64), on random
lists drawn as ``bench_attention.py`` draws them for its bsa and flex rows (the same lists for both libraries);
``flash:256`` is the dense ``flash_attention``.
``--per-kernel N`` (GPU) adds each case's N largest kernels of a forward + backward call, both versions side by side;
each Triton launch is its own row, named by its block constants and grid (``kernel_ab.launch_breakdown``), so the
fine and the pooled passes of one kernel are told apart.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from kernel_ab import back_to_back_ms, launch_breakdown, load_kernels_as, random_block_order, rel_diff, timer

import pixdit.kernels as current
from pixdit.report import kernel_ms, markdown_table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--kernels-from",
        required=True,
        nargs="+",
        metavar="DIR",
        help="the other commit's kernels/ folder; several (e.g. variants): each against the installed one, one process",
    )
    p.add_argument(
        "--cases",
        nargs="+",
        default=None,
        help="METHOD:SIDE[:X[:B]]: llsa:SIDE:LEVELS[:B], vsa:SIDE[:K[:B]], sla:SIDE[:K[:B]], bsa:SIDE:K[:B] (B "
        "default 128), flash:SIDE (default: llsa:128:2 llsa:256:2 llsa:256:3 llsa:512:2; with --quick: llsa:32:1 "
        "vsa:32:2)",
    )
    p.add_argument("--tokens-total", type=int, default=131072, help="batch = max(1, tokens_total // tokens)")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true", help="CPU check: 32^2 cases (unless given), 2 rounds, tiny heads")
    p.add_argument(
        "--per-kernel",
        type=int,
        default=0,
        metavar="N",
        help="GPU: also list each case's N largest kernels of a forward + backward call (ms per call, both versions; "
        "each Triton launch by its block constants and grid)",
    )
    p.add_argument(
        "--kernel-time",
        action="store_true",
        help="time the GPU kernels of each call (torch.profiler), without the host path (at 256^2 an eager sparse "
        "call is host-bound, so eager times mix the kernels with Python)",
    )
    p.add_argument(
        "--back-to-back",
        type=int,
        default=0,
        metavar="N",
        help="time N calls issued back to back with one synchronisation at the end, as a user's eager loop runs "
        "them: wall ms per call, and the host's ms per call to issue them (do_bench's cache flush between calls "
        "gives the host a head start)",
    )
    args = p.parse_args(argv)
    if args.cases is None:
        args.cases = (
            ["llsa:32:1", "vsa:32:2"] if args.quick else ["llsa:128:2", "llsa:256:2", "llsa:256:3", "llsa:512:2"]
        )
    args.cases = [parse_case(case) for case in args.cases]  # a bad case is named before anything runs
    if len(set(args.kernels_from)) < len(args.kernels_from):
        raise SystemExit(f"--kernels-from {' '.join(args.kernels_from)}: a folder is given twice; give each once")
    if args.back_to_back < 0 or (args.back_to_back and args.kernel_time):
        raise SystemExit(
            f"--back-to-back takes a number of calls (>= 1, 0 = off) and times the wall clock, not --kernel-time; got "
            f"--back-to-back {args.back_to_back}{' with --kernel-time' if args.kernel_time else ''}"
        )
    if args.per_kernel < 0:
        raise SystemExit(f"--per-kernel takes the number of kernels to list (>= 1, 0 = off), got {args.per_kernel}")
    for flag, on in (("--kernel-time", args.kernel_time), ("--per-kernel", args.per_kernel)):
        if on and not args.device.startswith("cuda"):
            raise SystemExit(f"{flag} times CUDA kernels, got --device {args.device}; drop {flag}")
    if args.quick:
        args.tokens_total, args.heads, args.head_dim, args.rounds = 1024, 1, 16, 2
    return args


DEFAULT_K = {64: 8, 128: 20, 256: 32, 512: 32}  # VSA / SLA top-K per image side, as bench_attention.py's rows
METHODS = ("llsa", "vsa", "sla", "bsa", "flash")


def parse_case(case: str) -> tuple[str, int, int, int]:
    """``METHOD:SIDE[:X[:B]]`` -> (method, side, X, B): X = levels for LLSA (required), top-K for VSA / SLA / bsa
    (required for bsa); B = the block size (16 unless given; 128 for bsa); flash takes neither."""
    parts = case.split(":")
    ok = len(parts) in (2, 3, 4) and parts[0] in METHODS and all(p.isdigit() for p in parts[1:])
    ok = ok and not (parts[0] in ("llsa", "bsa") and len(parts) < 3) and not (parts[0] == "flash" and len(parts) > 2)
    if not ok:
        raise SystemExit(
            f"--cases {case!r}: expected METHOD:SIDE[:X[:B]] with METHOD in {METHODS} (llsa:SIDE:LEVELS[:B], "
            "vsa:SIDE[:K[:B]], sla:SIDE[:K[:B]], bsa:SIDE:K[:B], flash:SIDE), e.g. llsa:256:2, llsa:256:2:32, vsa:256, "
            "bsa:256:16 or flash:256"
        )
    side = int(parts[1])
    x = int(parts[2]) if len(parts) >= 3 else DEFAULT_K.get(side, 32)
    block = int(parts[3]) if len(parts) == 4 else 128 if parts[0] == "bsa" else 16
    return parts[0], side, x, block


def attention_call(lib, method: str, x: int, block: int, q, k, v, gate, lists=None):
    """The timed call of one library: its output merged into ``[b, N, h * d]`` as a model does before its output
    projection, so that a library returning tokens-major memory saves that copy here too and the gradient arrives in
    the layout a model hands back (a tensor to differentiate). ``lists``: bsa's block lists."""
    if method == "llsa":
        out = lib.llsa_attention(q, k, v, block_size=block, topk=8, num_levels=x)
    elif method == "vsa":
        out = lib.vsa_attention(q, k, v, block_size=block, topk=x, gate=gate)
    elif method == "bsa":
        out = lib.block_sparse_attention(q, k, v, lists, query_block=block, key_block=block)
    elif method == "flash":
        out = lib.flash_attention(q, k, v)
    else:
        out = sum(lib.sla_attention(q, k, v, block_size=block, topk=x))
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    bases = [(d, load_kernels_as(d, f"pixdit_kernels_base{i}")) for i, d in enumerate(args.kernels_from)]
    time_ms = timer(args.device)
    times = {}  # (case, version) -> [(fwd ms, fwd+bwd ms) per round]; version: a --kernels-from DIR or "after"
    results = {}  # (case, version) -> output and gradients of round 0, to compare the versions
    per_kernel = {}  # (case, version) -> {kernel launch: ms per forward + backward call}, round 0
    for round_ in range(args.rounds):
        for case in args.cases:
            method, side, x, block = case
            n = side * side
            g = torch.Generator(device=args.device).manual_seed(round_)
            shape = (max(1, args.tokens_total // n), args.heads, n, args.head_dim)
            dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
            q, k, v = (
                torch.randn(shape, device=args.device, dtype=dtype, generator=g).requires_grad_() for _ in range(3)
            )
            # VSA's gate with a gradient, as in training (its backward then computes d_gate)
            do = torch.randn(shape[0], n, shape[1] * shape[3], device=args.device, dtype=dtype, generator=g)
            gate = torch.randn(shape, device=args.device, dtype=dtype, generator=g).requires_grad_()
            # bsa: the first x blocks of a random order per query tile, as bench_attention.py's bsa and flex rows
            lists = random_block_order(shape, block, args.device)[..., :x].contiguous() if method == "bsa" else None
            for version, lib in [*bases, ("after", current)]:

                def forward(lib=lib):
                    return attention_call(lib, method, x, block, q, k, v, gate, lists)

                def forward_backward(forward=forward):
                    return torch.autograd.grad(forward(), (q, k, v), do)

                if round_ == 0:
                    out = forward()
                    results[(case, version)] = (out.detach(), *torch.autograd.grad(out, (q, k, v), do))
                    if args.per_kernel:
                        per_kernel[(case, version)] = launch_breakdown(lib, forward_backward)
                if args.kernel_time:
                    entry = (kernel_ms(forward), kernel_ms(forward_backward))
                elif args.back_to_back:  # (wall, host) per call of each: fwd, fwd+bwd, fwd host, fwd+bwd host
                    (fwd, fwd_host), (both, both_host) = (
                        back_to_back_ms(fn, args.back_to_back, args.device) for fn in (forward, forward_backward)
                    )
                    entry = (fwd, both, fwd_host, both_host)
                else:
                    entry = (time_ms(forward, 100), time_ms(forward_backward, 200))
                times.setdefault((case, version), []).append(entry)
    rows = []
    for case in args.cases:
        method, side, x, block = case
        for directory, _ in bases:
            row = {
                "method": method,
                "size": f"{side}²",
                "L or K": {"llsa": f"L={x}", "flash": "-"}.get(method, f"K={x}"),
            }
            row |= {"B": "-" if method == "flash" else block} | ({"before": directory} if len(bases) > 1 else {})
            timed = ("fwd", "fwd+bwd", "fwd host", "fwd+bwd host") if args.back_to_back else ("fwd", "fwd+bwd")
            for i, what in enumerate(timed):
                before = statistics.median(t[i] for t in times[(case, directory)])
                after = statistics.median(t[i] for t in times[(case, "after")])
                spread = [t[i] for t in times[(case, directory)] + times[(case, "after")]]
                row |= {f"before {what} ms": before, f"after {what} ms": after, f"{what} speed-up": before / after}
                row[f"{what} spread ms"] = f"{min(spread):.3f}-{max(spread):.3f}"
            # the two versions should compute the same function: output and gradients compared by rel_diff
            pairs = zip(results[(case, directory)], results[(case, "after")])
            row["max rel. diff o, dq, dk, dv"] = ", ".join(f"{rel_diff(a, b):.1e}" for a, b in pairs)
            rows.append(row)
    print(markdown_table(rows, cell=lambda c, v: f"{v:.3f}" if isinstance(v, float) else str(v)))
    for case in args.cases if args.per_kernel else ():
        for directory, _ in bases:
            vs = f" ({directory} before)" if len(bases) > 1 else ""
            print(
                f"\n{':'.join(map(str, case))}: the {args.per_kernel} largest kernels of a forward + backward call{vs}"
            )
            print(launch_table(per_kernel[(case, directory)], per_kernel[(case, "after")], args.per_kernel))
    return rows


def launch_table(before: dict[str, float], after: dict[str, float], top: int) -> str:
    """The ``top`` kernels (launches) by their larger time in either version: label (cut to 100 characters), ms per
    call each."""
    names = sorted(before.keys() | after.keys(), key=lambda n: -max(before.get(n, 0.0), after.get(n, 0.0)))[:top]
    rows = [{"kernel": n[:100], "before ms": before.get(n, 0.0), "after ms": after.get(n, 0.0)} for n in names]
    return markdown_table(rows, cell=lambda c, v: f"{v:.3f}" if isinstance(v, float) else str(v))


if __name__ == "__main__":
    main()

"""Interleaved A/B of LLSA's pooled forward pass: ``bsa_forward`` (Triton, 64-row programs) against
``llsa_gluon.pooled_forward`` (Gluon, one program per B^2-row group with its keys in shared memory; with its products
waited for in turn, and pipelined: ``llsa_gluon.PIPELINED``), in one process.

    python scripts/ab_llsa_pooled.py                # the attention benchmark's: 256² L=2 x 2, 128² L=2 x 8, 512² L=3
    python scripts/ab_llsa_pooled.py --cases 256:2:32 128:2:64    # the sampler's batches
    python scripts/ab_llsa_pooled.py --heads 12                   # DiT-B's heads

The pass alone: both kernels on the arguments that one LLSA forward hands its pooled pass (captured from a real call,
so the same lists, partial output and bank), ``do_bench`` medians, rounds alternating the order; useful TFLOP/s count
the pass's attended keys (the candidates and the coarsest level). The whole forward: ``llsa_attention`` with the
switch ``llsa.GLUON_POOLED_FORWARD`` off and on (the faster Gluon form), GPU kernel time
(``pixdit.report.kernel_ms``: an eager call is host-bound). The last column: the largest differences of the Gluon forms' outputs and LSEs from ``bsa_forward``'s,
relative to the largest value (0 = the same bits). Needs an sm_90 GPU (H100 / H200).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from kernel_ab import rel_diff, timer

from pixdit.kernels import block_sparse as bs
from pixdit.kernels import llsa, llsa_attention, llsa_gluon
from pixdit.report import kernel_ms, markdown_table


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=["256:2:2", "128:2:8", "512:3:1"], help="SIDE:LEVELS:BATCH")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args(argv)
    try:
        args.cases = [tuple(int(v) for v in c.split(":")) for c in args.cases]
    except ValueError:
        args.cases = []
    if not args.cases or any(len(c) != 3 or min(c) < 1 for c in args.cases):
        raise SystemExit("--cases: each must be SIDE:LEVELS:BATCH, three ints >= 1")
    return args


def pooled_call(q, k, v, levels: int, topk: int):
    """The positional and keyword arguments of the pooled ``bsa_forward`` call in one LLSA forward."""
    seen, plain = [], bs.bsa_forward

    def spy(*args, **kwargs):
        if kwargs.get("init") is not None:
            seen.append((args, kwargs))
        return plain(*args, **kwargs)

    bs.bsa_forward = spy
    try:
        llsa_attention(q, k, v, topk=topk, num_levels=levels)
    finally:
        bs.bsa_forward = plain
    return seen[0]


@torch.no_grad()
def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = [one_case(args, side, levels, batch) for side, levels, batch in args.cases]
    print(
        f"LLSA's pooled forward pass, {args.heads} heads of 64, bf16, K = {args.topk}, {torch.cuda.get_device_name()}"
    )
    print(markdown_table(rows, cell=lambda c, v: f"{v:.3f}" if isinstance(v, float) else str(v)))
    return rows


def one_case(args, side: int, levels: int, batch: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(side + levels)
    n, B = side * side, 16
    q, k, v = (torch.randn(batch, args.heads, n, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "qkv")
    (qf, bank_k, bank_v, lists, _, _, scale), kw = pooled_call(q, k, v, levels, args.topk)
    o_init, lse_init = kw["init"]
    cand_widths = tuple(llsa.llsa_check(n, B, levels, args.topk)["topk"][1:levels])
    tail = kw["dense_tail"]
    if not llsa_gluon.pooled_forward_supported(qf, B, cand_widths, tail[1] - tail[0], kw["full_lists"]):
        raise SystemExit(f"{side}² L={levels}: not a case the Gluon pass takes (see llsa_gluon.case_supported)")

    def gluon(pipelined: bool):
        def call():
            llsa_gluon.PIPELINED = pipelined
            try:
                return llsa_gluon.pooled_forward(
                    qf, bank_k, bank_v, lists, o_init, lse_init, B, scale, cand_widths, tail, args.heads
                )
            finally:
                llsa_gluon.PIPELINED = False

        return call

    forms = {
        "bsa_forward": lambda: bs.bsa_forward(qf, bank_k, bank_v, lists, llsa.COARSE_TILE, B, scale, **kw),
        "Gluon": gluon(False),
        "Gluon, pipelined": gluon(True),
    }
    outs = {name: fn() for name, fn in forms.items()}
    time_ms, times = timer("cuda"), {name: [] for name in forms}
    for round_ in range(args.rounds):
        for name in list(forms) if round_ % 2 == 0 else list(forms)[::-1]:
            times[name].append(time_ms(forms[name], 200))
    ms = {name: statistics.median(t) for name, t in times.items()}
    keys = sum(cand_widths) * B + tail[1] - tail[0]
    flops = 4.0 * n * keys * 64 * batch * args.heads
    best = min(("Gluon", "Gluon, pipelined"), key=ms.get)
    whole = {}
    for on in (False, True):
        llsa.GLUON_POOLED_FORWARD, llsa_gluon.PIPELINED = on, on and best == "Gluon, pipelined"
        whole[on] = kernel_ms(lambda: llsa_attention(q, k, v, topk=args.topk, num_levels=levels), calls=20)
    llsa.GLUON_POOLED_FORWARD, llsa_gluon.PIPELINED = False, False
    tflops = " / ".join(f"{flops / ms[name] * 1e-9:.0f}" for name in forms)
    diffs = [
        f"{rel_diff(outs[name][i], outs['bsa_forward'][i]):.0e}"
        for name in forms
        if name != "bsa_forward"
        for i in (0, 1)
    ]
    return {
        "case": f"{side}² L={levels}, batch {batch}",
        "keys": keys,
        **{f"{name} ms": ms[name] for name in forms},
        "speed-up": ms["bsa_forward"] / ms["Gluon"],
        "speed-up, pipelined": ms["bsa_forward"] / ms["Gluon, pipelined"],
        "TFLOP/s": tflops,
        f"LLSA fwd ms (GPU), {best}": f"{whole[False]:.3f} -> {whole[True]:.3f}",
        "LLSA fwd speed-up": whole[False] / whole[True],
        "o / lse rel. diff": " ".join(diffs),
    }


if __name__ == "__main__":
    main()

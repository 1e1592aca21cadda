"""Interleaved A/B of LLSA's pooled passes, Triton against Gluon, in one process: the forward (``bsa_forward``
against ``llsa_gluon.pooled_forward``) and the dq (``bsa_backward_dq`` against ``llsa_gluon.pooled_dq``).

    python scripts/ab_llsa_pooled.py                # the attention benchmark's: 256² L=2 x 2, 128² L=2 x 8, 512² L=3
    python scripts/ab_llsa_pooled.py --cases 256:2:32 128:2:64    # the sampler's batches
    python scripts/ab_llsa_pooled.py --heads 12                   # DiT-B's heads

Each pass alone: the kernels on the arguments that one LLSA forward + backward hands its pooled passes (captured from
a real call, so the same lists, partial output, bank and gradient), ``do_bench`` medians, rounds alternating the
order; useful TFLOP/s count the attended keys (the candidates and the coarsest level; the dq's three products as 1.5
forwards). Then LLSA's forward and forward + backward with the switches ``llsa.GLUON_POOLED_FORWARD`` and
``GLUON_POOLED_DQ`` off, the dq's alone on and both on, GPU kernel time (``pixdit.report.kernel_ms``: an eager call
is host-bound). The last column: the largest differences of the Gluon kernels' two outputs (o and LSE; dq and Δ)
from Triton's, relative to the largest value (0 = the same bits). Needs an sm_90 GPU (H100 / H200).
"""

from __future__ import annotations

import argparse

import torch
from kernel_ab import interleaved_ms, rel_diff

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


def pooled_calls(q, k, v, levels: int, topk: int):
    """The arguments (positional, keyword) of the pooled ``bsa_forward`` and ``bsa_backward_dq`` calls in one LLSA
    forward + backward."""
    seen, forward, dq = {}, bs.bsa_forward, bs.bsa_backward_dq

    def spy(name, plain, pooled):
        def call(*args, **kwargs):
            if pooled(kwargs):
                seen.setdefault(name, (args, kwargs))
            return plain(*args, **kwargs)

        return call

    bs.bsa_forward = spy("forward", forward, lambda kw: kw.get("init") is not None)
    bs.bsa_backward_dq = spy("dq", dq, lambda kw: kw.get("dense_tail") is not None)
    try:
        with torch.enable_grad():
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            o = llsa_attention(q, k, v, topk=topk, num_levels=levels)
            o.backward(torch.randn_like(o))
    finally:
        bs.bsa_forward, bs.bsa_backward_dq = forward, dq
    return seen["forward"], seen["dq"]


@torch.no_grad()
def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = [row for side, levels, batch in args.cases for row in one_case(args, side, levels, batch)]
    device = torch.cuda.get_device_name()
    print(f"LLSA's pooled passes, {args.heads} heads of 64, bf16, K = {args.topk}, {device}")
    print(markdown_table(rows, cell=lambda c, v: f"{v:.3f}" if isinstance(v, float) else str(v)))
    return rows


def one_case(args, side: int, levels: int, batch: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(side + levels)
    n, B = side * side, 16
    q, k, v = (torch.randn(batch, args.heads, n, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "qkv")
    (fwd_args, fwd_kw), (dq_args, dq_kw) = pooled_calls(q, k, v, levels, args.topk)
    qf, bank_k, bank_v, lists, _, _, scale = fwd_args
    o_init, lse_init = fwd_kw["init"]
    cand_widths = tuple(llsa.llsa_check(n, B, levels, args.topk)["topk"][1:levels])
    tail = fwd_kw["dense_tail"]
    if not llsa_gluon.pooled_supported(qf, B, cand_widths, tail[1] - tail[0], fwd_kw["full_lists"]):
        raise SystemExit(f"{side}² L={levels}: not a case the Gluon kernels take (see llsa_gluon.case_supported)")
    keys = sum(cand_widths) * B + tail[1] - tail[0]
    flops = 4.0 * n * keys * 64 * batch * args.heads  # the forward's; the dq's three products are 1.5x that

    forward = {
        "Triton": lambda: bs.bsa_forward(*fwd_args, **fwd_kw),
        "Gluon": lambda: llsa_gluon.pooled_forward(
            qf, bank_k, bank_v, lists, o_init, lse_init, B, scale, cand_widths, tail, args.heads
        ),
    }
    _, _, _, do, lse, delta, _, _, _, _ = dq_args
    o = dq_kw["o"]
    dq = {
        "Triton": lambda: (bs.bsa_backward_dq(*dq_args, **dq_kw), delta.clone()),
        "Gluon": lambda: (
            llsa_gluon.pooled_dq(qf, bank_k, bank_v, do, o, lse, delta, lists, B, scale, cand_widths, tail),
            delta.clone(),
        ),
    }
    rows = []
    for name, forms, work in (("forward", forward, flops), ("dq", dq, 1.5 * flops)):
        outs = {form: fn() for form, fn in forms.items()}
        ms = interleaved_ms(forms, args.rounds)
        diffs = [f"{rel_diff(outs[f][i], outs['Triton'][i]):.0e}" for f in forms if f != "Triton" for i in (0, 1)]
        rows.append(
            {
                "case": f"{side}² L={levels}, batch {batch}",
                "pass": name,
                "keys": keys,
                **{f"{form} ms": ms.get(form, float("nan")) for form in forward},
                "speed-up": ms["Triton"] / ms["Gluon"],
                "TFLOP/s": " / ".join(f"{work / t * 1e-9:.0f}" for t in ms.values()),
                "rel. diff (o, lse / dq, Δ)": " ".join(diffs),
            }
        )
    rows.extend(whole_call(args, q, k, v, levels))
    return rows


def whole_call(args, q, k, v, levels: int) -> list[dict]:
    """LLSA's forward and forward + backward, GPU kernel time, with the Gluon kernels off and on."""
    go = torch.randn_like(q)

    def forward():
        return llsa_attention(q, k, v, topk=args.topk, num_levels=levels)

    def forward_backward():
        with torch.enable_grad():
            x = [t.detach().requires_grad_() for t in (q, k, v)]
            llsa_attention(*x, topk=args.topk, num_levels=levels).backward(go)

    ms = {}
    for switches in ((False, False), (False, True), (True, True)):  # (forward, dq): off, the dq alone, both
        llsa.GLUON_POOLED_FORWARD, llsa.GLUON_POOLED_DQ = switches
        ms[switches] = (kernel_ms(forward, calls=20), kernel_ms(forward_backward, calls=10))
    llsa.GLUON_POOLED_FORWARD = llsa.GLUON_POOLED_DQ = False
    off = ms[False, False]
    return [
        {
            "case": f"{q.shape[2]} tokens, L={levels}, batch {q.shape[0]}",
            "pass": f"LLSA {what} (GPU), Triton -> Gluon {which}",
            "Triton ms": off[i],
            "Gluon ms": ms[switches][i],
            "speed-up": off[i] / ms[switches][i],
        }
        for switches, which in (((False, True), "dq"), ((True, True), "forward and dq"))
        for i, what in enumerate(("forward", "forward + backward"))
        if switches[0] or i == 1  # the dq alone leaves the forward as it is
    ]


if __name__ == "__main__":
    main()

"""Routing recall of LLSA's hierarchical selection: does the coarse-to-fine search find the right blocks?

Does the coarse-to-fine top-K find the blocks a full search would? For every layer and level l, the recall is the
fraction of the exact single-level top-K_l blocks (full pooled-score search over all N_l tokens of level l) that the
hierarchical selection I^(l) keeps (level L is a full search, so 1.0 by construction). The attention mass is the
share of the dense softmax attention (fine queries, all N keys) that falls into the fine blocks selected
hierarchically, by the exact single-level search, and by the best possible K_1 blocks (largest mass, an upper bound).
"union of 4" is how much 4 neighbouring fine query blocks (a 64-row tile) share their selected blocks: the number
of distinct blocks in their 4 lists over 4 K_1 (1 = nothing shared, 0.25 = identical lists). A kernel that gives a
64-row tile the union of its blocks computes 4 K_1 x this value blocks per row instead of K_1. "columns of 4" is
the same for the backward's dk/dv pass, which walks the lists transposed (each fine key block over the query blocks
that list it): the number of distinct query blocks listing any of 4 neighbouring key blocks, over their 4 column
lengths together (1 = nothing shared; 0.25 = identical columns). A dk/dv program holding 4 key blocks would load
q and dO this fraction as often as four programs of one key block each.

    python scripts/llsa_recall.py                                # random smooth q/k, 128x128 tokens, B=16, K=8, L=2
    python scripts/llsa_recall.py --inputs iid --size 64 --num-levels 2 --layers 4
    python scripts/llsa_recall.py --checkpoint path/to/last.ckpt --images 4    # q/k captured from a trained model

Writes ``recall.md`` (table) and ``recall.png`` under ``--out``. Random inputs: ``smooth`` = per-channel Gaussian
noise blurred over the 2-D grid (nearby pixels look alike, as in images) then put in Z-order; ``iid`` = white noise
(no locality: the hard case for any block routing).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from pixdit.kernels import llsa_check, llsa_select, topk_desc
from pixdit.kernels.blocks import block_mean
from pixdit.tokens import token_permutation


def zorder_inverse(side: int, device) -> torch.Tensor:
    """Raster index of each Z-order position of a side x side grid (the model's token order)."""
    return token_permutation("zorder", side, side)[1].to(device)


def random_qk(args, device, layer):
    g = torch.Generator(device="cpu").manual_seed(args.seed + layer)
    shape = (args.batch * args.heads * 2, args.head_dim, args.size, args.size)
    x = torch.randn(shape, generator=g)
    if args.inputs == "smooth":
        width = args.blur
        kernel = torch.exp(-((torch.arange(-2 * width, 2 * width + 1).float() / width) ** 2) / 2)
        kernel = (kernel / kernel.sum()).view(1, 1, 1, -1)
        flat = x.reshape(-1, 1, args.size, args.size)
        flat = F.conv2d(F.pad(flat, (2 * width, 2 * width, 0, 0), mode="circular"), kernel)
        flat = F.conv2d(F.pad(flat, (0, 0, 2 * width, 2 * width), mode="circular"), kernel.transpose(-1, -2))
        x = flat.view(shape) / flat.std() + 0.5 * torch.randn(shape, generator=g)
    x = x.flatten(2)[:, :, zorder_inverse(args.size, "cpu")].transpose(1, 2)  # [b*h*2, N, d], Z-order
    x = x.reshape(2, args.batch, args.heads, args.size * args.size, args.head_dim).to(device)
    return x[0], x[1]


def captured_qk(args, device):
    """q, k of every attention layer of a checkpoint on real images (forward hooks on the attention backends)."""
    from pixdit.attention import AttentionBackend
    from pixdit.module import load_generator

    # The EMA model, uncompiled: the hooks below must see the eager modules
    model = load_generator(args.checkpoint)[0].to(device)
    captured = []
    hooks = [
        m.register_forward_hook(lambda mod, inp, out: captured.append((inp[0].detach(), inp[1].detach())))
        for m in model.modules()
        if isinstance(m, AttentionBackend)
    ]
    side = args.size
    x = torch.rand(args.images, 3, side, side, device=device) * 2 - 1  # replace with real images if at hand
    t = torch.full((args.images,), 500.0, device=device)
    with torch.no_grad():
        model(x, t)
    for h in hooks:
        h.remove()
    return captured


def sibling_union(fine_index: torch.Tensor, group: int) -> float:
    """Mean number of distinct blocks in the lists of ``group`` consecutive fine query blocks, over group * K."""
    b, h, n, k = fine_index.shape
    ids = fine_index[:, :, : n - n % group].reshape(b, h, -1, group * k).sort(-1).values
    distinct = 1 + (ids[..., 1:] != ids[..., :-1]).sum(-1)
    return (distinct.float() / (group * k)).mean().item()


def column_union(fine_index: torch.Tensor, group: int) -> float:
    """Distinct (group of ``group`` consecutive key blocks, query block) pairs over all list entries: how much the
    transposed lists (the key blocks' columns) of neighbouring key blocks share their query blocks."""
    b, h, n, k = fine_index.shape
    rows = torch.arange(n, device=fine_index.device).view(1, 1, n, 1)
    pairs = (fine_index.long() // group * n + rows).reshape(b * h, n * k).sort(-1).values
    distinct = 1 + (pairs[:, 1:] != pairs[:, :-1]).sum(-1)  # counted as sibling_union counts its lists' blocks
    return distinct.sum().item() / pairs.numel()


def layer_stats(q, k, args):
    B = args.block_size
    cfg = llsa_check(q.shape[2], B, args.num_levels, args.topk)
    L, ks = cfg["num_levels"], cfg["topk"]
    index = llsa_select(q, k, B, ks, L)
    qf, kf = q.float(), k.float()
    rows = {"union of 4": sibling_union(index[0], 4), "columns of 4": column_union(index[0], 4)}
    qp, kp = qf, kf
    for lvl in range(1, L + 1):
        qp, kp = block_mean(qp, B), block_mean(kp, B)
        exact = torch.cat(
            [
                topk_desc(qp[:, :, r : r + 1024] @ kp.transpose(-1, -2), ks[lvl - 1])
                for r in range(0, qp.shape[2], 1024)
            ],
            dim=2,
        )
        hits = (index[lvl - 1].long()[..., :, None] == exact.long()[..., None, :]).any(-1).float().mean()
        rows[f"recall L{lvl}"] = hits.item()
        if lvl == 1:
            exact1 = exact
    # attention mass of the fine blocks, dense softmax in chunks of queries
    N, d = q.shape[2], q.shape[3]
    mass = {"hier": 0.0, "exact": 0.0, "best": 0.0}
    for r0 in range(0, N, 1024):
        p = torch.softmax(qf[:, :, r0 : r0 + 1024] @ kf.transpose(-1, -2) * d**-0.5, -1)
        blk = p.view(*p.shape[:-1], N // B, B).sum(-1)  # [b, h, rows, N/B]
        qblk = torch.arange(r0, min(N, r0 + 1024), device=q.device) // B
        for name, sel in (("hier", index[0]), ("exact", exact1)):
            mass[name] += blk.gather(-1, sel[:, :, qblk].long()).sum(-1).sum().item()
        mass["best"] += blk.topk(ks[0], dim=-1).values.sum(-1).sum().item()
    total = q.shape[0] * q.shape[1] * N
    for name in mass:
        rows[f"mass {name}"] = mass[name] / total
    return rows, L


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", default=None, help="pixdit Lightning checkpoint (default: random inputs)")
    p.add_argument("--images", type=int, default=2, help="images per forward with --checkpoint")
    p.add_argument("--inputs", default="smooth", choices=["smooth", "iid"], help="random inputs without checkpoint")
    p.add_argument("--blur", type=int, default=4, help="Gaussian blur width (pixels) of the smooth inputs")
    p.add_argument("--size", type=int, default=128, help="image side; tokens = side^2")
    p.add_argument("--layers", type=int, default=3, help="random layers (independent draws)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--num-levels", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="outputs/llsa_recall")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.checkpoint:
        layers = captured_qk(args, args.device)
    else:
        layers = [random_qk(args, args.device, i) for i in range(args.layers)]
    results = []
    for i, (q, k) in enumerate(layers):
        stats, L = layer_stats(q, k, args)
        results.append(stats)
        print(f"layer {i}: " + "  ".join(f"{key} {val:.3f}" for key, val in stats.items()), flush=True)
    keys = list(results[0])
    src = f"checkpoint {args.checkpoint}" if args.checkpoint else f"random {args.inputs} inputs"
    md = [
        f"LLSA routing recall, {src}, {args.size}x{args.size} tokens, B={args.block_size}, K={args.topk}, L={L}",
        "",
        "| layer | " + " | ".join(keys) + " |",
        "|---" * (len(keys) + 1) + "|",
    ]
    md += [f"| {i} | " + " | ".join(f"{r[key]:.3f}" for key in keys) + " |" for i, r in enumerate(results)]
    with open(os.path.join(args.out, "recall.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        for key in keys:
            ax.plot(range(len(results)), [r[key] for r in results], marker="o", label=key)
        ax.set_xlabel("layer")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"LLSA routing recall ({src})")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "recall.png"), dpi=120)
    except ImportError:
        print("matplotlib missing: no plot")


if __name__ == "__main__":
    main()

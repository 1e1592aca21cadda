"""One LLSA forward + backward for a profiler that records only between cudaProfilerStart/Stop (Nsight Compute's
``--profile-from-start off``): three warm-up calls (Triton compiles and autotunes there), then the profiled call.

    PIXDIT_KERNELS_AUTOTUNE=0 ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python scripts/profile_llsa.py --size 256 --levels 2 > ncu_llsa256.txt

(bash scripts/device_suite.sh ncu runs exactly this.) ``--tokens-total`` sets the batch as in bench_attention.py.
"""

from __future__ import annotations

import argparse

import torch

from pixdit.kernels import llsa_attention


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=256, help="image side; tokens = side^2")
    p.add_argument("--levels", type=int, default=2)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens-total", type=int, default=131072, help="batch = max(1, tokens_total // tokens)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_llsa.py needs a CUDA device (it drives a GPU profiler)")
    n = args.size * args.size
    shape = (max(1, args.tokens_total // n), args.heads, n, args.head_dim)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)

    def call():  # torch.autograd.grad, not .backward(): no accumulation into q.grad in the profile
        out = llsa_attention(q, k, v, block_size=16, topk=args.topk, num_levels=args.levels)
        return torch.autograd.grad(out, (q, k, v), do)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()

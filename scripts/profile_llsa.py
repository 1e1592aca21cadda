"""One LLSA forward + backward for a profiler that records only between cudaProfilerStart/Stop (Nsight Compute's
``--profile-from-start off``): three warm-up calls (Triton compiles and autotunes there), then the profiled call.

    PIXDIT_KERNELS_AUTOTUNE=0 ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python scripts/profile_llsa.py --size 256 --levels 2 > ncu_llsa256.txt

(bash scripts/device_suite.sh ncu runs exactly this.) ``--tokens-total`` sets the batch as in bench_attention.py.

``--host``: where the host's time goes instead (an eager call is host-bound at these sizes: its wall time is a
multiple of its GPU time). It prints the GPU kernel time of one call, the wall time per call back to back (as
bench_attention.py times it), and the Python functions that took the host's time over ``--calls`` calls (cProfile,
by own time, then by cumulative time), so a launch, a wrapper or a wait on the GPU shows by name (bash
scripts/device_suite.sh host).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

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
    p.add_argument("--host", action="store_true", help="profile the host side of eager calls instead (cProfile)")
    p.add_argument("--calls", type=int, default=50, help="--host: calls to time and to profile")
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
    if args.host:
        host_profile(call, args.calls)
        return
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def host_profile(call, calls: int) -> None:
    """GPU time of one call, wall and host time per call back to back (``kernel_ab.back_to_back_ms``), and the host's
    functions by own and by cumulative time."""
    from kernel_ab import back_to_back_ms

    from pixdit.report import kernel_ms

    gpu = kernel_ms(call)
    wall, host = back_to_back_ms(call, calls, "cuda")
    print(
        f"forward + backward: GPU kernel time {gpu:.3f} ms, wall time per call back to back {wall:.3f} ms "
        f"(host {host:.3f} ms to issue it)"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(30)  # where the host's own time goes
    stats.sort_stats("cumulative").print_stats(40)  # each launcher with the Triton launch and ATen calls under it


if __name__ == "__main__":
    main()

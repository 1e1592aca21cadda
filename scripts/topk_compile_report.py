"""Compile the selection kernels of ``pixdit.kernels.topk`` for the H200 (sm_90) without a GPU: time, registers,
spills, SASS size per size bucket. The only performance signal on a machine without one; re-run it after a kernel
change (a spill or a jump in compile time shows here first).

    python scripts/topk_compile_report.py                 # every bucket VSA/SLA/LLSA use at head_dim 64
    python scripts/topk_compile_report.py --head-dim 128 --dump /tmp/topk_sass   # + PTX / SASS files to read

Each row is one compiled variant; ``k`` is a run-time argument of both kernels, so these are all the variants a
sweep over k compiles (one-shot: one per candidate count, streaming: one per SLOTS bucket). Registers and spills
come from the ptxas bundled with Triton (``-v``), SASS from its cuobjdump; the compile time is the whole Triton
pipeline (IR passes + ptxas) on this machine, with Triton's cache bypassed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget

from pixdit.kernels import topk
from pixdit.report import markdown_table

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200


def one_shot_variant(head_dim: int, cand: int) -> tuple:
    sig = {
        "QP": "*fp32",
        "KP": "*fp32",
        "PAR": "*i32",
        "OUT": "*i32",
        "n_rows": "i32",
        "n_cand": "i32",
        "k": "i32",
        "stride_qb": "i32",
        "stride_kb": "i32",
        "stride_pb": "i32",
        "stride_ob": "i32",
    }
    const = {"HEAD_DIM": head_dim, "ROWS": topk._ROWS, "CAND": cand, "CHILD": 0, "N_PARENTS": 1}
    return topk._pooled_topk_kernel, sig, const, 4 if cand <= 256 else 8


def streaming_variant(head_dim: int, slots: int) -> tuple:
    sig = {
        "QP": "*fp32",
        "KP": "*fp32",
        "OUT": "*i32",
        "n_rows": "i32",
        "n_cand": "i32",
        "k": "i32",
        "stride_qb": "i32",
        "stride_kb": "i32",
        "stride_ob": "i32",
    }
    const = {"HEAD_DIM": head_dim, "ROWS": topk._STREAM_ROWS, "CHUNK": topk._STREAM_CHUNK, "SLOTS": slots}
    return topk._streaming_topk_kernel, sig, const, 4


def compile_one(fn, signature: dict, constexprs: dict, num_warps: int, dump: str | None, label: str) -> dict:
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    with tempfile.TemporaryDirectory() as cache:  # a fresh cache: the time is a real compile
        os.environ["TRITON_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        kernel = triton.compile(
            triton.compiler.ASTSource(fn, sig, constexprs=constexprs), target=TARGET, options={"num_warps": num_warps}
        )
        seconds = time.perf_counter() - t0
    bin_dir = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    row = {"compile s": f"{seconds:.1f}", "warps": num_warps, "smem KiB": f"{kernel.metadata.shared / 1024:.1f}"}
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        ptxas = subprocess.run(
            [os.path.join(bin_dir, "ptxas"), "-v", "--gpu-name", "sm_90a", ptx, "-o", os.devnull],
            capture_output=True,
            text=True,
        ).stderr
        regs = re.search(r"Used (\d+) registers", ptxas)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
        row["registers"] = regs.group(1) if regs else "?"
        row["spill st/ld B"] = f"{spill.group(1)}/{spill.group(2)}" if spill else "?"
        sass = subprocess.run(
            [os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True
        ).stdout
        row["SASS instr"] = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line))
        if dump:
            os.makedirs(dump, exist_ok=True)
            for ext, text in (("ptx", kernel.asm["ptx"]), ("ttgir", kernel.asm["ttgir"]), ("sass", sass)):
                with open(os.path.join(dump, f"{label}.{ext}"), "w") as f:
                    f.write(text)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dump", default=None, help="folder for the PTX / TTGIR / SASS of each variant")
    args = parser.parse_args(argv)
    variants = [
        (f"one-shot cand={c}", one_shot_variant(args.head_dim, c))
        for c in (64, 256, 512, 1024)
        if c * args.head_dim <= topk._MAX_CAND_X_DIM
    ]
    variants += [
        (f"streaming slots={s}", streaming_variant(args.head_dim, s))
        for s in (topk._STREAM_MIN_SLOTS, 32, topk.STREAM_MAX_K)
    ]
    rows = []
    for label, (fn, sig, const, warps) in variants:
        row = {"kernel": label, "head_dim": args.head_dim}
        row.update(compile_one(fn, sig, const, warps, args.dump, label.replace(" ", "_").replace("=", "")))
        rows.append(row)
        print(row, flush=True)
    print(f"\ntriton {triton.__version__}, target sm_90\n")
    print(markdown_table(rows))


if __name__ == "__main__":
    main()

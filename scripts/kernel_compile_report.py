"""Compile pixdit's Triton kernels for the H200 (sm_90) without a GPU: time, registers, spills, shared memory, SASS
size per variant. The only performance signal on a machine without one; re-run it after a kernel change (a spill,
a register jump that costs occupancy, or a jump in compile time shows here first).

    python scripts/kernel_compile_report.py                      # selection (top-k) and the LLSA attention kernels
    python scripts/kernel_compile_report.py --kernels attention --warps launch 4 8 --stages 2 3
    python scripts/kernel_compile_report.py --kernels topk --head-dim 128 --dump /tmp/sass   # + PTX / SASS to read
    python scripts/kernel_compile_report.py --kernels topk --kernels-from /tmp/variant/kernels  # another library
    python scripts/kernel_compile_report.py --kernels joint      # the DiT block's joint backward, every launch

``topk``: ``k`` is a run-time argument of the selection kernels, so the rows are all the variants a sweep over k
compiles (one-shot: one per candidate count, streaming: one per SLOTS bucket, row select: one per score-row length
and k bucket). ``attention``: the block-sparse
forward, dq and dk/dv kernels as LLSA launches them at 256^2 tokens, L = 2 (fine level: 16-row blocks; pooled
levels: 64-row tiles over the bank, the coarsest level as a dense tail), SLA's forward, dq and dk/dv kernels at
256^2 (K = 32), and the 128-row forward and dk/dv programs of block_sparse_attention and flash_attention, at the
warps their launchers give them (``--warps launch``, the default) or the ones given. ``joint``: the backward of
``adaln_joint`` (the DiT block's residual + LayerNorm + modulation) at DiT-S/B/XL widths, with and without the
branch, at every launch its autotuning may pick (``adaln_joint.backward_launches``).
Arguments get the divisibility-by-16 hints the launcher gives them at run time.
Registers and spills come from the ptxas bundled with Triton (``-v``), SASS from its cuobjdump; the compile time is
the whole Triton pipeline (IR passes + ptxas) on this machine, with Triton's cache bypassed. Register counts depend
on the Triton version (the two-pass row kernel: 216 with Triton 3.8, 141 with 3.6, the same source), so for a
decision run it with the GPU machine's version, e.g. ``pip install triton==3.6.0`` in a side environment.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import math
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

if any(arg.startswith("--kernels-from") for arg in sys.argv):  # swap the kernel library before pixdit imports it
    from kernel_ab import apply_from_argv

    apply_from_argv(sys.argv)

from pixdit.kernels import adaln_joint, block_sparse, linear_attention, sla_triton, topk  # noqa: E402
from pixdit.report import markdown_table  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200


def one_shot_variant(head_dim: int, cand: int, children: bool = False) -> tuple:
    """The one-shot selection kernel for ``cand`` candidates (4,096 query rows, K = 8): every key row, or with
    ``children`` those of 8 parents of cand / 8 rows each (LLSA's levels below the coarsest)."""
    args = dict(QP="*fp32", KP="*fp32", PAR="*i32", OUT="*i32", n_rows=4096, n_cand=cand, k=8)
    args |= dict(stride_qb=4096 * head_dim, stride_kb=4096 * head_dim, stride_pb=256 * 8, stride_ob=4096 * 8)
    family = {"CHILD": cand // 8, "N_PARENTS": 8} if children else {"CHILD": 0, "N_PARENTS": 1}
    options = topk._one_shot_launch(cand, head_dim)
    const = {"HEAD_DIM": head_dim, "ROWS": topk._ROWS, "CAND": cand, **family}
    const |= {name: options.pop(name) for name in ("D_CHUNK", "PRECISION")}  # constexprs, not launch options
    return topk._pooled_topk_kernel, args, const, options


def streaming_variant(head_dim: int, slots: int) -> tuple:
    """The streaming selection kernel, one SLOTS bucket (4,096 rows and candidates)."""
    args = dict(QP="*fp32", KP="*fp32", OUT="*i32", n_rows=4096, n_cand=4096, k=slots)
    args |= dict(stride_qb=4096 * head_dim, stride_kb=4096 * head_dim, stride_ob=4096 * slots)
    const = {"HEAD_DIM": head_dim, "ROWS": topk._STREAM_ROWS, "CHUNK": topk._STREAM_CHUNK, "SLOTS": slots}
    return topk._streaming_topk_kernel, args, const, {"num_warps": 4}


def row_select_variant(block: int, k: int) -> tuple:
    """The row-select kernel of the two-pass selection: rows of ``block`` precomputed scores, the ``CAP`` bucket of
    ``k``."""
    args = dict(S="*fp32", OUT="*i32", SCRATCH="*i32", COUNT="*i32", FLAGS="*i32", n=block, k=k, stride_s=block)
    args["stride_o"] = k
    const = {"BLOCK": block, "CAP": topk._row_cap(k), "KEYS_IN_SCRATCH": topk._row_keys_in_scratch(block)}
    const |= {"ATOMIC_SLOTS": topk._row_atomic_slots(block), "FLAGGED": False}
    return topk._row_topk_kernel, args, const, topk._row_launch(block)


def rescore_variant(block: int, k: int, head_dim: int) -> tuple:
    """The screened selection's rescoring kernel: rows of ``block`` screened scores, top ``k``."""
    c = topk._screen_width(k)
    args = dict(S="*fp32", CAND="*i32", OUT="*i32", FLAGS="*i32", Q="*fp32", K="*fp32", K_NORM_MAX="*fp32")
    args |= dict(n=block, k=k, c=c, rows_per_slice=block, d=head_dim, error=0.01)
    cap, warps = topk._rescore_launch(c)
    return topk._rescore_kernel, args, {"CAP": cap, "HEAD_DIM": head_dim}, {"num_warps": warps}


def constexpr_names(fn) -> set[str]:
    """The ``tl.constexpr`` parameters of a kernel, read off its Python function (``fn.fn``), so that this works on
    a JITFunction and on the InterpretedFunction that TRITON_INTERPRET=1 makes of it alike."""
    return {name for name, p in inspect.signature(fn.fn).parameters.items() if "constexpr" in str(p.annotation)}


def unspecialized_names(fn) -> set[str]:
    """The kernel's ``do_not_specialize`` arguments (names or indices, depending on the Triton version)."""
    names = getattr(fn, "do_not_specialize", None)
    if names is None:  # InterpretedFunction keeps the decorator's keyword arguments
        names = getattr(fn, "kwargs", {}).get("do_not_specialize") or ()
    return {fn.arg_names[i] if isinstance(i, int) else i for i in names}


def launch_variant(fn, args: dict, constexprs: dict) -> tuple[dict, dict]:
    """Signature and attributes of a launch of ``fn`` with these run-time ``args`` (a pointer given as its type,
    e.g. "*bf16"; ints and floats as example values): what the launcher derives, including the divisibility-by-16
    hints of pointers and of ints that are multiples of 16 (they decide vector widths)."""
    unhinted = unspecialized_names(fn)  # e.g. topk's k
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            continue
        value = args[name]
        if isinstance(value, str):  # a pointer ("*bf16") or a TMA descriptor ("tensordesc<bf16[64, 64]>")
            signature[name] = value
            if value.startswith("*"):
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if value % 16 == 0 and name not in unhinted:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def compile_one(
    fn,
    signature: dict,
    constexprs: dict,
    num_warps: int,
    dump: str | None,
    label: str,
    attrs: dict | None = None,
    num_stages: int | None = None,
    max_registers: int | None = None,
) -> dict:
    sig = dict(signature, **{name: "constexpr" for name in constexprs})
    options = {"num_warps": num_warps} | ({"num_stages": num_stages} if num_stages else {})
    options |= {"maxnreg": max_registers} if max_registers else {}
    with tempfile.TemporaryDirectory() as cache:  # a fresh cache: the time is a real compile
        os.environ["TRITON_CACHE_DIR"] = cache
        t0 = time.perf_counter()
        source = triton.compiler.ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(source, target=TARGET, options=options)
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


def attention_variants(head_dim: int) -> list[tuple[str, object, dict, dict]]:
    """(label, kernel, run-time args, constexprs) of the block-sparse launches of one LLSA call at 256^2 tokens,
    L = 2, B = K = 16 / 8, batch * heads = 12 (bf16): the fine level over k/v and the pooled levels over the bank."""
    # Example values: the kernel is compiled for their types, and for ints for whether they are multiples of 16
    n, bank, d = 65536, 65536 // 16 + 65536 // 256, head_dim
    common = dict(HEAD_DIM=d, PREC="tf32")
    tail = dict(tail_lo=n // 16, tail_hi=bank, tail_bias=2 * math.log(16) * block_sparse.LOG2E.value)
    no_tail = dict(tail_lo=0, tail_hi=0, tail_bias=0.0)
    # the output and its gradient tokens-major ([2, n, 6, d]: LLSA's last forward pass writes it so), q flat
    heads = 6
    strides = dict(stride_qb=n * d, stride_qn=d, stride_ob=n * heads * d, stride_oh=d, stride_on=heads * d)
    strides |= dict(out_heads=heads, stride_db=n * heads * d, stride_dh=d, stride_dn=heads * d, do_heads=heads)
    dq_strides = {key: value for key, value in strides.items() if key not in ("stride_ob", "stride_oh", "stride_on")}
    dq_strides.pop("out_heads")
    flat_out = dict(stride_ob=n * d, stride_oh=0, stride_on=d, out_heads=1)  # the fine pass's fp32 partial output

    # (run-time args, constexprs) of the listed blocks' weights: the pooled passes of LLSA at L = 2 have one candidate
    # level, so one weight for every listed block, and full lists
    runs = dict(run_end0=8, run_bias1=0.0, run_end1=8, run_bias2=0.0)
    pooled_lists = (dict(list_bias=math.log(16), **runs), dict(LIST_RUNS=1, FULL_LIST=True))
    no_list_weight = (dict(list_bias=0.0, **runs), dict(LIST_RUNS=0, FULL_LIST=False))

    def descriptors(step_rows, names=("K_DESC", "V_DESC")):
        """(arguments, DESC_ROWS) of a launch whose contiguous walk steps over ``step_rows`` rows: TMA descriptors
        where block_sparse.tma_descriptors gives them (block_sparse.tma_step_rows), else pointers."""
        desc_rows = block_sparse.tma_step_rows(step_rows)
        desc = f"tensordesc<bf16[{desc_rows}, {d}]>" if desc_rows else "*bf16"
        return dict.fromkeys(names, desc), desc_rows

    def fwd(block_m, n_k, list_len, out, has_init, has_logw, tail_args, list_args):
        args = dict(Q="*bf16", K="*bf16", V="*bf16", O=out, LSE="*fp32", LIST="*i32", LOGW="*fp32", O_INIT="*fp32")
        args |= dict(LSE_INIT="*fp32", stride_kb=n_k * d, stride_kn=d, stride_lb=(n // block_m) * list_len)
        args |= dict(stride_vb=n_k * d, stride_vh=0, stride_vn=d, v_heads=1)  # v flat like k (training's layout)
        args |= dict(stride_lt=list_len, n_q=n, n_k=n_k, list_len=list_len, qk_scale=0.18, **strides, **tail_args)
        args |= flat_out if out == "*fp32" else {}
        args |= list_args[0]
        per_iter = block_sparse.walk_blocks_per_step(block_m, 16, d)
        # the dense tail's steps load K and V by TMA, the 16-key walks by pointers
        desc_args, desc_rows = descriptors(block_sparse.tma_walk_rows(per_iter, list_len, 16, tail_args["tail_hi"]))
        args |= desc_args
        const = dict(common, BLOCK_M=block_m, KEY_BLOCK=16, PER_ITER=per_iter, HAS_LOGW=has_logw, HAS_INIT=has_init)
        const |= list_args[1]
        ids = block_sparse.forward_ids_in_registers(block_m, 16, d, torch.bfloat16)
        const |= dict(LIST_SLOTS=block_sparse.list_slots(list_len, per_iter, ids), DESC_ROWS=desc_rows)
        return args, const | dict(EVEN_K=True, N_SUB=1, HAS_TAIL=tail_args["tail_hi"] > 0, EVEN_TAIL=True)

    def dq(block_m, n_k, list_len, out, accumulate, compute_delta, has_logw, tail_args, list_args):
        args = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", O="*bf16", LSE="*fp32", DELTA="*fp32")
        args |= dict(DQ_IN="*fp32", DQ=out, LIST="*i32", LOGW="*fp32", ADD_Q="*fp32", stride_kb=n_k * d, stride_kn=d)
        args |= dict(stride_lb=(n // block_m) * list_len, stride_lt=list_len, n_q=n, n_k=n_k, list_len=list_len)
        args |= dict(qk_scale=0.18, sm_scale=0.125, **dq_strides, **tail_args, **list_args[0])
        per_iter = block_sparse.walk_blocks_per_step(block_m, 16, d)
        # as the forward: the dense tail's steps by TMA
        desc_args, desc_rows = descriptors(block_sparse.tma_walk_rows(per_iter, list_len, 16, tail_args["tail_hi"]))
        args |= desc_args
        const = dict(common, BLOCK_M=block_m, KEY_BLOCK=16, PER_ITER=per_iter, HAS_LOGW=has_logw)
        const |= list_args[1]
        const |= dict(ACCUMULATE=accumulate, COMPUTE_DELTA=compute_delta, HAS_ADD=False, EVEN_K=True, N_SUB=1)
        const |= dict(LIST_SLOTS=block_sparse.list_slots(list_len, per_iter))  # (LLSA adds no pooled dq)
        const |= dict(TRANSPOSED=block_sparse.transposed_backward(block_m, d), DESC_ROWS=desc_rows)
        return args, const | dict(HAS_TAIL=tail_args["tail_hi"] > 0, EVEN_TAIL=True)

    def dkdv(query_block, n_k, group, n_split, has_logw, has_add, key_block=16, ds_width=0):
        args = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", LSE="*fp32", DELTA="*fp32", DK="*fp32", DV="*fp32")
        args |= dict(OFFSETS="*i32", ROWS="*i32", LOGW="*fp32", ADD_K="*fp32", ADD_V="*fp32", **dq_strides)
        args |= dict(stride_kb=n_k * d, stride_kn=d, stride_ob=n_k // key_block + 1, stride_rb=n // 2, n_q=n, n_k=n_k)
        # ds_width > 0: the fine level keeping dS for the dq (bf16 tiles; the query blocks' lists of ds_width slots)
        args |= dict(DS="*bf16" if ds_width else "*fp32", DS_LIST="*i32")
        args |= dict(stride_sb=(n // query_block) * max(ds_width, 1), stride_st=max(ds_width, 1), ds_width=ds_width)
        args |= dict(blk_lo=0, csc_lo=0)
        args |= dict(csc_step=group, out_row0=0, out_rows=n_k, qk_scale=0.18, sm_scale=0.125)
        per_iter = block_sparse.walk_blocks_per_step(key_block * group, query_block, d)
        n_sub = block_sparse._n_sub(query_block)
        # q and dO of whole steps of >= 64 rows by TMA
        desc_args, desc_rows = descriptors(query_block // n_sub if per_iter == 1 else 0, ("Q_DESC", "DO_DESC"))
        args |= desc_args
        const = dict(common, QUERY_BLOCK=query_block, KEY_BLOCK=key_block, GROUP=group, PER_ITER=per_iter)
        const |= dict(TRANSPOSED=block_sparse.transposed_backward(key_block * group, d), DESC_ROWS=desc_rows)
        const |= dict(DS_SLOTS=triton.next_power_of_2(ds_width) if ds_width else 0)
        if "ADD_LEVELS" in constexpr_names(block_sparse._dkdv_kernel):  # absent in libraries before it
            # the fine level's pooled adjoint at L = 2: the bank's two levels, pushed down in the epilogue
            args |= dict(add_rows=n // 16 + n // 256)
            const |= dict(ADD_LEVELS=2 if has_add else 1)
        return args, const | dict(N_SPLIT=n_split, HAS_LOGW=has_logw, HAS_ADD=has_add, EVEN_Q=True, N_SUB=n_sub)

    def ds_dq(list_len):  # the fine level's dq from the dS its dk/dv kept, added to the pooled pass's fp32 dq
        args = dict(K="*bf16", DS="*bf16", LIST="*i32", DQ_IN="*fp32", DQ="*bf16", stride_kb=n * d, stride_kn=d)
        args |= dict(stride_lb=(n // 16) * list_len, stride_lt=list_len, n_q=n, n_k=n, list_len=list_len)
        args |= dict(sm_scale=0.125)
        return args, dict(common, QUERY_BLOCK=16, KEY_BLOCK=16, ACCUMULATE=True)

    def grouped_dkdv(group_rows, width):  # the candidate levels' dk/dv by query group (ancestors of 256 queries)
        args = dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", LSE="*fp32", DELTA="*fp32", LIST="*i32")
        args |= dict(LOGW="*fp32", PK="*fp32", PV="*fp32", **dq_strides, stride_kb=bank * d, stride_kn=d)
        args |= dict(stride_lb=(n // group_rows) * width, stride_lg=width, n_q=n, n_k=bank, list_len=width)
        args |= dict(group_rows=group_rows, qk_scale=0.18, sm_scale=0.125)
        const = dict(common, KEY_BLOCK=16, SLOTS=block_sparse.blocks_per_step(16), HAS_LOGW=True, EVEN_Q=True)
        return args, const

    def sum_slots(width):  # each candidate block's per-group partials added
        args = dict(PK="*fp32", PV="*fp32", OFFSETS="*i32", ENTRIES="*i32", DK="*fp32", DV="*fp32")
        args |= dict(stride_ob=bank // 16 + 1, stride_eb=(n // 256) * width, stride_gb=bank * d, stride_gn=d)
        args |= dict(n_entries=(n // 256) * width, blk_lo=0, n_k=bank)
        return args, dict(HEAD_DIM=d, KEY_BLOCK=16)

    def query_walk_constexprs():  # SLA's query-major walks (forward, dq) at 16-row blocks, launch options left out
        options = linear_attention.query_walk_options(d, 16, torch.bfloat16)
        return {key: value for key, value in options.items() if key not in ("num_warps", "num_stages")}

    def sla_dq(k_top, n_neg):  # SLA's dq kernel: 16-row blocks over K critical and n_neg negligible blocks
        p = "*bf16"
        args = dict(Q=p, K=p, V=p, PHI_K=p, DO_S=p, O_S=p, LSE="*fp32", DELTA_S="*fp32", DO_L=p, O_L=p)
        args |= dict(INV_DEN="*fp32", KV_TOTAL="*fp32", Z_TOTAL="*fp32", DELTA_L="*fp32", DQ=p, LIST="*i32")
        args |= dict(NEG="*i32", stride_lb=(n // 16) * k_top)
        args |= dict(stride_lt=k_top, stride_nb=(n // 16) * n_neg, stride_nt=n_neg, n=n, list_len=k_top)
        args |= dict(neg_len=n_neg, qk_scale=0.18, sm_scale=0.125)
        const = query_walk_constexprs()
        slots = dict(LIST_SLOTS=block_sparse.list_slots(k_top, const["PER_ITER"]))
        slots |= dict(NEG_SLOTS=block_sparse.list_slots(n_neg, const["PER_ITER"]))
        return args, const | dict(CHUNK=16, FEATURE="softmax", EXCLUDE=True, **slots)

    def sla_dkdv(n_neg):  # SLA's key-major dk/dv of both branches over the CSCs of the critical and negligible lists
        p = "*bf16"
        args = dict(Q=p, K=p, V=p, PHI_Q=p, PHI_K=p, DO_S=p, LSE="*fp32", DELTA_S="*fp32", DO_L=p, INV_DEN="*fp32")
        args |= dict(DELTA_L="*fp32", D_KV_TOTAL="*fp32", D_Z_TOTAL="*fp32", DK=p, DV=p, OFFSETS="*i32")
        args |= dict(ROWS="*i32", NEG_OFFSETS="*i32", NEG_ROWS="*i32", stride_ob=n // 16 + 1)
        args |= dict(stride_rb=(n // 16) * 32, stride_nob=n // 16 + 1, stride_nrb=(n // 16) * n_neg, n=n)
        args |= dict(qk_scale=0.18, sm_scale=0.125)
        const = {key: value for key, value in query_walk_constexprs().items() if key != "PER_ITER"}
        const |= dict(CHUNK=16, FEATURE="softmax", EXCLUDE=True, HAS_NEG=n_neg > 0)
        return args, const | dict(SCALED_DTYPE=tl.bfloat16)

    def sla_fwd(k_top, n_neg):  # SLA's forward walk: both branches over K critical and n_neg negligible blocks
        p = "*bf16"
        args = dict(Q=p, K=p, V=p, PHI_K=p, KV_TOTAL="*fp32", Z_TOTAL="*fp32", PHI_Q=p, O_S=p, LSE="*fp32", O_L=p)
        args |= dict(INV_DEN="*fp32", LIST="*i32", NEG="*i32", stride_lb=(n // 16) * k_top, stride_lt=k_top)
        args |= dict(stride_nb=(n // 16) * n_neg, stride_nt=n_neg, n=n, list_len=k_top, neg_len=n_neg)
        args |= dict(qk_scale=0.18, empty_row_rel_eps=1e-5, all_scope_eps=1e-5)
        const = {key: value for key, value in query_walk_constexprs().items() if key != "PER_ITER"}
        const |= dict(CHUNK=16, FEATURE="softmax", EXCLUDE=True, EVEN=True)
        const |= dict(LIST_SLOTS=block_sparse.list_slots(k_top, 1))
        return args, const | dict(NEG_SLOTS=block_sparse.list_slots(n_neg, 1))

    def fwd_wide(key_block, n_sub, list_len, tail_args):  # 128-row programs: block_sparse_attention, flash_attention
        args = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", LSE="*fp32", LIST="*i32", LOGW="*fp32", O_INIT="*bf16")
        args |= dict(LSE_INIT="*fp32", stride_kb=n * d, stride_kn=d, stride_vb=n * d, stride_vh=0, stride_vn=d)
        args |= dict(v_heads=1, stride_qb=n * d, stride_qn=d, stride_ob=n * d, stride_oh=0, stride_on=d, out_heads=1)
        args |= dict(stride_lb=(n // 128) * list_len, stride_lt=list_len, n_q=n, n_k=n, list_len=list_len)
        args |= dict(qk_scale=0.18, **tail_args, **no_list_weight[0])
        desc_args, desc_rows = descriptors(key_block // n_sub)  # K and V by TMA
        args |= desc_args
        const = dict(common, BLOCK_M=128, KEY_BLOCK=key_block, PER_ITER=1, HAS_LOGW=False, HAS_INIT=False)
        ids = block_sparse.forward_ids_in_registers(128, key_block // n_sub, d, torch.bfloat16)
        const |= no_list_weight[1] | dict(LIST_SLOTS=block_sparse.list_slots(list_len, 1, ids), DESC_ROWS=desc_rows)
        return args, const | dict(EVEN_K=True, N_SUB=n_sub, HAS_TAIL=tail_args["tail_hi"] > 0, EVEN_TAIL=True)

    # llsa.PARTIAL_DTYPE = "float32": the fine pass's partial output in fp32, the pooled pass's start values read from
    # it; "input" (LLSA's default): in bf16 (flat, as the fp32 one)
    fwd_fine = fwd(16, n, 8, "*fp32", False, False, no_tail, no_list_weight)
    fwd_fine_bf16 = fwd(16, n, 8, "*bf16", False, False, no_tail, no_list_weight)
    fwd_fine_bf16[0].update(flat_out)
    fwd_pooled = fwd(64, bank, 8, "*bf16", True, False, tail, pooled_lists)
    dq_pooled = dq(64, bank, 8, "*fp32", False, True, False, tail, pooled_lists)
    dq_fine = dq(16, n, 8, "*bf16", True, False, False, no_tail, no_list_weight)
    rows = [
        ("fwd fine (16-row blocks)", block_sparse._fwd_kernel, *fwd_fine),
        ("fwd fine, partial in bf16", block_sparse._fwd_kernel, *fwd_fine_bf16),
        ("fwd pooled (64-row tiles + tail)", block_sparse._fwd_kernel, *fwd_pooled),
        (
            "fwd pooled, start values in bf16",
            block_sparse._fwd_kernel,
            dict(fwd_pooled[0], O_INIT="*bf16"),
            fwd_pooled[1],
        ),
        ("dq pooled (64-row tiles + tail)", block_sparse._dq_kernel, *dq_pooled),
        ("dq fine", block_sparse._dq_kernel, *dq_fine),
        # block_sparse_attention over blocks of 128 (K = 64, 128 keys per step) and the dense flash_attention (every
        # key as the tail, in steps of 64; its tiles are 128-key blocks walked in two steps, as its launcher passes)
        ("fwd bsa 128 (K = 64)", block_sparse._fwd_kernel, *fwd_wide(128, 1, 64, no_tail)),
        (
            "fwd dense 128 (tail)",
            block_sparse._fwd_kernel,
            *fwd_wide(128, 2, 0, dict(tail_lo=0, tail_hi=n, tail_bias=0.0)),
        ),
        ("dkdv fine (16-key blocks)", block_sparse._dkdv_kernel, *dkdv(16, n, 1, 1, False, True)),
        ("dkdv fine keeping dS", block_sparse._dkdv_kernel, *dkdv(16, n, 1, 1, False, True, ds_width=8)),
        ("dq fine from the kept dS", block_sparse._ds_dq_kernel, *ds_dq(8)),
        ("dkdv pooled candidates (by query group)", block_sparse._grouped_dkdv_kernel, *grouped_dkdv(256, 8)),
        ("dkdv pooled candidates, partials summed", block_sparse._sum_slots_kernel, *sum_slots(8)),
        ("dkdv pooled coarsest (64 keys, split)", block_sparse._dkdv_kernel, *dkdv(64, bank, 4, 21, True, False)),
        # flash_attention's (and block_sparse_attention's over blocks of 128) key-major dk/dv: 128-key programs
        ("dkdv dense 128", block_sparse._dkdv_kernel, *dkdv(128, n, 1, 1, False, False, key_block=128)),
        # SLA at 256^2 (K = 32 critical blocks, a 64-slot negligible list): its own list-walking kernels
        ("sla dq (16-row blocks)", sla_triton._sla_dq_kernel, *sla_dq(32, 64)),
        ("sla dkdv (16-key blocks)", sla_triton._sla_dkdv_kernel, *sla_dkdv(0)),
        ("sla dkdv + negligible walk", sla_triton._sla_dkdv_kernel, *sla_dkdv(64)),
        ("sla fwd (16-row blocks)", sla_triton._sla_fwd_kernel, *sla_fwd(32, 0)),
        ("sla fwd + negligible walk", sla_triton._sla_fwd_kernel, *sla_fwd(32, 64)),
    ]
    for label, fn, _, const in rows:  # every constexpr of the kernel given, no other
        want = constexpr_names(fn)
        assert set(const) == want, (label, sorted(want ^ set(const)))
    return rows


def launch_warps(fn, const: dict) -> int:
    """The warps the launchers give an attention kernel's program without autotuning (block_sparse.launched_program;
    SLA's walks: one warp for 16-row programs, else linear_attention.walk_warps)."""
    d = const["HEAD_DIM"]
    if fn is block_sparse._fwd_kernel:  # its keys per step decide (block_sparse.forward_warps)
        return block_sparse.forward_warps(const["BLOCK_M"], const["KEY_BLOCK"] // const["N_SUB"], d, torch.bfloat16)
    if fn in block_sparse.PROGRAMS:
        return block_sparse.launched_program(fn, const, torch.bfloat16)[0]
    if fn is block_sparse._sum_slots_kernel:
        return block_sparse.SUM_SLOTS_WARPS
    if fn in (sla_triton._sla_fwd_kernel, sla_triton._sla_dq_kernel, sla_triton._sla_dkdv_kernel):
        return 1 if linear_attention.one_warp_walk(const["BLOCK"], d) else linear_attention.walk_warps(d)
    raise ValueError(f"launch_warps: no launch rule for {fn.__name__}")


def launch_register_cap(fn, const: dict) -> int | None:
    """The ``maxnreg`` the launchers give an attention kernel's program (block_sparse.launched_program), bf16
    inputs."""
    return block_sparse.launched_program(fn, const, torch.bfloat16)[1] if fn in block_sparse.PROGRAMS else None


def joint_variants() -> list[tuple[str, object, dict, dict, dict]]:
    """(label, kernel, run-time args, constexprs, launch) of adaln_joint's backward: DiT-S, -B and -XL widths, the
    joint before the attention (no branch) and after it, recomputing the LayerNorm's statistics and reading the
    forward's (``BACKWARD_FROM_STATS``), each launch of ``backward_launches``."""
    variants = []
    for dim in (384, 768, 1152):
        for has_branch, has_stats in itertools.product((False, True), (False, True)):
            args = {name: "*bf16" for name in ("dh_ptr", "dres_ptr", "x_ptr", "branch_ptr", "gate_ptr", "scale_ptr")}
            args |= dict(dx_ptr="*bf16", dbranch_ptr="*bf16", partial_ptr="*fp32", n=65536, dim=dim, programs=264)
            args |= dict(mean_ptr="*fp32", rstd_ptr="*fp32", eps=1e-6)
            for launch in adaln_joint.backward_launches(dim):
                launch = dict(launch)
                const = dict(HAS_BRANCH=has_branch, HAS_DRES=True, DIM_PAD=triton.next_power_of_2(dim))
                const |= dict(HAS_STATS=has_stats)
                const["BLOCK_ROWS"] = launch.pop("BLOCK_ROWS")
                const["NUM_STAGES"] = launch.pop("NUM_STAGES")
                form = (" branch" if has_branch else "") + (" stats" if has_stats else "")
                label = f"joint d={dim}{form} rows/step={const['BLOCK_ROWS']}"
                variants.append((label, adaln_joint._joint_bwd_kernel, args, const, launch))
    return variants


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kernels", nargs="+", default=["topk", "attention"], choices=["topk", "attention", "joint"])
    parser.add_argument("--kernels-from", metavar="DIR", help="compile another kernels/ folder (e.g. a variant's)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--warps",
        nargs="+",
        default=["launch"],
        help="attention kernels: warps per program, or 'launch' for the warps its launcher gives it (default)",
    )
    parser.add_argument("--stages", type=int, nargs="+", default=[2], help="attention kernels: pipeline stages")
    parser.add_argument("--dump", default=None, help="folder for the PTX / TTGIR / SASS of each variant")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kernel_compile_report.py compiles for sm_90: run it without TRITON_INTERPRET")
    rows = []
    if "attention" in args.kernels:
        for label, fn, run_args, const in attention_variants(args.head_dim):
            signature, attrs = launch_variant(fn, run_args, const)
            for w in args.warps:
                # the launch's own warps come with its register cap, if any
                warps, cap = (
                    (launch_warps(fn, const), launch_register_cap(fn, const)) if w == "launch" else (int(w), None)
                )
                for stages in args.stages:
                    row = {"kernel": label, "head_dim": args.head_dim, "stages": stages, "maxnreg": cap or "-"}
                    name = f"{fn.__name__}_{label.split(' (')[0].replace(' ', '_')}_w{warps}_s{stages}"
                    row.update(compile_one(fn, signature, const, warps, args.dump, name, attrs, stages, cap))
                    rows.append(row)
                    print(row, flush=True)
    if "joint" in args.kernels:
        for label, fn, run_args, const, launch in joint_variants():
            signature, attrs = launch_variant(fn, run_args, const)
            row = {"kernel": label, "head_dim": "-", "stages": const["NUM_STAGES"], "maxnreg": "-"}
            # every launch its own --dump files (a label holds several: warps, stages)
            name = label.replace(" ", "_").replace("=", "").replace("/", "_")
            name += f"_w{launch['num_warps']}_s{const['NUM_STAGES']}"
            row.update(compile_one(fn, signature, const, launch["num_warps"], args.dump, name, attrs))
            rows.append(row)
            print(row, flush=True)
    if "topk" in args.kernels:
        rows += topk_rows(args)
    print(f"\ntriton {triton.__version__}, target sm_90\n")
    print(markdown_table(rows))


def topk_rows(args) -> list[dict]:
    """The selection kernels' rows (see the module docstring)."""
    rows = []
    variants = [
        (f"one-shot cand={c}", one_shot_variant(args.head_dim, c))
        for c in (64, 256, 512, 1024)
        if c * args.head_dim <= topk._MAX_CAND_X_DIM
    ]
    variants.append(("one-shot children cand=128", one_shot_variant(args.head_dim, 128, children=True)))
    variants += [
        (f"streaming slots={s}", streaming_variant(args.head_dim, s))
        for s in (topk._STREAM_MIN_SLOTS, 32, topk.STREAM_MAX_K)
    ]
    variants += [
        (f"row select n={b} cap={topk._row_cap(k)}", row_select_variant(b, k))
        for b in (1024, 4096, 16384)
        for k in (32, 64, 128)
    ]
    variants += [(f"rescore k={k}", rescore_variant(4096, k, args.head_dim)) for k in (8, 20, 32, 64)]
    for label, (fn, run_args, const, options) in variants:
        signature, attrs = launch_variant(fn, run_args, const)
        row = {"kernel": label, "head_dim": args.head_dim, "stages": options.get("num_stages", "default")}
        row["maxnreg"] = options.get("maxnreg", "-")
        name = label.replace(" ", "_").replace("=", "")
        warps, stages, cap = options["num_warps"], options.get("num_stages"), options.get("maxnreg")
        row.update(compile_one(fn, signature, const, warps, args.dump, name, attrs, stages, cap))
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    main()

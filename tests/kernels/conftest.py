"""Kernel tests: without CUDA, run the Triton kernels in the interpreter; with CUDA, no autotuning.

TRITON_INTERPRET must be set before any @triton.jit function is created (i.e. before pixdit.kernels is imported);
pytest loads this file before the test modules of tests/ that sort after "kernels/".
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# GPU tests: one fixed launch config instead of autotuning every tile shape (saves minutes of compiling)
os.environ.setdefault("PIXDIT_KERNELS_AUTOTUNE", "0")

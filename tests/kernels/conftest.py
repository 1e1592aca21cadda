"""Kernel tests: without CUDA, run the Triton kernels in the interpreter; with CUDA, no autotuning.

TRITON_INTERPRET must be set before any @triton.jit function is created (i.e. before pixdit.kernels is imported);
pytest loads this file before the test modules of tests/ that sort after "kernels/".
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# GPU tests: one fixed launch config instead of autotuning every tile shape (saves minutes of compiling)
os.environ.setdefault("PIXDIT_KERNELS_AUTOTUNE", "0")


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """GPU runs share one card between pytest-xdist processes: after each test its process gives the blocks that
    PyTorch's allocator keeps cached back to the card, so that the card holds what the running tests use rather than
    every process's largest test so far (8 processes on an 80 GB card ran out of memory that way)."""
    yield
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()

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


class _RecordedKernel:
    """A kernel whose launches (``kernel[grid](...)``) append ``(name, grid)`` to ``seen``, then run."""

    def __init__(self, kernel, name, seen):
        self.kernel, self.name, self.seen = kernel, name, seen

    def __getitem__(self, grid):
        self.seen.append((self.name, tuple(grid)))
        return self.kernel[grid]


@pytest.fixture
def record_launches(monkeypatch):
    """``record_launches(module, *names)``: the list into which each launch of ``module.<name>`` appends its name and
    grid from then on (the test's monkeypatch undoes it): which kernel a call took, and how many programs."""

    def record(module, *names):
        seen = []
        for name in names:
            monkeypatch.setattr(module, name, _RecordedKernel(getattr(module, name), name, seen))
        return seen

    return record

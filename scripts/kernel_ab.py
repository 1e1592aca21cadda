"""A/B of kernel versions in one GPU session: ``--kernels-from DIR`` in the bench scripts runs them with the kernel
library in DIR (a copy of another commit's ``kernels/``, e.g. ``git archive HEAD~1 kernels | tar -x -C /tmp/base``)
in place of the installed ``pixdit.kernels``. Must run before anything imports ``pixdit.kernels``.
``load_kernels_as(DIR, name)`` loads DIR next to the installed library instead, under another module name, so that
one process can interleave the two versions (scripts/ab_attention.py, scripts/ab_qk_norm.py). ``launch_breakdown(lib,
fn)`` times ``fn()``'s kernels by launch: each Triton launch of the library named by its block constants and grid;
``timer(device)`` and ``rel_diff(a, b)`` the A/B scripts' timing and comparison; ``random_block_order`` the random
block lists of the block-sparse benchmarks."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pkgutil
import statistics
import sys


def load_kernels_as(directory: str, name: str):
    """Import the kernel library in ``directory`` as the package ``name`` (its modules import each other relatively,
    so any package name works) and return it."""
    init = os.path.join(directory, "__init__.py")
    if not os.path.isfile(init):
        sys.exit(f"--kernels-from {directory}: no __init__.py there (give the kernels/ folder of another checkout)")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[directory])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def use_kernels_from(directory: str) -> None:
    if "pixdit.kernels" in sys.modules:
        sys.exit("--kernels-from must be applied before pixdit.kernels is imported")
    import pixdit  # noqa: F401  (the parent package must exist first)

    load_kernels_as(directory, "pixdit.kernels")
    print(f"# kernels from {os.path.abspath(directory)}")


def apply_from_argv(argv: list[str]) -> None:
    """Call at the top of a bench script, before any pixdit import: applies ``--kernels-from DIR`` if given (the
    script's argparse still declares the flag, for --help and validation)."""
    for i, arg in enumerate(argv):
        if arg == "--kernels-from" and i + 1 < len(argv):
            use_kernels_from(argv[i + 1])
        elif arg.startswith("--kernels-from="):
            use_kernels_from(arg.split("=", 1)[1])


def timer(device: str):
    """``time_ms(fn, rep)``: on CUDA the median of ``do_bench`` over ``rep`` ms after warm-up; elsewhere one call's
    wall time (the CPU smoke runs of the A/B scripts)."""
    if device.startswith("cuda"):
        import triton.testing

        return lambda fn, rep: triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
    import time

    def wall_ms(fn, rep):
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return wall_ms


def interleaved_ms(forms: dict, rounds: int, device: str = "cuda", rep: int = 200) -> dict:
    """Each form's (a callable's) time in ms: the median over ``rounds`` of its ``timer`` time (``rep`` ms of
    ``do_bench`` on CUDA), the forms timed in turn, in reverse order every other round."""
    time_ms, times = timer(device), {name: [] for name in forms}
    for round_ in range(rounds):
        for name in list(forms) if round_ % 2 == 0 else list(forms)[::-1]:
            times[name].append(time_ms(forms[name], rep))
    return {name: statistics.median(t) for name, t in times.items()}


def back_to_back_ms(fn, calls: int, device: str) -> tuple[float, float]:
    """``fn()`` ``calls`` times back to back after two warm-up calls, one synchronisation at the end: (wall ms per
    call, host ms per call to issue them). Wall above host: the GPU is the bound; equal: the host is."""
    import time

    import torch

    cuda = device.startswith("cuda")
    for _ in range(2):
        fn()
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    if cuda:
        torch.cuda.synchronize()
    end = time.perf_counter()
    return (end - start) * 1e3 / calls, (issued - start) * 1e3 / calls


def random_block_order(shape, block: int, device, seed: int = 0):
    """Random block lists of the block-sparse benchmarks (bench_attention.py's bsa and flex rows, ab_attention.py's
    bsa cases): per (batch, head, query tile of ``block`` rows of a ``[b, h, n, d]`` shape) every key block in a
    random order, int32 ``[b, h, n / block, n / block]``; the first K of each row are that tile's list. Seeded, so
    every library and every round walks the same lists."""
    import torch

    b, h, n = shape[:3]
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.rand(b, h, n // block, n // block, device=device, generator=g).argsort(-1).to(torch.int32)


def rel_diff(a, b) -> float:
    """The largest difference of two versions' tensors relative to ``b``'s largest value (0 = bit for bit; bf16
    rounding is ~4e-3)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


# The constants that tell one launch of a kernel from another (its program's rows, step and split), where set.
LAUNCH_CONSTANTS = (
    "BLOCK_M",
    "QUERY_BLOCK",
    "KEY_BLOCK",
    "GROUP",
    "SLOTS",
    "PER_ITER",
    "N_SPLIT",
    "HAS_TAIL",
    "HAS_INIT",
)


class _LabelledKernel:
    """A launched Triton kernel that appends a label to ``labels`` at every launch (``kernel[grid](...)``)."""

    def __init__(self, kernel, name: str, labels: list[tuple[str, str]]):
        self.kernel, self.name, self.labels = kernel, name, labels

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            words = [self.name] + [f"{k}={kwargs[k]}" for k in LAUNCH_CONSTANTS if kwargs.get(k) not in (None, False)]
            words += ["grid", str(tuple(grid)) if isinstance(grid, tuple) else "(function)"]
            self.labels.append((self.name, " ".join(words)))
            return launch(*args, **kwargs)

        return run

    def __getattr__(self, attr):
        return getattr(self.kernel, attr)


@contextlib.contextmanager
def labelled_launches(lib):
    """While active, every Triton launch of the kernel library ``lib`` (a loaded ``pixdit.kernels``) appends
    ``(kernel name, label)`` to the yielded list; the label names the block constants it was launched with
    (``LAUNCH_CONSTANTS``) and its grid, e.g. ``_fwd_kernel BLOCK_M=16 KEY_BLOCK=16 PER_ITER=1 grid (4096, 12)``.
    The launchers look their kernels up as module globals at call time, so those globals are wrapped (only the
    launched ``*_kernel`` functions: the jit helpers are called inside kernels) and restored on exit."""
    import triton

    kinds = (triton.runtime.jit.JITFunction, triton.runtime.autotuner.Autotuner)
    kept = getattr(importlib.import_module(f"{lib.__name__}.common"), "KeptPicks", None)  # absent in older libraries
    kinds += (kept,) if kept is not None else ()
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime.interpreter import InterpretedFunction

        kinds += (InterpretedFunction,)
    labels: list[tuple[str, str]] = []
    wrapped = []
    for info in pkgutil.iter_modules(lib.__path__):
        module = importlib.import_module(f"{lib.__name__}.{info.name}")
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, kinds):
                fn = obj
                while hasattr(fn, "fn"):  # KeptPicks -> Autotuner -> JITFunction -> the Python function
                    fn = fn.fn
                if fn.__name__.endswith("_kernel"):
                    wrapped.append((module, attr, obj))
                    setattr(module, attr, _LabelledKernel(obj, fn.__name__, labels))
    try:
        yield labels
    finally:
        for module, attr, obj in wrapped:
            setattr(module, attr, obj)


def launch_breakdown(lib, fn, calls: int = 10, warmup: int = 3) -> dict[str, float]:
    """``pixdit.report.kernel_breakdown`` by launch (GPU): milliseconds per call of ``fn()`` for every labelled
    Triton launch of ``lib`` (``labelled_launches``; equal labels add up) and every other kernel by name. The
    profiler's kernels are matched to the launches in order, kernel by kernel."""
    from pixdit.report import kernel_events

    for _ in range(warmup):  # compilation and autotuning happen here, not among the matched launches
        fn()
    with labelled_launches(lib) as labels:
        events = kernel_events(fn, calls, warmup=0)
    queue: dict[str, list[str]] = {}
    for name, label in labels:
        queue.setdefault(name, []).append(label)
    ran = {name: sum(1 for event, _ in events if event == name) for name in queue}
    launched = {name: len(labels) for name, labels in queue.items()}
    if ran != launched:  # e.g. autotuning inside the profiled calls: the kernels would be matched to wrong launches
        raise RuntimeError(f"launch_breakdown: the profiler saw {ran} kernels for {launched} launches")
    per_label: dict[str, float] = {}
    for name, ms in events:
        label = queue[name].pop(0) if name in queue else name
        per_label[label] = per_label.get(label, 0.0) + ms / calls
    return per_label

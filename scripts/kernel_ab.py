"""A/B of kernel versions in one GPU session: ``--kernels-from DIR`` in the bench scripts runs them with the kernel
library in DIR (a copy of another commit's ``kernels/``, e.g. ``git archive HEAD~1 kernels | tar -x -C /tmp/base``)
in place of the installed ``pixdit.kernels``. Must run before anything imports ``pixdit.kernels``.
``load_kernels_as(DIR, name)`` loads DIR next to the installed library instead, under another module name, so that
one process can interleave the two versions (scripts/ab_attention.py)."""

from __future__ import annotations

import importlib.util
import os
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

"""``common.KeptPicks``: the autotuned kernels' launcher that keeps Triton's pick per key.

Any configuration computes the same thing, so a wrong pick would not show in an output: these tests watch which
configuration each launch gets and when Triton's ``Autotuner.run`` is consulted.
"""

import pytest
import torch
import triton
import triton.language as tl

from pixdit.kernels.common import KeptPicks

CUDA = torch.cuda.is_available()


@triton.jit
def _scaled_copy_kernel(X, Y, n, factor, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Y + offs, x * factor, mask=offs < n)


CONFIGS = [triton.Config({"BLOCK": block}, num_warps=warps) for block in (32, 64) for warps in (1, 2)]


def _tuner_and_launches(monkeypatch, fastest):
    """A real ``triton.autotune`` over CONFIGS, keyed by ``ROWS``, whose timing says that ``fastest(dtype, rows)``
    (a config) wins and whose kernel launches are recorded instead of run: (the kept launcher, its Triton autotuner,
    the configs' kwargs of each launch, the keys Triton's ``run`` was consulted for)."""
    tuner = triton.autotune(configs=CONFIGS, key=["ROWS"])(_scaled_copy_kernel)
    launches, consulted = [], []

    def rows(args, kwargs):  # ROWS, by name or by position
        return kwargs["ROWS"] if "ROWS" in kwargs else args[4]

    def bench(*args, config, **meta):  # Triton's timing of one config, made up: ``fastest`` wins
        return [0.0 if config is fastest(args[0].dtype, rows(args, meta)) else 1.0]

    def record(*args, grid, warmup, **kwargs):
        launches.append({k: kwargs[k] for k in ("BLOCK", "num_warps")})

    tuner_run = tuner.run

    def consult(*args, **kwargs):
        consulted.append((args[0].dtype, rows(args, kwargs)))
        return tuner_run(*args, **kwargs)

    monkeypatch.setattr(tuner, "_bench", bench)
    monkeypatch.setattr(tuner.fn, "run", record)
    monkeypatch.setattr(tuner, "run", consult)
    return KeptPicks(tuner, ["ROWS"]), tuner, launches, consulted


def test_each_launch_gets_tritons_pick_for_its_key_and_triton_is_consulted_once_per_key(monkeypatch):
    """The pick depends on the key argument and on every tensor's dtype; a kept pick must be the one Triton
    picked for that key (a key without the dtypes would launch fp16 with fp32's pick), and a repeated key must not
    go through Triton's run again (a launcher that never keeps would)."""
    table = {
        (torch.float32, 1): CONFIGS[0],
        (torch.float16, 1): CONFIGS[3],
        (torch.float32, 2): CONFIGS[2],
        (torch.float16, 2): CONFIGS[1],
    }
    kept, tuner, launches, consulted = _tuner_and_launches(monkeypatch, lambda dtype, rows: table[dtype, rows])
    calls = [(torch.float32, 1), (torch.float16, 1), (torch.float32, 1), (torch.float32, 2)] * 2
    calls += [(torch.float16, 2), (torch.float16, 1), (torch.float16, 2)]
    for dtype, rows in calls:
        x = torch.zeros(100, dtype=dtype)
        kept[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](x, torch.empty_like(x), 100, 2.0, ROWS=rows)
    want = [{"BLOCK": table[c].kwargs["BLOCK"], "num_warps": table[c].num_warps} for c in calls]
    assert launches == want
    assert consulted == [(torch.float32, 1), (torch.float16, 1), (torch.float32, 2), (torch.float16, 2)]
    assert len(tuner.cache) == 4


def test_key_passed_by_position_and_another_dtype_in_a_later_argument(monkeypatch):
    """The key argument given by position counts as by name, and the output's dtype counts as the input's does."""
    kept, _, launches, consulted = _tuner_and_launches(monkeypatch, lambda dtype, rows: CONFIGS[rows])
    x = torch.zeros(100)
    for rows, y_dtype in [(1, torch.float32), (1, torch.float32), (2, torch.float32), (1, torch.float16)]:
        kept[(4,)](x, torch.empty(100, dtype=y_dtype), 100, 2.0, rows)
    assert [launch["num_warps"] for launch in launches] == [2, 2, 1, 2]
    assert consulted == [(torch.float32, 1), (torch.float32, 2), (torch.float32, 1)]


def test_warmup_calls_and_pre_hooks_go_through_triton(monkeypatch):
    """A warm-up (compile only) keeps nothing; a configuration with a pre-hook is never launched directly (Triton
    runs the hook on every launch)."""
    kept, tuner, launches, consulted = _tuner_and_launches(monkeypatch, lambda dtype, rows: CONFIGS[0])
    x = torch.zeros(100)
    kept.run(x, x, 100, 2.0, grid=(4,), warmup=True, ROWS=1)
    kept[(4,)](x, x, 100, 2.0, ROWS=1)
    kept[(4,)](x, x, 100, 2.0, ROWS=1)
    assert len(consulted) == 2 and len(launches) == 3
    hooked = triton.Config({"BLOCK": 32}, num_warps=1, pre_hook=lambda args: None)
    monkeypatch.setattr(tuner, "configs", [hooked])
    for _ in range(2):
        kept[(4,)](x, x, 100, 2.0, ROWS=3)
    assert consulted[2:] == [(torch.float32, 3)] * 2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA: Triton times configurations on the GPU only")
def test_kept_picks_launch_the_kernel_on_the_gpu_as_tritons_autotuner_does():
    """Real timing and launches: every call right, and what is kept is what Triton's cache holds for the key
    (the grid reads the kept BLOCK)."""
    tuner = triton.autotune(configs=CONFIGS, key=["ROWS"])(_scaled_copy_kernel)
    kept = KeptPicks(tuner, ["ROWS"])
    for dtype in (torch.float32, torch.float16, torch.float32):
        for n in (100, 1000):
            x = torch.randn(n, device="cuda").to(dtype)
            y = torch.empty_like(x)
            kept[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n, 2.0, ROWS=n)
            torch.testing.assert_close(y, x * 2, rtol=0, atol=0)
    assert len(kept._picks) == 4 and len(tuner.cache) == 4
    assert sorted(map(repr, kept._picks.values())) == sorted(repr(c.all_kwargs()) for c in tuner.cache.values())

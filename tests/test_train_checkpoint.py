"""A kill or crash in the middle of a checkpoint write never destroys the last good checkpoint.

.venv/bin/python -m pytest tests/test_train_checkpoint.py
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from pixdit.callbacks import AtomicCheckpointIO


def _checkpoint(value: float) -> dict:
    return {"state_dict": {"w": torch.full((256, 256), value)}, "global_step": int(value)}


# A child process that starts writing a second checkpoint over `path` and is SIGKILLed half-way through the write
# (torch.save is replaced by one that writes part of the bytes, flushes them, then kills the process: no cleanup runs).
KILL_MID_WRITE = textwrap.dedent("""
    import io, os, signal, sys, torch
    path, mode = sys.argv[1], sys.argv[2]
    def torch_save_then_die(obj, f):
        buffer = io.BytesIO()
        real_save(obj, buffer)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    real_save = torch.save
    checkpoint = {"state_dict": {"w": torch.full((256, 256), 2.0)}, "global_step": 2}
    if mode == "atomic":
        import pixdit.checkpoint
        pixdit.checkpoint.torch.save = torch_save_then_die
        pixdit.checkpoint.atomic_torch_save(checkpoint, path)
    else:  # what a plain `torch.save(checkpoint, path)` does when killed mid-write
        with open(path, "wb") as f:
            torch_save_then_die(checkpoint, f)
""")


def _kill_mid_write(path, mode):
    result = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, str(path), mode], capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr


def test_kill_mid_write_keeps_last_good_checkpoint(tmp_path):
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(1.0), path)
    _kill_mid_write(path, "atomic")
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 1 and torch.equal(loaded["state_dict"]["w"], torch.full((256, 256), 1.0))
    # The next save succeeds and replaces it.
    io.save_checkpoint(_checkpoint(3.0), path)
    assert io.load_checkpoint(path)["global_step"] == 3


def test_plain_write_would_be_destroyed(tmp_path):
    """The same kill against a plain in-place write corrupts the file: the test above can fail."""
    path = tmp_path / "last.ckpt"
    torch.save(_checkpoint(1.0), path)
    _kill_mid_write(path, "plain")
    with pytest.raises(Exception):  # noqa: B017 (any failure to read the file is what this test shows)
        torch.load(path, weights_only=False)


def test_exception_mid_write_cleans_up(tmp_path, monkeypatch):
    io = AtomicCheckpointIO()
    path = tmp_path / "checkpoints" / "step=10.ckpt"
    io.save_checkpoint(_checkpoint(1.0), path)

    def failing_save(obj, f):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr("pixdit.checkpoint.torch.save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        io.save_checkpoint(_checkpoint(2.0), path)
    monkeypatch.undo()
    assert io.load_checkpoint(path)["global_step"] == 1
    assert os.listdir(path.parent) == ["step=10.ckpt"]  # no temporary file left behind


def test_atomic_write_replaces_durably_or_not_at_all(tmp_path, monkeypatch):
    """pixdit.files.atomic_write (every write-then-rename site uses it): the new bytes appear under the name only
    after the file and then its directory were fsync'ed; an error inside the block leaves the old file and no
    temporary file; the file gets the usual permissions (a 0600 temporary file would hide shared data)."""
    import stat

    from pixdit.files import atomic_write, write_json

    path = tmp_path / "out" / "metrics.json"
    write_json(path, {"fid": 1.0})
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), path.read_text()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    with atomic_write(path, "w") as f:
        f.write('{"fid": 2.0}\n')
    # file fsync'ed while the old contents were still under the name; then the directory, after the rename
    assert synced == [(False, '{\n "fid": 1.0\n}\n'), (True, '{"fid": 2.0}\n')]

    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_write(path) as f:
            f.write(b"partial")
            raise RuntimeError("interrupted")
    assert path.read_text() == '{"fid": 2.0}\n' and os.listdir(path.parent) == ["metrics.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def _tiny_module_checkpoint(step: int) -> tuple:
    from pixdit.module import DiffusionModule

    torch.manual_seed(0)
    module = DiffusionModule(
        model={"name": "DiT-T", "hidden_size": 32, "depth": 1, "num_heads": 2, "patch_size": 2, "zero_init": False},
        image_size=8,
    )
    with torch.no_grad():  # EMA weights that differ from the raw ones, so the test sees which were loaded
        for p in module.ema.model.parameters():
            p.add_(1.0)
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": step}
    return module, checkpoint


def test_ema_artifact_is_written_loaded_and_removed_with_its_checkpoint(tmp_path):
    """Next to X.ckpt the writer puts X.ema.pt (EMA weights + model config, loadable with weights_only=True);
    load_generator rebuilds the sampling model from it alone; removing the checkpoint removes it."""
    from pixdit.module import load_generator

    module, checkpoint = _tiny_module_checkpoint(step=7)
    io = AtomicCheckpointIO()
    io.save_checkpoint(checkpoint, tmp_path / "step=7.ckpt")
    artifact = torch.load(tmp_path / "step=7.ema.pt", weights_only=True)
    assert artifact["format"] == "pixdit-ema" and artifact["global_step"] == 7
    assert artifact["config"]["image_size"] == [8, 8] and artifact["config"]["model"]["hidden_size"] == 32
    assert artifact["state_dict"].keys() == module.model.state_dict().keys()

    (tmp_path / "step=7.ckpt").unlink()  # the artifact alone is enough for sampling
    model, flow, weights = load_generator(tmp_path / "step=7.ckpt")
    assert weights.path == tmp_path / "step=7.ema.pt" and weights.source == "ema" and weights.global_step == 7
    x, t = torch.randn(2, 3, 8, 8), torch.tensor([100.0, 900.0])
    with torch.no_grad():
        assert torch.equal(model(x, t), module.ema.model(x, t))
    io.save_checkpoint(checkpoint, tmp_path / "step=7.ckpt")
    io.remove_checkpoint(tmp_path / "step=7.ckpt")  # what ModelCheckpoint(save_top_k=...) calls
    assert os.listdir(tmp_path) == []


def test_checkpoint_without_artifact_loads_raw_or_ema_weights_and_old_pickles_with_a_warning(tmp_path):
    """Runs from before the artifact: the full checkpoint is read (EMA or raw weights as asked); one that needs
    pickle (weights_only=True refuses it) still loads, with a warning."""
    import argparse

    from pixdit.checkpoint import load_weights

    module, checkpoint = _tiny_module_checkpoint(step=3)
    torch.save(checkpoint, tmp_path / "last.ckpt")
    ema, raw = load_weights(tmp_path / "last.ckpt"), load_weights(tmp_path / "last.ckpt", use_ema=False)
    assert (ema.source, raw.source, ema.path, ema.global_step) == ("ema", "raw", tmp_path / "last.ckpt", 3)
    name = next(name for name, _ in module.model.named_parameters())
    assert torch.equal(raw.state_dict[name], module.model.state_dict()[name])
    assert torch.equal(ema.state_dict[name], module.ema.model.state_dict()[name])
    assert not torch.equal(ema.state_dict[name], raw.state_dict[name])
    torch.save({**checkpoint, "args": argparse.Namespace(lr=1e-4)}, tmp_path / "old.ckpt")
    with pytest.warns(UserWarning, match="weights_only=False"):
        old = load_weights(tmp_path / "old.ckpt")
    assert old.source == "ema" and old.config["image_size"] == [8, 8]

"""Shard writer, quickstart builder and ShardDataModule: pixels, rank/worker split, corrupt samples, exact resume.

Images in these tests encode their own identity in their pixels (R + 256*G of a flat colour), so every test can
tell exactly which samples a loader delivered, independently of the loader's code.
"""

import json
import warnings

import numpy as np
import pytest
import torch

from pixdit.data.datamodule import ShardDataModule
from pixdit.data.imageops import encode_image
from pixdit.data.quickstart import make_quickstart_dataset
from pixdit.data.shards import (
    ShardWriter,
    read_manifest,
    sha256_of_file,
    shard_problem,
    verify_checksums,
    write_manifest,
)
from pixdit.errors import PixditError

RES = 8


def identity_image(index: int) -> np.ndarray:
    pixels = np.zeros((RES, RES, 3), np.uint8)
    pixels[..., 0], pixels[..., 1], pixels[..., 2] = index % 256, index // 256, 77
    return pixels


def identities(batch) -> list[int]:
    pixels = torch.round((batch["image"] + 1) * 127.5).to(torch.int64)
    return (pixels[:, 0, 0, 0] + 256 * pixels[:, 1, 0, 0]).tolist()


def make_dataset(root, counts_per_shard, val=0, labels=False):
    """Shards with the given sample counts (identity images 0..N-1, in order) + val split + manifest."""
    splits, index = {}, 0
    for split, counts in (("train", counts_per_shard), ("val", [val] if val else [])):
        shards = []
        for shard_index, count in enumerate(counts):
            with ShardWriter(root, split, maxcount=max(count, 1), start_shard=shard_index) as writer:
                for _ in range(count):
                    label = index % 3 if labels else None
                    writer.write(f"{index:08d}", encode_image(identity_image(index)), "png", label=label)
                    index += 1
            shards += writer.shards
        if counts:
            splits[split] = {
                "count": sum(s["count"] for s in shards),
                "shards": shards,
                "skipped_count": 0,
                "skipped": [],
            }
    write_manifest(
        root,
        resolution=RES,
        image_format="png",
        splits=splits,
        source="test",
        classes=["a", "b", "c"] if labels else None,
    )
    return root


def epoch_samples(dm):
    return [i for batch in dm.train_dataloader() for i in identities(batch)]


def test_writer_manifest_checksums_and_atomic_names(tmp_path):
    make_dataset(tmp_path, [5, 5, 2], val=3)
    manifest = read_manifest(tmp_path)
    assert manifest["counts"] == {"train": 12, "val": 3}
    assert [s["name"] for s in manifest["splits"]["train"]["shards"]] == [
        "train-000000.tar",
        "train-000001.tar",
        "train-000002.tar",
    ]
    assert [s["count"] for s in manifest["splits"]["train"]["shards"]] == [5, 5, 2]
    assert not list(tmp_path.glob("*.tmp"))
    assert verify_checksums(tmp_path) == []
    shard = tmp_path / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:-10] + b"x" * 10)
    assert verify_checksums(tmp_path) == ["train-000001.tar"]


def test_writer_is_deterministic_and_splits_at_maxcount(tmp_path):
    for run in ("a", "b"):
        with ShardWriter(tmp_path / run, "train", maxcount=4) as writer:
            for i in range(10):
                writer.write(f"{i:08d}", encode_image(identity_image(i)), "png")
    assert [s["count"] for s in writer.shards] == [4, 4, 2]
    for name in ("train-000000.tar", "train-000002.tar"):
        assert sha256_of_file(tmp_path / "a" / name) == sha256_of_file(tmp_path / "b" / name)


def test_interrupted_writer_leaves_only_tmp(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path, "train", maxcount=100) as writer:
            writer.write("00000000", encode_image(identity_image(0)), "png")
            raise RuntimeError("killed")
    assert not list(tmp_path.glob("*.tar")) and not list(tmp_path.glob("*.tmp"))


def test_loader_pixels_exact_and_epoch_covers_dataset(tmp_path):
    rng = np.random.default_rng(0)
    originals = {}
    with ShardWriter(tmp_path, "train", maxcount=4) as writer:
        for i in range(12):
            pixels = rng.integers(0, 256, (RES, RES, 3), dtype=np.uint8)
            originals[i] = pixels
            writer.write(f"{i:08d}", encode_image(pixels), "png", label=i % 5)
    write_manifest(
        tmp_path,
        resolution=RES,
        image_format="png",
        splits={"train": writer.split_info()},
        source="t",
        classes=[str(c) for c in range(5)],
    )
    dm = ShardDataModule(tmp_path, resolution=RES, batch_size=3, num_workers=0, flip=False, labelled=True)
    assert (dm.resolution, dm.num_classes) == (RES, 5)
    found = []
    for batch in dm.train_dataloader():
        assert batch["image"].dtype == torch.float32 and batch["image"].shape == (3, 3, RES, RES)
        assert batch["label"].dtype == torch.int64
        for image, label in zip(batch["image"], batch["label"]):
            pixels = torch.round((image + 1) * 127.5).to(torch.uint8).permute(1, 2, 0).numpy()
            matches = [i for i, o in originals.items() if np.array_equal(o, pixels)]
            assert len(matches) == 1 and label.item() == matches[0] % 5
            found.append(matches[0])
    assert sorted(found) == list(range(12))


def test_flip_is_horizontal_and_unlabelled_batches_have_no_label(tmp_path):
    pixels = np.zeros((RES, RES, 3), np.uint8)
    pixels[:, : RES // 2] = 255  # left half white
    with ShardWriter(tmp_path, "train", maxcount=64) as writer:
        for i in range(64):
            writer.write(f"{i:08d}", encode_image(pixels), "png")
    write_manifest(tmp_path, resolution=RES, image_format="png", splits={"train": writer.split_info()}, source="t")
    dm = ShardDataModule(tmp_path, batch_size=64, num_workers=0, flip=True)
    batch = next(iter(dm.train_dataloader()))
    assert "label" not in batch
    left_white = (batch["image"][:, 0, 0, 0] > 0).sum().item()
    assert 16 < left_white < 48  # about half flipped
    assert torch.equal(batch["image"][:, :, :, : RES // 2].flip(-1).abs(), batch["image"][:, :, :, RES // 2 :].abs())


@pytest.mark.parametrize("counts", [[6] * 8, [48], [16, 16, 16]], ids=["8shards", "1shard", "3shards"])
@pytest.mark.timeout(120)
def test_two_ranks_two_workers_disjoint_and_cover_epoch(tmp_path, counts):
    make_dataset(tmp_path, counts)
    seen = []
    for rank in range(2):
        dm = ShardDataModule(tmp_path, batch_size=4, num_workers=2, flip=False, rank=rank, world_size=2)
        batches = list(dm.train_dataloader())
        assert len(batches) == dm.batches_per_epoch() == 6  # same count on every rank: no DDP hang
        seen += [i for b in batches for i in identities(b)]
    assert sorted(seen) == list(range(48))


def test_more_slots_than_samples_per_shard_no_hang(tmp_path):
    make_dataset(tmp_path, [3])  # one shard, 3 samples, 2 ranks x 2 workers = 4 slots
    lengths = []
    for rank in range(2):
        dm = ShardDataModule(tmp_path, batch_size=2, num_workers=2, flip=False, rank=rank, world_size=2, epoch_images=8)
        lengths.append(len(list(dm.train_dataloader())))
    assert lengths == [2, 2]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stream_resume_is_exact(tmp_path, num_workers):
    make_dataset(tmp_path, [7, 7, 7, 5])  # uneven shards, shuffle blocks smaller than an epoch

    def new_dm():
        return ShardDataModule(
            tmp_path, batch_size=3, num_workers=num_workers, flip=True, shuffle_block=5, epoch_images=21, seed=3
        )

    dm = new_dm()
    straight = []
    for _ in range(3):  # three epochs
        straight += [(identities(b), b["image"]) for b in dm.train_dataloader()]
    assert len(straight) == 21
    for n in (0, 2, 5, 7, 12) if num_workers == 0 else (5, 12):  # odd positions, and inside the 2nd epoch
        dm = new_dm()
        loader = dm.train_dataloader()
        iterator, consumed = iter(loader), 0
        if n >= 7:  # finish the first epoch, as the training loop would
            consumed += sum(1 for _ in iterator)
            iterator = iter(loader)
        for _ in range(n - consumed):
            next(iterator)
        state = json.loads(json.dumps(dm.state_dict()))  # checkpoints must survive serialisation
        del iterator
        resumed_dm = new_dm()
        resumed_dm.load_state_dict(state)
        loader = resumed_dm.train_dataloader()
        resumed = []
        while len(resumed) < 21 - n:
            resumed += [(identities(b), b["image"]) for b in loader]
        for (ids_a, img_a), (ids_b, img_b) in zip(straight[n:], resumed):
            assert ids_a == ids_b
            assert torch.equal(img_a, img_b)  # flips included


def test_state_dict_after_a_full_epoch_points_to_next_epoch(tmp_path):
    make_dataset(tmp_path, [4, 4])
    dm = ShardDataModule(tmp_path, batch_size=2, num_workers=0)
    assert dm.state_dict()["epoch"] == 0 and dm.state_dict()["batches_consumed"] == 0
    list(dm.train_dataloader())
    assert (dm.state_dict()["epoch"], dm.state_dict()["batches_consumed"]) == (1, 0)


def test_epochs_differ_and_seed_matters(tmp_path):
    make_dataset(tmp_path, [4] * 6)
    dm = ShardDataModule(tmp_path, batch_size=4, num_workers=0, flip=False)
    loader = dm.train_dataloader()
    first, second = [identities(b) for b in loader], [identities(b) for b in loader]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(24)) and first != second
    other = ShardDataModule(tmp_path, batch_size=4, num_workers=0, flip=False, seed=1)
    assert [identities(b) for b in other.train_dataloader()] != first


def test_corrupt_sample_is_warned_counted_skipped(tmp_path):
    with ShardWriter(tmp_path, "train", maxcount=8) as writer:
        for i in range(8):
            data = b"not a png at all" if i == 5 else encode_image(identity_image(i))
            writer.write(f"{i:08d}", data, "png")
    write_manifest(tmp_path, resolution=RES, image_format="png", splits={"train": writer.split_info()}, source="t")
    dm = ShardDataModule(tmp_path, batch_size=4, num_workers=0, flip=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(dm.train_dataloader())
    messages = [str(w.message) for w in caught if "skipping corrupt" in str(w.message)]
    assert len(messages) == 1 and "00000005" in messages[0] and "train-000000.tar" in messages[0]
    assert dm._train_dataset.corrupt.count == 1
    assert sorted(sum((identities(b) for b in batches), [])) == [0, 1, 2, 3, 4, 6, 7]


def test_validation_is_fixed_split_across_ranks(tmp_path):
    make_dataset(tmp_path, [8], val=10, labels=True)
    dm = ShardDataModule(tmp_path, batch_size=3, num_workers=2, val_images=9, labelled=True)
    batches = list(dm.val_dataloader())
    assert [identities(b) for b in batches] == [[8, 9, 10], [11, 12, 13], [14, 15, 16]]
    assert torch.equal(batches[0]["index"], torch.tensor([0, 1, 2]))
    assert batches[0]["label"].tolist() == [8 % 3, 9 % 3, 10 % 3]
    assert [identities(b) for b in dm.val_dataloader()] == [identities(b) for b in batches]
    per_rank = [
        sum(
            (
                identities(b)
                for b in ShardDataModule(
                    tmp_path, batch_size=2, num_workers=0, val_images=9, rank=r, world_size=2
                ).val_dataloader()
            ),
            [],
        )
        for r in range(2)
    ]
    assert per_rank == [[8, 10, 12, 14], [9, 11, 13, 15]]  # 9 -> 8 images: same count on every rank


def test_missing_data_and_bad_settings_are_clear_errors(tmp_path):
    with pytest.raises(PixditError, match=r"nowhere/manifest.json.*\n.*prepare_data.py --source"):
        ShardDataModule(tmp_path / "nowhere", prepare_command="python scripts/prepare_data.py --source X --out Y")
    make_dataset(tmp_path, [4])
    with pytest.raises(PixditError, match="resolution=64.*8x8"):
        ShardDataModule(tmp_path, resolution=64)
    with pytest.raises(PixditError, match="labelled"):
        ShardDataModule(tmp_path, labelled=True)
    (tmp_path / "train-000000.tar").unlink()
    with pytest.raises(PixditError, match="train-000000.tar.*missing"):
        ShardDataModule(tmp_path)


def test_quickstart_builder_is_deterministic_and_loads(tmp_path):
    a = make_quickstart_dataset(tmp_path / "a", train_count=96, val_count=16, maxcount=64)
    b = make_quickstart_dataset(tmp_path / "b", train_count=96, val_count=16, maxcount=64)
    assert a["counts"] == {"train": 96, "val": 16} and a["resolution"] == 32
    assert a["splits"] == b["splits"]  # same checksums
    dm = ShardDataModule(tmp_path / "a", resolution=32, batch_size=16, num_workers=0)
    batch = next(iter(dm.train_dataloader()))
    assert batch["image"].shape == (16, 3, 32, 32)
    assert batch["image"].std() > 0.1  # real photographs, not blank
    val = list(dm.val_dataloader())
    assert sum(v["image"].shape[0] for v in val) == 16


class _RecordingModule:
    """A tiny LightningModule that records which images each training step received."""

    @staticmethod
    def make():
        import lightning as L

        class Recording(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.zeros(1))
                self.seen = []

            def training_step(self, batch, batch_idx):
                self.seen.append(identities(batch))
                return (self.weight - batch["image"].mean()) ** 2

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Recording()


@pytest.mark.parametrize("num_workers,accumulate,k", [(2, 1, 3), (0, 1, 6), (0, 2, 4)])
def test_lightning_resume_continues_the_stream(tmp_path, num_workers, accumulate, k):
    """k optimizer steps, checkpoint, resume for k more == 2k steps straight, as seen by training_step."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = make_dataset(tmp_path / "data", [5] * 6)

    def fit(max_steps, ckpt_dir, ckpt_path=None):
        dm = ShardDataModule(
            data, batch_size=2, num_workers=num_workers, flip=False, shuffle_block=4, epoch_images=12
        )  # 6 batches per epoch
        module = _RecordingModule.make()
        trainer = L.Trainer(
            max_steps=max_steps,
            accelerator="cpu",
            devices=1,
            accumulate_grad_batches=accumulate,
            use_distributed_sampler=False,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            default_root_dir=ckpt_dir,
            callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_last=True)],
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path)
        assert not [w for w in caught if "not resumable" in str(w.message)]  # Lightning sees a resumable loader
        return module.seen

    straight = fit(2 * k, tmp_path / "straight")
    first = fit(k, tmp_path / "resumed")
    second = fit(2 * k, tmp_path / "resumed", ckpt_path=str(tmp_path / "resumed" / "last.ckpt"))
    assert len(straight) == 2 * k * accumulate
    assert first + second == straight


def test_val_root_validates_on_another_dataset(tmp_path):
    make_dataset(tmp_path / "train", [4])
    make_dataset(tmp_path / "other", [6])  # no val split: its train split is the validation set
    dm = ShardDataModule(tmp_path / "train", batch_size=2, num_workers=0, val_images=4, val_root=tmp_path / "other")
    assert [identities(b) for b in dm.val_dataloader()] == [[0, 1], [2, 3]]
    with pytest.warns(UserWarning, match="no held-out 'val' split"):
        ShardDataModule(tmp_path / "train", batch_size=2, num_workers=0).val_dataloader()


def test_setting_range_errors_name_the_value_the_user_gave(tmp_path):
    make_dataset(tmp_path, [4])
    with pytest.raises(PixditError, match=r"data\.batch_size must be >= 1, got 0"):
        ShardDataModule(tmp_path, batch_size=0)
    with pytest.raises(PixditError, match=r"data\.val_images must be >= 0, got -1"):
        ShardDataModule(tmp_path, val_images=-1)
    with pytest.raises(PixditError, match=r"data\.num_workers must be >= 0, got -2"):
        ShardDataModule(tmp_path, num_workers=-2)


def test_shard_damaged_after_the_check_is_warned_and_does_not_shift_validation_indices(tmp_path):
    make_dataset(tmp_path, [8, 8])
    dm = ShardDataModule(tmp_path, batch_size=4, num_workers=0, flip=False, val_images=16)
    shard = tmp_path / "train-000000.tar"  # damaged after the pre-flight check (while training)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # Python's tarfile stops here silently
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train = sum((identities(b) for b in dm.train_dataloader()), [])
        val = list(dm.val_dataloader())
    truncated = [str(w.message) for w in caught if "train-000000.tar" in str(w.message)]
    assert len(truncated) == 2 and all("manifest" in m for m in truncated)  # one from each loader
    assert set(range(8, 16)) <= set(train) <= set(range(16))
    assert dm._train_dataset.corrupt.count == dm.skipped_samples == 16 - len(train) > 0  # images, not events
    # validation (the train split here, there is no val split): `index` is still the image's position in the split
    assert all(batch["index"].tolist() == identities(batch) for batch in val)
    assert sum((identities(b) for b in val), [])[-8:] == list(range(8, 16))


def damage(shard, how):
    """Make a shard unusable the way a bad copy or a mixed-up dataset does."""
    if how == "empty":
        shard.write_bytes(b"")
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:1536])
    else:  # images of another resolution, under the manifest's name and size
        size = shard.stat().st_size
        with ShardWriter(shard.parent / "other", "train", maxcount=4) as writer:
            for i in range(4):
                writer.write(f"{i:08d}", encode_image(np.zeros((2 * RES, 2 * RES, 3), np.uint8)), "png")
        other = (shard.parent / "other" / "train-000000.tar").read_bytes()
        shard.write_bytes(
            other[: size - 1024] + bytes(1024) if len(other) >= size else other + bytes(size - len(other))
        )


@pytest.mark.parametrize("how", ["empty", "truncated", "resolution"])
def test_bad_shard_is_left_out_with_one_warning_before_training(tmp_path, how):
    make_dataset(tmp_path, [4, 4, 4, 4], val=4)
    damage(tmp_path / "train-000002.tar", how)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dm = ShardDataModule(tmp_path, batch_size=4, num_workers=0, flip=False, max_bad_fraction=0.25)
        epoch = epoch_samples(dm)
    messages = [str(w.message) for w in caught if "train-000002.tar" in str(w.message)]
    assert len(messages) == 1 and "4 of 16 images (25.0%) lost" in messages[0]
    assert sorted(epoch) == [i for i in range(16) if i // 4 != 2]  # the epoch is the intact shards, once
    assert dm.skipped_samples == 0  # nothing left to fail while training


def test_too_many_bad_shards_is_one_error_before_training(tmp_path):
    make_dataset(tmp_path, [4, 4, 4, 4], val=4)
    damage(tmp_path / "train-000001.tar", "empty")
    damage(tmp_path / "val-000000.tar", "truncated")
    command = "python scripts/prepare_data.py --source SRC --out DATA --resolution 8"
    with pytest.raises(
        PixditError,
        match=r"(?s)1 of 4 shards of the train split.*4 of 16 images \(25.0%\) lost"
        r".*train-000001.tar: empty.*max_bad_fraction=0.01"
        r".*prepare_data.py --source",
    ):
        ShardDataModule(tmp_path, prepare_command=command)  # default threshold: 1% of the images
    with pytest.raises(
        PixditError,
        match=r"(?s)val split.*val-000000.tar: 1536 bytes, the manifest says .*"
        r"prepare_data.py --source",
    ):
        ShardDataModule(tmp_path, max_bad_fraction=0.5, prepare_command=command)  # the val split is checked too
    # manifests of older versions record no shard sizes: a cut-short tar is told by its end, an intact one passes
    assert shard_problem(tmp_path / "val-000000.tar", {"name": "val-000000.tar", "count": 4}, RES).startswith(
        "truncated"
    )
    assert shard_problem(tmp_path / "train-000000.tar", {"name": "train-000000.tar", "count": 4}, RES) is None
    with pytest.raises(PixditError, match=r"data\.max_bad_fraction must be in \[0, 1\].*got 2"):
        ShardDataModule(tmp_path, max_bad_fraction=2)


def test_unreadable_images_are_counted_over_all_workers(tmp_path):
    with ShardWriter(tmp_path, "train", maxcount=4) as writer:
        for i in range(16):  # one undecodable image in each of the 4 shards: every worker meets some
            writer.write(f"{i:08d}", b"not a png" if i % 4 == 1 else encode_image(identity_image(i)), "png")
    write_manifest(tmp_path, resolution=RES, image_format="png", splits={"train": writer.split_info()}, source="t")
    dm = ShardDataModule(tmp_path, batch_size=4, num_workers=2, flip=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = list(dm.train_dataloader())
    assert all("skipped" not in batch for batch in batches)  # the count travels with the batch, then is taken off
    assert dm.skipped_samples == 4 and sum(len(identities(b)) for b in batches) == 12
    assert any("4 unreadable images skipped on rank 0" in str(w.message) for w in caught)


def test_a_whole_unreadable_batch_repeats_the_previous_one(tmp_path):
    make_dataset(tmp_path, [4, 4, 4, 4])
    dm = ShardDataModule(tmp_path, batch_size=4, num_workers=0, flip=False, shuffle_block=4)
    stream = dm.train_dataloader().dataset  # one shard per batch here
    intact = [identities(b) for b in stream]
    shard_of_batch = [ids[0] // 4 for ids in intact]
    (tmp_path / f"train-{shard_of_batch[1]:06d}.tar").write_bytes(b"")  # damaged while training
    with pytest.warns(UserWarning, match="repeating the previous batch"):
        batches = list(stream)  # the same epoch again
    assert [identities(b) for b in batches] == [intact[0], intact[0], intact[2], intact[3]]  # as many batches
    assert [int(b["skipped"]) for b in batches] == [0, 4, 0, 0]
    (tmp_path / f"train-{shard_of_batch[0]:06d}.tar").write_bytes(b"")  # nothing to repeat: a clear error
    with pytest.raises(PixditError, match="first batch .* unreadable"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        list(stream)


def test_damaged_manifest_is_one_error(tmp_path):
    make_dataset(tmp_path, [4])
    manifest = tmp_path / "manifest.json"
    text = manifest.read_text()
    for damaged, expected in (
        (text[: len(text) // 2], "not valid JSON"),
        (b"\xff\xfe\x00garbage", "not valid JSON"),
        (text.replace('"resolution": 8', '"resolution": "8"'), "resolution='8'"),
        (text.replace('"shards"', '"shard"'), "lacks a 'count' or a 'shards' list"),
        ("[1, 2]", "not a pixdit shard manifest"),
    ):
        manifest.write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
        with pytest.raises(PixditError, match=expected):
            ShardDataModule(tmp_path, prepare_command="python scripts/prepare_data.py --out X")


def test_epoch_and_batch_settings_below_one_are_errors_not_silent_defaults(tmp_path):
    make_dataset(tmp_path, [4])
    # epoch_images=0 used to mean the split size, a negative one one batch per epoch; val_batch_size=0 meant
    # batch_size and a negative one broke the validation batches; shuffle_block <= 0 became 1
    for name, value in (
        ("epoch_images", 0),
        ("epoch_images", -8),
        ("val_batch_size", 0),
        ("val_batch_size", -2),
        ("shuffle_block", 0),
    ):
        with pytest.raises(PixditError, match=rf"data\.{name} must be >= 1, got {value}"):
            ShardDataModule(tmp_path, **{name: value})


@pytest.mark.parametrize("name", ["ffhq", "folder", "imagenet", "quickstart"])
def test_every_data_config_states_the_bad_shard_allowance(train_helpers, name):
    """configs/data/*.yaml show data.max_bad_fraction (docs/reliability.md) with its default."""
    assert train_helpers.compose([f"data={name}"]).data.max_bad_fraction == 0.01

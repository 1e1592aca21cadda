"""ShardDataModule: streams webdataset shards to any number of GPUs, and resumes at the exact sample it stopped at.

    dm = ShardDataModule(root="data/quickstart", resolution=32, batch_size=64, num_workers=2)
    dm.resolution, dm.num_classes            # known before setup(): build the model from them
    batch = next(iter(dm.train_dataloader()))
    batch["image"]   # float32 [64, 3, 32, 32] in [-1, 1];  batch["label"]: int64 [64], labelled data only

Configured from configs/data/*.yaml. The trainer must run with `use_distributed_sampler=False`: the split across ranks
and workers is done here. Full description (stream definition, what resume restores): docs/data.md.

How the training stream is defined (all of it a pure function of seed, epoch, rank, worker and the manifest):
* units: every shard, or when there are fewer shards than (ranks x workers) slots, every shard cut into P interleaved
  parts (samples i with i % P == part), so each slot always has data: no hang, no idle rank.
* per epoch, an endless sequence of seeded permutations of the units (webdataset's `resampled=True` idea, but as
  permutations so ranks and workers never read the same unit in the same pass); slot s takes units s, s+n, s+2n, ...
* the slot's samples, in blocks of `shuffle_block`, each block permuted with its own seed (a shuffle buffer whose state
  is known at every position, which is what makes exact resume cheap); random flips seeded per batch.
* an epoch is `epoch_images` images (like webdataset's `with_epoch`): `epoch_images // (world_size * batch_size)`
  batches per rank. Worker w of W yields batches w, w+W, ... of the rank's epoch, because PyTorch's DataLoader takes
  batches from its workers round-robin; so after S batches, worker w has delivered len(range(w, S, W)) of them.
* resume: `state_dict()` stores (epoch, batches consumed in it); after `load_state_dict()` each worker skips exactly
  what it delivered, reading no file it does not need and decoding nothing it skips.

Bad data: before training every shard gets a cheap check (pixdit.data.shards.shard_problem: size, end of the tar, the
first image's size). Bad shards are left out of the stream with one warning saying how many images that loses; more
than `max_bad_fraction` of a split is one PixditError instead. Samples that still fail while training (undecodable,
wrong size, a shard damaged since) are warned about, skipped and counted: `skipped_samples`, over all workers of the
rank.

Signals: loader workers ignore SIGTERM. A `kill` of the whole process group (what a scheduler or `kill -TERM -PGID`
sends) then reaches the main process alone, which saves a checkpoint and stops (pixdit.callbacks.StepCheckpoint) and
shuts its workers down itself, instead of failing with "DataLoader worker ... is killed by signal: Terminated".
"""

from __future__ import annotations

import contextlib
import itertools
import math
import signal
import warnings
from pathlib import Path
from typing import Any, Iterator

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pixdit.data.imageops import decode_image
from pixdit.data.shards import IMAGE_FORMATS, iter_shard_samples, read_manifest, shard_problem
from pixdit.errors import PixditError
from pixdit.runtime import rank_and_world_size

_BLOCK_SEED, _FLIP_SEED = 1, 2  # stream tags, so block-shuffle and flip random numbers never coincide
# A train batch carries, from its loader worker to the main process, the images the worker skipped since its previous
# batch; the main process adds them to ShardDataModule.skipped_samples and takes the key off.
SKIPPED_KEY = "skipped"


def _ignore_sigterm(worker_id: int) -> None:
    """worker_init_fn of every loader: the main process handles SIGTERM (see the module doc)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _worker_slot() -> tuple[int, int]:
    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def _decode_sample(sample: dict, resolution: int, labelled: bool) -> tuple[np.ndarray, int | None]:
    """uint8 [H, W, 3] pixels and the label of one raw sample; raises ValueError when it is unusable."""
    data = next((sample[k] for k in IMAGE_FORMATS if k in sample), None)
    if data is None:
        raise ValueError(f"no image ({'/'.join(IMAGE_FORMATS)}) in sample")
    pixels = decode_image(data)
    if pixels.shape != (resolution, resolution, 3):
        raise ValueError(f"image is {pixels.shape[1]}x{pixels.shape[0]}, expected {resolution}x{resolution}")
    label = None
    if labelled:
        if "cls" not in sample:
            raise ValueError("no 'cls' label in a labelled dataset")
        label = int(sample["cls"])
    return pixels, label


def _to_batch(pixels: list[np.ndarray], labels: list[int | None], extra: dict | None = None) -> dict[str, torch.Tensor]:
    images = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float().div_(127.5).sub_(1.0)
    batch = {"image": images.contiguous()}
    if labels and labels[0] is not None:
        batch["label"] = torch.tensor(labels, dtype=torch.int64)
    batch.update(extra or {})
    return batch


class _CorruptCounter:
    """Warns about unusable data (sample key, or shard) and counts the images lost, per worker process."""

    def __init__(self) -> None:
        self.count = 0

    def report(self, what: str, error: Exception, images: int) -> None:
        """`images`: the images this loses, when they are counted here (0: where the gap is seen)."""
        self.count += images
        warnings.warn(f"skipping {what}: {error}", stacklevel=2)


class ShardTrainStream(IterableDataset):
    """One rank's training stream: yields `batches_per_epoch` batches per epoch (split over the DataLoader workers).

    `epoch` and `skip_batches` (batches of this epoch the rank already consumed) are set before each `iter()`.
    """

    def __init__(self, root: str | Path, shards: list[dict], *, resolution: int, batch_size: int,
                 batches_per_epoch: int, rank: int, world_size: int, seed: int, flip: bool, shuffle_block: int,
                 labelled: bool):
        self.root = Path(root)
        self.shards = [(s["name"], int(s["count"])) for s in shards]
        if sum(count for _, count in self.shards) == 0:
            raise PixditError(f"the training split in {self.root} has no samples")
        self.resolution, self.batch_size, self.batches_per_epoch = resolution, batch_size, batches_per_epoch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.flip, self.shuffle_block, self.labelled = flip, max(1, shuffle_block), labelled
        self.epoch = 0
        self.skip_batches = 0
        self.corrupt = _CorruptCounter()

    def __len__(self) -> int:
        return self.batches_per_epoch

    # ---- the deterministic sample schedule -------------------------------------------------------------------
    def units(self, num_slots: int) -> list[tuple[int, int, int, int]]:
        """(shard index, part, parts, sample count) for every unit. Shards are cut into parts only when there are
        fewer shards than slots, so that every (rank, worker) slot gets data."""
        num_shards = len(self.shards)
        parts = 1 if num_shards >= num_slots else num_slots // math.gcd(num_shards, num_slots)
        return [(i, part, parts, len(range(part, count, parts)))
                for i, (_, count) in enumerate(self.shards) for part in range(parts)]

    def slot_units(self, epoch: int, slot: int, num_slots: int) -> Iterator[tuple[int, int, int, int]]:
        """Endless sequence of the units slot `slot` reads in `epoch`: positions slot, slot+n, ... of the
        concatenation of seeded permutations of all units (the same permutations on every rank and worker)."""
        units = self.units(num_slots)
        position = 0
        for cycle in range(2**62):
            for unit_index in np.random.default_rng([self.seed, epoch, cycle]).permutation(len(units)):
                if position % num_slots == slot and units[unit_index][3] > 0:
                    yield units[unit_index]
                position += 1

    def raw_samples(self, epoch: int, slot: int, num_slots: int, start: int, stop: int) -> Iterator[tuple[int, dict]]:
        """(position, raw sample) for positions start..stop-1 of the slot's input. Units entirely before `start`
        are skipped without opening them; within a unit, skipped samples are read but not decoded."""
        position = 0
        for shard_index, part, parts, size in self.slot_units(epoch, slot, num_slots):
            if position >= stop:
                return
            if position + size <= start:
                position += size
                continue
            name, count = self.shards[shard_index]
            unit_end = position + size
            reached = max(position, start)  # the next position this unit owes
            try:
                with contextlib.closing(iter_shard_samples(self.root / name)) as shard_samples:
                    for item in self._unit_samples(shard_samples, part, parts, position, unit_end, start, stop):
                        yield item
                        reached = item[0] + 1
                if reached < min(unit_end, stop):  # Python's tarfile ends a truncated tar silently
                    raise ValueError(f"it holds fewer samples than the {count} of the manifest (truncated? check "
                                     f"it with pixdit.data.shards.verify_checksums)")
            except Exception as error:  # truncated / unreadable tar: warn, skip the rest of the unit
                # (the images are counted in __iter__, which sees the gap)
                self.corrupt.report(f"the rest of shard {self.root / name} ({min(unit_end, stop) - reached} "
                                    f"images)", error, images=0)
            position = unit_end

    @staticmethod
    def _unit_samples(shard_samples, part, parts, position, unit_end, start, stop):
        """Yields (position, sample) of the unit's samples in [start, stop)."""
        for index_in_shard, sample in enumerate(shard_samples):
            if index_in_shard % parts != part:
                continue
            if position >= unit_end or position >= stop:
                return  # (more samples than the manifest says: positions stay as the manifest defines them)
            if position >= start:
                yield position, sample
            position += 1

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker_id, num_workers = _worker_slot()
        # A fresh DataLoader asks worker 0 first, but after a resume the next batch (number skip_batches) belongs to
        # worker skip_batches % W of the uninterrupted run: DataLoader worker i plays that run's worker (i + skip) % W.
        worker = (worker_id + self.skip_batches) % num_workers
        slot, num_slots = self.rank * num_workers + worker, self.world_size * num_workers
        num_batches = len(range(worker, self.batches_per_epoch, num_workers))  # round-robin share of this worker
        done_batches = len(range(worker, self.skip_batches, num_workers))  # what it delivered before a resume
        num_samples, bs, block = num_batches * self.batch_size, self.batch_size, self.shuffle_block
        first_output = done_batches * bs
        first_block = first_output // block
        raw = self.raw_samples(self.epoch, slot, num_slots, first_block * block, num_samples)

        pixels, labels, batch_index = [], [], first_output // bs
        flips = self._flips(worker, batch_index)
        previous, counted = None, self.corrupt.count  # the last batch (stands in for an unreadable one); count sent
        blocks = itertools.groupby(raw, key=lambda item: item[0] // block)
        group = next(blocks, None)
        for block_index in range(first_block, math.ceil(num_samples / block)):
            block_start = block_index * block
            block_len = min(block, num_samples - block_start)
            samples = {}  # offset in block -> raw sample (offsets missing where a shard could not be read)
            if group is not None and group[0] == block_index:
                samples = {position - block_start: sample for position, sample in group[1]}
                group = next(blocks, None)
            order = np.random.default_rng(
                [self.seed, self.epoch, self.rank, worker, block_index, _BLOCK_SEED]).permutation(block_len)
            for offset, source in enumerate(order):
                output = block_start + offset
                if output < first_output:
                    continue
                if source not in samples:  # its shard failed (warned about in raw_samples)
                    self.corrupt.count += 1
                else:
                    sample = samples[source]
                    try:
                        image, label = _decode_sample(sample, self.resolution, self.labelled)
                        if flips[output % bs]:
                            image = image[:, ::-1]
                        pixels.append(image)
                        labels.append(label)
                    except Exception as error:
                        self.corrupt.report(f"corrupt sample {sample.get('__key__')} in shard {sample.get('__url__')}",
                                            error, images=1)
                if output % bs == bs - 1:
                    if pixels:
                        previous = _to_batch(pixels, labels)
                    elif previous is None:
                        raise PixditError(f"every image of the first batch of a loader worker in {self.root} is "
                                          f"unreadable (see the warnings above); check the shards with "
                                          f"pixdit.data.shards.verify_checksums and re-run prepare_data.py")
                    else:  # a whole batch lost: repeat the previous one, so every rank and worker keeps its count
                        warnings.warn(f"every image of a batch in {self.root} is unreadable; repeating the previous "
                                      f"batch", stacklevel=2)
                        previous = {key: value.clone() for key, value in previous.items()}
                    yield {**previous, SKIPPED_KEY: torch.tensor(self.corrupt.count - counted)}
                    counted = self.corrupt.count
                    pixels, labels, batch_index = [], [], batch_index + 1
                    flips = self._flips(worker, batch_index)

    def _flips(self, worker: int, batch_index: int) -> np.ndarray:
        if not self.flip:
            return np.zeros(self.batch_size, dtype=bool)
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker, batch_index, _FLIP_SEED])
        return rng.random(self.batch_size) < 0.5


class ShardValStream(IterableDataset):
    """The first `num_images` samples of a split, in shard order, no flip: rank r takes images r, r+R, ...; batches
    are dealt to workers round-robin, so the batch sequence is the same for any number of workers.
    Batches carry `index` (int64: the image's position in the split, by the manifest's shard counts) so a model can
    fix per-image noise. Unreadable samples and shards are warned about and skipped like in training; the shards in
    `skip` (left out by the pre-flight check, already warned about) are not opened, their positions stay reserved."""

    def __init__(self, root: str | Path, shards: list[dict], *, resolution: int, batch_size: int, num_images: int,
                 rank: int, world_size: int, labelled: bool, skip: frozenset[str] = frozenset()):
        self.root = Path(root)
        self.shards = [(s["name"], int(s["count"])) for s in shards]
        self.skip = skip
        self.resolution, self.batch_size, self.labelled = resolution, batch_size, labelled
        self.indices = list(range(rank, num_images, world_size))
        self.corrupt = _CorruptCounter()

    def __len__(self) -> int:
        return math.ceil(len(self.indices) / self.batch_size)

    def _positioned_samples(self, last: int) -> Iterator[tuple[int, dict]]:
        """(position in the split, raw sample) up to `last`; positions follow the manifest's shard counts, so a
        truncated or unreadable shard (warned about) does not shift the images after it."""
        shard_start = 0
        for name, count in self.shards:
            if shard_start > last:
                return
            if name in self.skip:
                shard_start += count
                continue
            read = 0
            try:
                with contextlib.closing(iter_shard_samples(self.root / name)) as samples:
                    for sample in itertools.islice(samples, count):
                        read += 1
                        yield shard_start + read - 1, sample
                        if shard_start + read - 1 >= last:
                            return
                if read < count:  # Python's tarfile ends a truncated tar silently
                    raise ValueError(f"it holds {read} samples, the manifest says {count} (truncated? check it "
                                     f"with pixdit.data.shards.verify_checksums)")
            except Exception as error:  # (the images are counted in __iter__, which sees the gap)
                self.corrupt.report(f"the rest of shard {self.root / name}", error, images=0)
            shard_start += count

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        worker, num_workers = _worker_slot()
        mine = {index: position // self.batch_size for position, index in enumerate(self.indices)
                if (position // self.batch_size) % num_workers == worker}
        if not mine:
            return
        pixels, labels, indices, current, seen = [], [], [], None, 0
        for position, sample in self._positioned_samples(max(mine)):
            if position not in mine:
                continue
            seen += 1
            batch = mine[position]
            if current is not None and batch != current and pixels:
                yield _to_batch(pixels, labels, {"index": torch.tensor(indices)})
                pixels, labels, indices = [], [], []
            current = batch
            try:
                image, label = _decode_sample(sample, self.resolution, self.labelled)
                pixels.append(image)
                labels.append(label)
                indices.append(position)
            except Exception as error:
                self.corrupt.report(f"corrupt sample {sample.get('__key__')} in shard {sample.get('__url__')}", error,
                                    images=1)
        self.corrupt.count += len(mine) - seen  # images of unreadable or skipped shards
        if pixels:
            yield _to_batch(pixels, labels, {"index": torch.tensor(indices)})


class _TrainLoader(DataLoader):
    """DataLoader that sets the stream's epoch / resume position at each `iter()` and counts the batches it yields."""

    def __init__(self, dataset: ShardTrainStream, datamodule: ShardDataModule, **kwargs: Any):
        super().__init__(dataset, batch_size=None, **kwargs)
        self.datamodule = datamodule

    def __iter__(self):
        epoch, skip = self.datamodule._start_epoch()
        self.dataset.epoch, self.dataset.skip_batches = epoch, skip
        return self._counted(super().__iter__())

    def _counted(self, iterator):
        skipped = 0  # unreadable images of this epoch, over all the workers of this rank
        for batch in iterator:
            self.datamodule._batches_yielded += 1
            lost = int(batch.pop(SKIPPED_KEY))
            skipped += lost
            self.datamodule.skipped_samples += lost
            yield batch
        if skipped:  # once per epoch on every rank (each counts its own)
            warnings.warn(f"data epoch {self.dataset.epoch}: {skipped} unreadable images skipped on rank "
                          f"{self.dataset.rank} (see the warnings above)", stacklevel=2)

    # Lightning also checkpoints "stateful" dataloaders (and otherwise warns that a mid-epoch resume is not
    # resumable): hand it the data module's position, the one mechanism.
    def state_dict(self) -> dict[str, Any]:
        return self.datamodule.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.datamodule.load_state_dict(state_dict)


class ShardDataModule(L.LightningDataModule):
    """Lightning data module over a directory of shards + manifest.json (see configs/data/*.yaml for the keys).

    Args:
        root: dataset directory (holds manifest.json).
        resolution: expected image side; checked against the manifest (None: take the manifest's).
        batch_size: images per batch per GPU.
        num_workers: DataLoader worker processes per GPU (0 = load in the main process).
        flip: random horizontal flips for training.
        epoch_images: images per epoch over all GPUs (None: the training split's size).
        val_images: images of the validation split used per validation run (fixed, in order).
        val_batch_size: batch size for validation (None: batch_size).
        val_root: another prepared dataset to validate on (its `val` split, or its `train` split if it has none),
            e.g. ImageNet's official val images; None: this dataset's `val` split.
        labelled: feed class labels (the manifest must have classes). num_classes: checked against the manifest.
        seed: the data stream's seed. shuffle_block: samples permuted together (memory: this many encoded images
            per worker).
        max_bad_fraction: the largest fraction of a split's images that shards failing the pre-flight check may hold
            (they are then left out, with one warning); more is a PixditError before training.
        prepare_command: the command shown when the data is missing or damaged.
        rank, world_size: only for use without a Trainer (tests, scripts); a Trainer's values win.
    """

    def __init__(self, root: str, resolution: int | None = None, batch_size: int = 32, num_workers: int = 4,
                 flip: bool = True, epoch_images: int | None = None, val_images: int = 256,
                 val_batch_size: int | None = None, val_root: str | None = None, labelled: bool = False,
                 num_classes: int | None = None,
                 seed: int = 0, shuffle_block: int = 1000, max_bad_fraction: float = 0.01,
                 prepare_command: str | None = None, pin_memory: bool = True, rank: int | None = None,
                 world_size: int | None = None):
        super().__init__()
        self.root = Path(root)
        self.manifest = read_manifest(self.root, prepare_command, require_shards=False)  # (checked below)
        manifest_resolution = int(self.manifest["resolution"])
        if resolution is not None and int(resolution) != manifest_resolution:
            raise PixditError(f"data.resolution={resolution} but the shards in {self.root} are "
                              f"{manifest_resolution}x{manifest_resolution}; set data.resolution={manifest_resolution} "
                              f"or prepare the data at {resolution}:\n    {prepare_command or 'scripts/prepare_data.py'}")
        for name, value, low in (("batch_size", batch_size, 1), ("val_images", val_images, 0),
                                 ("num_workers", num_workers, 0), ("shuffle_block", shuffle_block, 1),
                                 ("epoch_images", epoch_images, 1), ("val_batch_size", val_batch_size, 1)):
            if value is not None and int(value) < low:  # (None: epoch_images / val_batch_size take their default)
                raise PixditError(f"data.{name} must be >= {low}, got {value}")
        if not 0 <= float(max_bad_fraction) <= 1:
            raise PixditError(f"data.max_bad_fraction must be in [0, 1] (a fraction of the images), got "
                              f"{max_bad_fraction}")
        manifest_classes = int(self.manifest.get("num_classes") or 0)
        if labelled and manifest_classes == 0:
            raise PixditError(f"data.labelled=true but {self.root} has no class labels; prepare it with "
                              f"--labels folders, or set data.labelled=false")
        if labelled and num_classes is not None and int(num_classes) != manifest_classes:
            raise PixditError(f"data.num_classes={num_classes} but {self.root} has {manifest_classes} classes")
        if "train" not in self.manifest["splits"]:
            raise PixditError(f"{self.root}/manifest.json has no 'train' split")
        self.val_root, self.val_manifest = self.root, self.manifest
        if val_root is not None:
            self.val_root = Path(val_root)
            self.val_manifest = read_manifest(self.val_root, f"scripts/prepare_data.py ... --out {val_root}",
                                              require_shards=False)
            if int(self.val_manifest["resolution"]) != manifest_resolution:
                raise PixditError(f"data.val_root={val_root} is {self.val_manifest['resolution']} px but data.root "
                                  f"is {manifest_resolution} px")
            if labelled and self.val_manifest.get("classes") != self.manifest.get("classes"):
                raise PixditError(f"data.val_root={val_root} has different classes than data.root={root}")
        self.resolution = manifest_resolution
        self.labelled = bool(labelled)
        self.num_classes = manifest_classes if labelled else 0
        self.max_bad_fraction, self.prepare_command = float(max_bad_fraction), prepare_command

        # pre-flight check of every shard that will be read; the bad ones are left out of the streams
        val_splits = self.val_manifest["splits"]
        self.val_split = "val" if "val" in val_splits and val_splits["val"]["count"] > 0 else "train"
        bad_train = self._check_shards(self.root, self.manifest, "train", prepare_command)
        self.train_shards = [s for s in self.manifest["splits"]["train"]["shards"] if s["name"] not in bad_train]
        if (self.val_root, self.val_split) == (self.root, "train"):
            self.val_skip = frozenset(bad_train)
        else:
            val_command = (prepare_command if self.val_root == self.root
                           else f"scripts/prepare_data.py ... --out {val_root}")
            self.val_skip = frozenset(self._check_shards(self.val_root, self.val_manifest, self.val_split,
                                                         val_command))
        train_images = sum(int(s["count"]) for s in self.train_shards)
        if train_images == 0:
            raise PixditError(f"the training split in {self.root} has no readable images")
        self.skipped_samples = 0  # unreadable images skipped while training, over this rank's workers (this run)

        self.batch_size, self.num_workers, self.flip, self.seed = int(batch_size), int(num_workers), flip, int(seed)
        self.epoch_images = int(epoch_images or train_images)
        self.val_images, self.val_batch_size = int(val_images), int(val_batch_size or batch_size)
        self.shuffle_block, self.pin_memory = int(shuffle_block), pin_memory
        self._rank, self._world_size = rank, world_size
        # position tracking (see state_dict): the epoch being served and batches handed out in it
        self._epoch: int | None = None
        self._batches_yielded = 0
        self._resume: dict | None = None
        self._train_dataset: ShardTrainStream | None = None

    def _check_shards(self, root: Path, manifest: dict, split: str, prepare_command: str | None) -> set[str]:
        """Names of the shards of `split` that fail the pre-flight check (shards.shard_problem). Left out with one
        warning when they hold at most max_bad_fraction of the split's images, else one PixditError."""
        shards = manifest["splits"][split]["shards"]
        problems = {s["name"]: problem for s in shards
                    if (problem := shard_problem(root / s["name"], s, self.resolution)) is not None}
        if not problems:
            return set()
        total = sum(int(s["count"]) for s in shards)
        lost = sum(int(s["count"]) for s in shards if s["name"] in problems)
        listing = "".join(f"\n  {root / name}: {problem}" for name, problem in list(problems.items())[:10])
        if len(problems) > 10:
            listing += f"\n  ... and {len(problems) - 10} more"
        summary = (f"{len(problems)} of {len(shards)} shards of the {split} split in {root} are unusable: "
                   f"{lost} of {total} images ({lost / max(total, 1):.1%}) lost{listing}")
        if lost > self.max_bad_fraction * total:
            raise PixditError(f"{summary}\nThat is more than data.max_bad_fraction={self.max_bad_fraction:g}. Delete "
                              f"these shards and re-run the command that made them (it rewrites missing shards):\n"
                              f"    {prepare_command or 'scripts/prepare_data.py (the same options)'}\n"
                              f"or set data.max_bad_fraction to a larger fraction to train without them.")
        rank_zero_warn(f"{summary}\nThese shards are left out (data.max_bad_fraction={self.max_bad_fraction:g} "
                       f"allows that).")
        return set(problems)

    # ---- topology ---------------------------------------------------------------------------------------------
    def rank_and_world_size(self) -> tuple[int, int]:
        if self.trainer is not None:
            return self.trainer.global_rank, self.trainer.world_size
        if self._rank is not None:
            return self._rank, self._world_size or 1
        return rank_and_world_size()

    def batches_per_epoch(self) -> int:
        """Batches per rank per epoch: epoch_images // (world_size * batch_size), at least 1."""
        return max(1, self.epoch_images // (self.rank_and_world_size()[1] * self.batch_size))

    # ---- dataloaders ------------------------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        rank, world_size = self.rank_and_world_size()
        self._train_dataset = ShardTrainStream(
            self.root, self.train_shards, resolution=self.resolution,
            batch_size=self.batch_size, batches_per_epoch=self.batches_per_epoch(), rank=rank, world_size=world_size,
            seed=self.seed, flip=self.flip, shuffle_block=self.shuffle_block, labelled=self.labelled)
        return _TrainLoader(self._train_dataset, self, num_workers=self.num_workers,
                            pin_memory=self.pin_memory and torch.cuda.is_available(), persistent_workers=False,
                            worker_init_fn=_ignore_sigterm)

    def val_dataloader(self) -> DataLoader:
        split = self.val_manifest["splits"][self.val_split]
        if self.val_split == "train" and self.val_root == self.root:
            warnings.warn(f"{self.root} has no held-out 'val' split (prepare_data.py --val N makes one); "
                          f"the validation loss uses the first {self.val_images} training images", stacklevel=2)
        rank, world_size = self.rank_and_world_size()
        num_images = min(self.val_images, split["count"])
        num_images -= num_images % world_size  # every rank gets the same number of images
        dataset = ShardValStream(self.val_root, split["shards"], resolution=self.resolution,
                                 batch_size=self.val_batch_size, num_images=num_images, rank=rank,
                                 world_size=world_size, labelled=self.labelled, skip=self.val_skip)
        return DataLoader(dataset, batch_size=None, num_workers=min(self.num_workers, len(dataset)),
                          pin_memory=self.pin_memory and torch.cuda.is_available(), worker_init_fn=_ignore_sigterm)

    # ---- exact resume -------------------------------------------------------------------------------------------
    def _start_epoch(self) -> tuple[int, int]:
        """Called at each iter() of the train loader: which epoch to serve and how many of its batches to skip."""
        if self._resume is not None:
            epoch, skip = self._resume["epoch"], self._resume["batches_consumed"]
            self._resume = None
        else:
            epoch, skip = (0 if self._epoch is None else self._epoch + 1), 0
        self._epoch, self._batches_yielded = epoch, skip
        return epoch, skip

    def _batches_consumed(self) -> int:
        """Batches of the current epoch the training loop has consumed. With a Trainer, its own count (the loop
        prefetches one batch, so the loader's count would be one too many); without one, what the loader yielded."""
        trainer = self.trainer
        if trainer is not None and getattr(trainer, "fit_loop", None) is not None:
            return int(trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        return self._batches_yielded

    def state_dict(self) -> dict[str, Any]:
        """Data position: the epoch and how many of its batches were consumed (+ the settings it depends on)."""
        if self._resume is not None:  # restored but not iterated yet: pass the position on unchanged
            return dict(self._resume)
        epoch, consumed = (self._epoch or 0), (self._batches_consumed() if self._epoch is not None else 0)
        limit = self.batches_per_epoch()
        if self.trainer is not None and isinstance(self.trainer.num_training_batches, int):
            limit = min(limit, self.trainer.num_training_batches)  # limit_train_batches ends epochs early
        if consumed >= limit:  # the epoch is finished: the next one starts from its beginning
            epoch, consumed = epoch + 1, 0
        _, world_size = self.rank_and_world_size()
        return {"epoch": epoch, "batches_consumed": consumed, "world_size": world_size,
                "num_workers": self.num_workers, "batch_size": self.batch_size, "seed": self.seed,
                "epoch_images": self.epoch_images}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the data position; the next `iter()` of the train loader continues exactly there."""
        state = dict(state_dict)
        _, world_size = self.rank_and_world_size()
        now = {"world_size": world_size, "num_workers": self.num_workers, "batch_size": self.batch_size,
               "seed": self.seed, "epoch_images": self.epoch_images}
        changed = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
        if changed:
            # the stream depends on these: continue at the same number of images, in a different order
            images = state["batches_consumed"] * state.get("batch_size", self.batch_size) * state.get(
                "world_size", world_size)
            state["batches_consumed"] = min(images // (self.batch_size * world_size), self.batches_per_epoch())
            warnings.warn("resuming with different data settings " + ", ".join(
                f"{k}: {old} -> {new}" for k, (old, new) in changed.items()) + "; the data position is kept in "
                "images seen this epoch, but the sample order is not the one of an uninterrupted run", stacklevel=2)
        epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
        if consumed >= self.batches_per_epoch():
            epoch, consumed = epoch + 1, 0
        self._resume = {"epoch": epoch, "batches_consumed": consumed, **now}

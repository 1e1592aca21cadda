"""Turn FFHQ / ImageNet / any image collection into webdataset shards (the library behind scripts/prepare_data.py).

    python scripts/prepare_data.py --source ~/ffhq/images1024x1024 --out data/ffhq256 --resolution 256 --val 1000
    python scripts/prepare_data.py --source ~/imagenet/train --out data/imagenet256 --resolution 256 --labels folders
    python scripts/prepare_data.py --source ~/imagenet/val --out data/imagenet256_val --resolution 256 --labels folders

Sources (detected from the path):
* a folder of images, searched recursively (FFHQ's images1024x1024/ or thumbnails128x128/, ImageNet's train/);
* a .zip of such a folder;
* a folder of .parquet files with an image-bytes column (a binary column, or a struct with a `bytes` field as written
  by Hugging Face datasets), read in file order then row order;
* ImageNet's flat val/ folder with `--labels folders`: labels come from the devkit (ILSVRC2012_validation_ground_truth.txt
  + meta.mat) or from Kaggle's LOC_val_solution.csv, found in the source folder, its parent, or a devkit folder there.

`--labels folders`: class id = index of the image's top-level folder name in the sorted list of names
(torchvision ImageFolder order; for ImageNet the sorted synset ids), saved as classes.json. In a .zip, the top level
is below the folders every member shares (train.zip holding train/<synset>/... gives the synsets).

Every image: to 8-bit RGB scaled by its bit depth (16-bit and float images too), then ADM's center_crop_arr
(pixdit.data.imageops) to `resolution`, then PNG (default) or JPEG.

Determinism and resume: the source list is sorted; `--val N` holds out N images picked by a fixed seed; training
images are dealt to shards round-robin (image i -> shard i mod K), so each shard is a cross-section of the dataset (all
ImageNet classes in every shard); parquet sources keep row order (contiguous shards) because parquet cannot be read
out of order cheaply. A shard's content is therefore a function of the sorted source list and the options, so an
interrupted run restarted with the same command keeps its finished shards (recorded in DIR/.prepare/) and writes only
the rest, with no duplicates (a finished shard whose size differs from its record is rewritten). Unreadable images,
and images with no faithful 8-bit version (imageops.to_rgb8), are reported with their paths, skipped, and listed in
the manifest with the reason.

One run at a time per `--out`: a run holds a lock (DIR/.prepare/lock) and a second one stops with a message naming
the first. Worker processes exit when the run that started them ends, however it ends (kill -9 included).
"""

from __future__ import annotations

import csv
import errno
import hashlib
import io
import json
import math
import multiprocessing
import os
import sys
import threading
import zipfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from pixdit.data.imageops import UnsupportedImage, center_crop_arr, encode_image
from pixdit.data.shards import IMAGE_FORMATS, ShardWriter, shard_name, split_info, write_manifest
from pixdit.errors import PixditError
from pixdit.files import exclusive_lock, write_json

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff")
LABEL_MODES = ("none", "folders")
VAL_SEED = 0  # which images --val holds out; fixed so re-runs and resumes agree
STATE_DIR = ".prepare"
LOCK_NAME = "lock"  # in STATE_DIR
PARQUET_IMAGE_COLUMNS = ("image", "img", "png", "jpg", "jpeg", "image_bytes", "bytes")


@dataclass(frozen=True)
class Item:
    """One source image: `ref` locates it inside the source (relative path, zip member, or "file.parquet#row")."""

    ref: str
    label: int | None = None


# ---- source discovery -----------------------------------------------------------------------------------------------
def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not os.path.basename(name).startswith(".")


def _folder_labels(refs: list[str], where: str) -> tuple[list[Item], list[str]]:
    """Class = first path component; ids in sorted-name order (torchvision ImageFolder)."""
    flat = [r for r in refs if "/" not in r]
    if flat:
        raise PixditError(f"--labels folders: {len(flat)} images in {where} are not inside a class folder "
                          f"(e.g. {flat[0]}); expected {where}/<class>/<image>")
    classes = sorted({r.split("/", 1)[0] for r in refs})
    class_id = {name: i for i, name in enumerate(classes)}
    return [Item(r, class_id[r.split("/", 1)[0]]) for r in refs], classes


def _find_imagenet_val_labels(folder: Path) -> dict[str, str] | None:
    """{image file name: synset id} from the ILSVRC2012 devkit or Kaggle's LOC_val_solution.csv, if found."""
    places = [folder, folder.parent]
    places += [p / "ILSVRC2012_devkit_t12" / "data" for p in (folder, folder.parent)]
    places += [p / "data" for p in places[:2]]
    for place in places:
        truth, meta = place / "ILSVRC2012_validation_ground_truth.txt", place / "meta.mat"
        if truth.is_file() and meta.is_file():
            import scipy.io

            synsets = scipy.io.loadmat(str(meta), squeeze_me=True)["synsets"]
            wnid_of_id = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}
            ids = [int(line) for line in truth.read_text().split()]
            return {f"ILSVRC2012_val_{i + 1:08d}.JPEG": wnid_of_id[label] for i, label in enumerate(ids)}
        solution = place / "LOC_val_solution.csv"
        if solution.is_file():
            with open(solution, newline="") as f:
                return {row["ImageId"] + ".JPEG": row["PredictionString"].split()[0] for row in csv.DictReader(f)}
    return None


def list_source(source: Path, labels: str) -> tuple[str, list[Item], list[str] | None]:
    """(kind, sorted items, class names or None) for a source path. kind: folder | zip | parquet."""
    if labels not in LABEL_MODES:
        raise PixditError(f"--labels must be one of {LABEL_MODES}, got {labels!r}")
    if not source.exists():
        raise PixditError(f"--source {source} does not exist")
    if source.is_file() and source.suffix.lower() == ".zip":
        try:
            with zipfile.ZipFile(source) as archive:
                refs = sorted(n for n in archive.namelist() if _is_image(n) and not n.endswith("/"))
        except zipfile.BadZipFile as error:  # truncated download, or not a zip at all
            raise PixditError(f"--source {source} is not a readable .zip ({error}); download it again") from None
        kind = "zip"
    elif source.is_dir() and not any(_is_image(p.name) for p in source.rglob("*") if p.is_file()) and list(
            source.rglob("*.parquet")):
        if labels != "none":
            raise PixditError("--labels folders needs a folder or .zip source (parquet sources are unlabelled)")
        items = []
        import pyarrow.parquet as pq

        for path in sorted(source.rglob("*.parquet")):
            rel = path.relative_to(source).as_posix()
            _parquet_image_column(path, pq.read_schema(path))  # fail now, not in a worker, if there is none
            items += [Item(f"{rel}#{row}") for row in range(pq.ParquetFile(path).metadata.num_rows)]
        return "parquet", items, None
    elif source.is_dir():
        refs = sorted(p.relative_to(source).as_posix() for p in source.rglob("*") if p.is_file() and _is_image(p.name))
        kind = "folder"
    else:
        raise PixditError(f"--source {source} must be a folder of images, a .zip, or a folder of .parquet files")
    if not refs:
        raise PixditError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) found in {source}")
    if labels == "none":
        return kind, [Item(r) for r in refs], None
    if kind == "folder" and all("/" not in r for r in refs):  # a flat folder: ImageNet val with devkit labels?
        synset_of = _find_imagenet_val_labels(source)
        if synset_of is None:
            raise PixditError(f"--labels folders: {source} has no class folders and no ImageNet val ground truth "
                              f"(ILSVRC2012_validation_ground_truth.txt + meta.mat, or LOC_val_solution.csv) next to it")
        classes = sorted(set(synset_of.values()))
        class_id = {name: i for i, name in enumerate(classes)}
        missing = [r for r in refs if r not in synset_of]
        if missing:
            raise PixditError(f"no ground-truth label for {len(missing)} images, e.g. {missing[0]}")
        return kind, [Item(r, class_id[synset_of[r]]) for r in refs], classes
    # A zip usually wraps the class folders in one folder (train.zip -> train/<synset>/...): the classes are the
    # first folders below what every member shares, as if the user had pointed at the unzipped folder.
    wrapper = _common_folder(refs) if kind == "zip" else ""
    items, classes = _folder_labels([r[len(wrapper):] for r in refs], str(source) + ("/" + wrapper if wrapper else ""))
    return kind, [Item(wrapper + it.ref, it.label) for it in items], classes


def _common_folder(refs: list[str]) -> str:
    """The leading folders ('a/b/') that every path in `refs` shares, excluding each path's own folder level."""
    parts = [r.split("/")[:-1] for r in refs]
    common = []
    for names in zip(*parts):
        if len(set(names)) != 1:
            break
        common.append(names[0])
    # keep one folder level for the classes: a shared folder that is some image's own folder is not a wrapper
    common = common[: min(len(p) for p in parts) - 1] if parts else []
    return "".join(name + "/" for name in common)


# ---- the plan: which image goes into which shard --------------------------------------------------------------------
def plan_shards(kind: str, items: list[Item], maxcount: int, val: int) -> dict[str, list[list[tuple[int, Item]]]]:
    """{split: [shard -> [(key index, item)]]}: deterministic in the sorted item list and the options."""
    if val < 0 or val >= len(items):
        raise PixditError(f"--val must be in [0, {len(items) - 1}] for {len(items)} images, got {val}")
    held_out = set(np.random.default_rng(VAL_SEED).choice(len(items), size=val, replace=False).tolist()) if val else set()
    splits = {"train": [it for i, it in enumerate(items) if i not in held_out],
              "val": [it for i, it in enumerate(items) if i in held_out]}
    plan = {}
    for split, split_items in splits.items():
        if not split_items:
            continue
        num_shards = math.ceil(len(split_items) / maxcount)
        if kind == "parquet":  # contiguous rows
            plan[split] = [list(enumerate(split_items))[k * maxcount:(k + 1) * maxcount] for k in range(num_shards)]
        else:  # round-robin: every shard a cross-section of the sorted list
            plan[split] = [[(i, split_items[i]) for i in range(k, len(split_items), num_shards)]
                           for k in range(num_shards)]
    return plan


# ---- reading and converting one shard (runs in worker processes) ----------------------------------------------------
class _SourceReader:
    """Reads the encoded bytes of items; keeps the zip / parquet file open across a shard."""

    def __init__(self, source: Path, kind: str):
        self.source, self.kind = source, kind
        self._zip = zipfile.ZipFile(source) if kind == "zip" else None
        self._parquet_file = None  # (relative path, ParquetFile, row-group start rows, image column)
        self._parquet_group = None  # (row group index, list of image bytes)

    def read(self, ref: str) -> bytes:
        if self.kind == "folder":
            return (self.source / ref).read_bytes()
        if self.kind == "zip":
            return self._zip.read(ref)
        rel, row = ref.rsplit("#", 1)
        return self._parquet_row(rel, int(row))

    def _parquet_row(self, rel: str, row: int) -> bytes:
        """Rows are read one row group at a time (shards are contiguous row ranges, so each group is read once)."""
        import pyarrow.parquet as pq

        if self._parquet_file is None or self._parquet_file[0] != rel:
            parquet = pq.ParquetFile(self.source / rel)
            starts = np.cumsum([0] + [parquet.metadata.row_group(g).num_rows
                                      for g in range(parquet.metadata.num_row_groups)])
            self._parquet_file = (rel, parquet, starts, _parquet_image_column(self.source / rel, parquet.schema_arrow))
            self._parquet_group = None
        _, parquet, starts, column = self._parquet_file
        group = int(np.searchsorted(starts, row, side="right") - 1)
        if self._parquet_group is None or self._parquet_group[0] != group:
            cells = parquet.read_row_group(group, columns=[column]).column(column).to_pylist()
            self._parquet_group = (group, [c["bytes"] if isinstance(c, dict) else c for c in cells])
        return self._parquet_group[1][row - starts[group]]

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()


def _parquet_image_column(path: Path, schema) -> str:
    """The image-bytes column: a binary column or a struct with a `bytes` field (Hugging Face `Image`)."""
    names = [f.name for f in schema]
    for name in [n for n in PARQUET_IMAGE_COLUMNS if n in names] + names:
        kind = schema.field(name).type
        if str(kind) in ("binary", "large_binary"):
            return name
        if str(kind).startswith("struct") and any(sub.name == "bytes" for sub in kind):
            return name
    raise PixditError(f"{path}: no image-bytes column (a binary column or a struct with 'bytes'); columns: {names}")


def convert_image(data: bytes, resolution: int) -> np.ndarray:
    """Decode any PIL-readable image fully and apply center_crop_arr; raises on corrupt data and UnsupportedImage on
    an image with no faithful 8-bit version."""
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        return center_crop_arr(image, resolution)


def write_one_shard(task: dict) -> dict:
    """Convert and write shard `task["index"]` of `task["split"]`; returns its manifest entry + skipped files."""
    out, source = Path(task["out"]), Path(task["source"])
    reader = _SourceReader(source, task["kind"])
    skipped = []
    try:
        with ShardWriter(out, task["split"], maxcount=len(task["items"]) + 1, start_shard=task["index"]) as writer:
            for key_index, ref, label in task["items"]:
                try:
                    pixels = convert_image(reader.read(ref), task["resolution"])
                except Exception as error:  # corrupt / truncated / unreadable / no 8-bit version: report, skip
                    reason = ("not a readable image" if isinstance(error, UnidentifiedImageError)
                              else str(error) if isinstance(error, UnsupportedImage)
                              else f"{type(error).__name__}: {error}")
                    skipped.append({"path": f"{source}/{ref}" if task["kind"] == "parquet" else str(source / ref),
                                    "error": reason})
                    continue
                writer.write(f"{key_index:08d}", encode_image(pixels, task["format"], task["quality"]),
                             task["format"], label=label, source=ref)
    finally:
        reader.close()
    shard = writer.shards[0] if writer.shards else {"name": shard_name(task["split"], task["index"]), "count": 0,
                                                    "sha256": None}
    result = {**shard, "index": task["index"], "skipped": skipped}
    # written after the shard's rename: a state file means the shard is complete
    write_json(out / STATE_DIR / (shard_name(task["split"], task["index"]) + ".json"), result)
    return result


def _exit_with_parent() -> None:
    """Pool worker initializer: end this worker as soon as the process that started it ends (kill -9 included).
    Without it, an idle worker waits forever for work from a parent that is gone."""
    parent = multiprocessing.parent_process()

    def watch():
        parent.join()  # returns when the parent's end of the pipe multiprocessing keeps to it closes
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _is_finished(out: Path, record: dict) -> bool:
    """Whether the shard of a .prepare record is on disk as written (a record without a size, from an older
    version, trusts the file's presence)."""
    if record["count"] == 0:
        return True
    path = out / record["name"]
    return path.is_file() and ("bytes" not in record or path.stat().st_size == record["bytes"])


def _make_out_dir(out: Path) -> None:
    """Create `out` and its state folder, or say in one message why that is impossible."""
    try:
        (out / STATE_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a parent that is a file, no permission, a read-only file system
        raise PixditError(f"--out {out}: cannot create it ({error.strerror}: {error.filename}); choose a folder "
                          f"you can write to") from None


# ---- the whole run --------------------------------------------------------------------------------------------------
def prepare_dataset(source: str | os.PathLike, out: str | os.PathLike, resolution: int, labels: str = "none",
                    maxcount: int = 1000, workers: int = 1, image_format: str = "png", quality: int = 95,
                    limit: int | None = None, val: int = 0, progress: bool = True) -> dict:
    """Prepare (or finish preparing) shards of `source` in `out`; returns the manifest. See the module docstring."""
    source, out = Path(source).expanduser().resolve(), Path(out)
    if image_format not in IMAGE_FORMATS:
        raise PixditError(f"--format must be one of {IMAGE_FORMATS}, got {image_format!r}")
    for flag, value, low in (("--resolution", resolution, 1), ("--maxcount", maxcount, 1), ("--workers", workers, 1),
                             ("--quality", quality, 1), ("--val", val, 0)):
        if value < low:
            raise PixditError(f"{flag} must be >= {low}, got {value}")
    if quality > 100:
        raise PixditError(f"--quality must be in 1..100, got {quality}")
    if out.exists() and not out.is_dir():
        raise PixditError(f"--out {out} is a file; give a folder (new, or one this command wrote before)")
    kind, items, classes = list_source(source, labels)
    if limit is not None:
        if limit < 1:
            raise PixditError(f"--limit must be >= 1, got {limit}")
        items = items[:limit]
    plan = plan_shards(kind, items, maxcount, val)

    options = {"source": str(source), "kind": kind, "resolution": resolution, "labels": labels,
               "maxcount": maxcount, "format": image_format, "quality": quality if image_format == "jpg" else None,
               "limit": limit, "val": val, "resize": "center_crop_arr (box halvings, then bicubic; centre square)",
               "items_sha256": hashlib.sha256("\n".join(f"{i.ref}\t{i.label}" for i in items).encode()).hexdigest()}
    _make_out_dir(out)
    with exclusive_lock(out / STATE_DIR / LOCK_NAME, what=f"--out {out}",
                        fix="wait for that run to finish (or stop it), or use another --out"):
        try:
            splits = _write_shards(source, out, kind, plan, options, workers, progress)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise PixditError(f"disk full: no space left writing {error.filename or out} ({error.strerror}); free "
                              f"space there (or use an --out on another disk) and re-run the same command: the "
                              f"shards finished so far are kept") from None
        for entry in (s for info in splits.values() for s in info["skipped"]):
            print(f"skipped image {entry['path']}: {entry['error']}", file=sys.stderr)
        return write_manifest(out, resolution=resolution, image_format=image_format, splits=splits,
                              source=str(source), classes=classes, options=options)


def _write_shards(source: Path, out: Path, kind: str, plan: dict, options: dict, workers: int,
                  progress: bool) -> dict[str, dict]:
    """Write the shards of `plan` that no earlier run finished; returns the manifest's `splits`. (The caller holds
    the lock on `out`.)"""
    state_dir = out / STATE_DIR
    options_file = state_dir / "options.json"
    if options_file.is_file():
        previous = json.loads(options_file.read_text())
        if previous != options:
            changed = [k for k in options if previous.get(k) != options[k]]
            raise PixditError(f"{out} holds shards prepared with different settings ({', '.join(changed)}); "
                              f"use another --out, or delete {out} to start over")
    else:
        write_json(options_file, options)  # a half-written options.json would block every later run
    for stale in out.glob("*.tar.tmp"):  # shards a killed run left half-written
        stale.unlink()

    results: dict[str, dict[int, dict]] = {split: {} for split in plan}
    tasks = []
    for split, shards in plan.items():
        for index, shard_items in enumerate(shards):
            state = state_dir / (shard_name(split, index) + ".json")
            done = json.loads(state.read_text()) if state.is_file() else None
            if done is not None and _is_finished(out, done):
                results[split][index] = done  # finished in an earlier run: keep
                continue
            tasks.append({"out": str(out), "source": str(source), "kind": kind, "split": split, "index": index,
                          "resolution": options["resolution"], "format": options["format"],
                          "quality": options["quality"], "items": [(key, it.ref, it.label) for key, it in shard_items]})
    total = sum(len(t["items"]) for t in tasks)
    with tqdm(total=total, unit="img", desc=f"prepare {out.name}", disable=not progress, file=sys.stderr) as bar:
        if workers <= 1 or len(tasks) <= 1:
            for task in tasks:
                results[task["split"]][task["index"]] = write_one_shard(task)
                bar.update(len(task["items"]))
        else:
            with ProcessPoolExecutor(max_workers=workers, initializer=_exit_with_parent) as pool:
                futures = {pool.submit(write_one_shard, task): task for task in tasks}
                try:
                    for future in as_completed(futures):
                        task = futures[future]
                        results[task["split"]][task["index"]] = future.result()
                        bar.update(len(task["items"]))
                except BaseException:  # one shard failed (a full disk...): do not start the others
                    pool.shutdown(cancel_futures=True)
                    raise

    splits = {}
    for split, by_index in results.items():
        ordered = [by_index[i] for i in sorted(by_index)]
        shards = [{key: r[key] for key in ("name", "count", "bytes", "sha256") if key in r}
                  for r in ordered if r["count"]]
        splits[split] = split_info(shards, [s for r in ordered for s in r["skipped"]])
    return splits

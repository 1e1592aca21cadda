"""Webdataset shards on disk: the writer every dataset builder uses, and the manifest that describes them.

A dataset directory looks like this (written by `scripts/prepare_data.py` or `scripts/make_quickstart_data.py`):

    data/ffhq256/
      manifest.json            counts, resolution, classes, source, per-shard sample counts, sizes, sha256 checksums
      train-000000.tar ...     `{split}-%06d.tar`, `maxcount` samples each (the last one may hold fewer)
      val-000000.tar ...       optional held-out split (the training module's validation loss uses it)
      classes.json             class names in class-id order (labelled data only)

Each sample in a shard is `<key>.png` (or `.jpg`) holding an RGB image of `resolution x resolution` pixels, plus
`<key>.cls` (the class id as ASCII digits) for labelled data and `<key>.src` (the source path, for tracing a sample
back to its origin). Keys are the sample's position in the split, zero-padded, so they sort in write order.

Shards are written atomically: `ShardWriter` writes `train-000003.tar.tmp` and renames it to `train-000003.tar` only
after the tar is closed, so a killed run never leaves a truncated shard under a name that looks complete. A shard
damaged later (a copy cut short, a full disk) is caught by `shard_problem`, a cheap check of its size, end and first
image that the loader runs on every shard before training.

    from pixdit.data.shards import ShardWriter, write_manifest
    with ShardWriter(out_dir, "train", maxcount=1000) as writer:
        writer.write(key="00000000", image_bytes=png_bytes, image_format="png", label=None)
    write_manifest(out_dir, resolution=32, image_format="png", splits={"train": writer.split_info()}, ...)
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import webdataset as wds
from PIL import Image

from pixdit.errors import PixditError
from pixdit.files import commit_file, write_json

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "pixdit-shards"
MANIFEST_VERSION = 1
IMAGE_FORMATS = ("png", "jpg")


def shard_name(split: str, index: int) -> str:
    """File name of shard `index` of `split`: `train-000003.tar`."""
    return f"{split}-{index:06d}.tar"


def sha256_of_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class ShardWriter:
    """Writes the samples of one split as `{split}-%06d.tar` shards of `maxcount` samples (webdataset `ShardWriter`).

    Each shard is written under a `.tmp` name and renamed when complete. `shards` lists, for every finished shard,
    its name, sample count, size in bytes and sha256. `start_shard` lets a parallel or resumed writer produce shard
    k directly.
    Tar headers carry a fixed mtime, so the same samples always give byte-identical shards (and checksums).
    """

    def __init__(self, out_dir: str | os.PathLike, split: str = "train", maxcount: int = 1000, start_shard: int = 0):
        if maxcount < 1:
            raise PixditError(f"maxcount must be >= 1, got {maxcount}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.split = split
        self.shards: list[dict[str, Any]] = []
        self._count_in_shard = 0
        pattern = str(self.out_dir / f"{split}-%06d.tar.tmp")
        # maxsize is effectively unlimited: shard boundaries depend only on sample counts (resumable prepare needs that)
        self._writer = wds.ShardWriter(
            pattern, maxcount=maxcount, maxsize=1e15, post=self._finish_shard, start_shard=start_shard,
            verbose=0, encoder=False, mtime=0.0,
        )

    def _finish_shard(self, tmp_name: str) -> None:
        """Called by webdataset after a shard's tar is closed: rename it into place and record count + checksum."""
        count, self._count_in_shard = self._count_in_shard, 0
        if count == 0:  # webdataset opens a shard eagerly; an unused one is removed
            os.remove(tmp_name)
            return
        final = tmp_name[: -len(".tmp")]
        commit_file(tmp_name, final)
        self.shards.append({"name": os.path.basename(final), "count": count, "bytes": os.path.getsize(final),
                            "sha256": sha256_of_file(final)})

    def write(self, key: str, image_bytes: bytes, image_format: str, label: int | None = None,
              source: str | None = None) -> None:
        """Add one encoded image. `key` must not contain dots (webdataset splits names at the first dot)."""
        if image_format not in IMAGE_FORMATS:
            raise PixditError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
        if "." in key:
            raise ValueError(f"sample key {key!r} must not contain '.'")
        sample: dict[str, Any] = {"__key__": key, image_format: image_bytes}
        if label is not None:
            sample["cls"] = str(int(label)).encode()
        if source is not None:
            sample["src"] = source.encode("utf-8")
        self._writer.write(sample)  # may first close (and rename) the previous full shard
        self._count_in_shard += 1

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def abort(self) -> None:
        """Drop the shard being written (its .tmp file); finished shards stay."""
        if self._writer is None:
            return
        tar_writer, tmp_name = self._writer.tarstream, self._writer.fname
        self._writer = None
        if tar_writer is not None:
            try:
                tar_writer.close()
            except Exception:
                pass
        if tmp_name and os.path.exists(tmp_name):
            os.remove(tmp_name)

    def split_info(self, skipped: list[dict[str, str]] | None = None) -> dict[str, Any]:
        """The manifest entry of this split (call after close)."""
        return split_info(self.shards, skipped or [])


def split_info(shards: list[dict[str, Any]], skipped: list[dict[str, str]]) -> dict[str, Any]:
    """Manifest entry of one split: total count, per-shard count/sha256, and the skipped (corrupt) source files."""
    return {
        "count": sum(s["count"] for s in shards),
        "shards": shards,
        "skipped_count": len(skipped),
        "skipped": skipped,
    }


def write_manifest(out_dir: str | os.PathLike, *, resolution: int, image_format: str, splits: dict[str, dict],
                   source: str, classes: list[str] | None = None, options: dict | None = None) -> dict:
    """Write `manifest.json` (atomically) and, for labelled data, `classes.json`. Returns the manifest dict."""
    out_dir = Path(out_dir)
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "resolution": int(resolution),
        "image_format": image_format,
        "source": source,
        "classes": classes,
        "num_classes": len(classes) if classes else 0,
        "counts": {name: info["count"] for name, info in splits.items()},
        "skipped_count": sum(info.get("skipped_count", 0) for info in splits.values()),
        "splits": splits,
        "options": options or {},
    }
    if classes:
        write_json(out_dir / "classes.json", classes)
    write_json(out_dir / MANIFEST_NAME, manifest)
    return manifest


def read_manifest(root: str | os.PathLike, prepare_command: str | None = None, require_shards: bool = True) -> dict:
    """Load and check `root/manifest.json`. A missing or damaged manifest, or (with `require_shards`) a missing shard,
    is a PixditError that names the path and the command that makes the data."""
    path = Path(root) / MANIFEST_NAME
    hint = prepare_command or "python scripts/prepare_data.py --source PATH --out DIR --resolution R"
    if not path.is_file():
        raise PixditError(f"no dataset at {path} (manifest.json not found). Prepare it with:\n    {hint}")
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as error:  # not JSON, or not UTF-8: a file cut short or overwritten
        raise PixditError(f"{path} is damaged (not valid JSON: {error}); make it again with:\n    {hint}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise PixditError(f"{path} is not a pixdit shard manifest (format={found!r})")
    problem = _manifest_problem(manifest)
    if problem:
        raise PixditError(f"{path} is damaged ({problem}); make it again with:\n    {hint}")
    for split in manifest["splits"].values() if require_shards else ():
        for shard in split["shards"]:
            shard_path = Path(root) / shard["name"]
            if not shard_path.is_file():
                raise PixditError(f"shard {shard_path} listed in {path} is missing; re-run:\n    {hint}")
    return manifest


def _manifest_problem(manifest: dict) -> str | None:
    """What a reader of the manifest relies on and this one lacks (None: nothing)."""
    def is_count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not is_count(manifest.get("resolution")) or manifest["resolution"] < 1:
        return f"resolution={manifest.get('resolution')!r}, expected a positive integer"
    if not isinstance(manifest.get("splits"), dict):
        return "no 'splits' table"
    for name, split in manifest["splits"].items():
        if not isinstance(split, dict) or not is_count(split.get("count")) or not isinstance(split.get("shards"), list):
            return f"split {name!r} lacks a 'count' or a 'shards' list"
        for shard in split["shards"]:
            if not (isinstance(shard, dict) and isinstance(shard.get("name"), str) and is_count(shard.get("count"))):
                return f"split {name!r} has a shard entry without a name and count: {shard!r}"
    return None


def shard_problem(path: str | os.PathLike, entry: dict, resolution: int) -> str | None:
    """Why the shard at `path`, listed in a manifest as `entry`, cannot be read as the manifest says (None: no sign
    of trouble). Cheap: the file's size (against the manifest's, when it records one), the tar's end-of-archive
    marker (a tar ends in 1024 zero bytes; a cut-short copy does not) and the size of its first image, read from
    the image header. Nothing is decoded and no checksum is computed (verify_checksums does that)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size == 0:
        return "empty (0 bytes)"
    if "bytes" in entry and size != entry["bytes"]:
        return f"{size} bytes, the manifest says {entry['bytes']} (cut short or replaced)"
    try:
        with open(path, "rb") as f:
            f.seek(max(0, size - 1024))
            if size % 512 or f.read() != bytes(1024):
                return "truncated (it does not end like a complete tar file)"
            f.seek(0)
            with tarfile.open(fileobj=f, mode="r|") as tar:
                for member in itertools.islice(tar, 8):  # a sample is a few members: .cls, .png|.jpg, .src
                    if member.isfile() and member.name.rsplit(".", 1)[-1] in IMAGE_FORMATS:
                        with Image.open(io.BytesIO(tar.extractfile(member).read())) as image:
                            width, height = image.size  # from the header: no decoding
                        if (width, height) != (resolution, resolution):
                            return f"its images are {width}x{height}, the manifest says {resolution}x{resolution}"
                        return None
        return f"no {'/'.join(IMAGE_FORMATS)} image among its first files"
    except (OSError, tarfile.TarError, ValueError) as error:  # PIL's UnidentifiedImageError is an OSError
        return f"unreadable ({type(error).__name__}: {error})"


def verify_checksums(root: str | os.PathLike) -> list[str]:
    """Names of the shards whose sha256 differs from the manifest (empty list = all good)."""
    manifest = read_manifest(root)
    bad = []
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            if sha256_of_file(Path(root) / shard["name"]) != shard["sha256"]:
                bad.append(shard["name"])
    return bad


def iter_shard_samples(path: str | os.PathLike):
    """Raw samples of one shard in file order: dicts `{"__key__", "png"|"jpg", ["cls"], ["src"]}` of bytes.

    Nothing is decoded here, so skipping samples (exact resume) costs only reading the bytes.
    """
    with open(path, "rb") as stream:
        files = ({**f, "__url__": str(path)} for f in wds.tariterators.tar_file_iterator(stream))
        yield from wds.tariterators.group_by_keys(files)

"""prepare_data: FFHQ-like (flat folder, zip, parquet) and ImageNet-like (synset folders, val + devkit) sources built
here -> shards -> ShardDataModule. Pixel-exact for png, labels, counts, corrupt files, resume without duplicates."""

import contextlib
import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from pixdit.data.datamodule import ShardDataModule
from pixdit.data.prepare import prepare_dataset
from pixdit.data.shards import iter_shard_samples, verify_checksums
from pixdit.errors import PixditError

RES = 16
REPO = Path(__file__).resolve().parents[1]


def random_image(seed, size=(RES, RES)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)


def png_bytes(pixels) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def make_flat_folder(root: Path, count: int, corrupt=()) -> dict[str, np.ndarray]:
    """FFHQ-like: root/00000.png ... (some in a sub-folder, as FFHQ's 00000/ 01000/ layout); returns ref -> pixels."""
    originals = {}
    for i in range(count):
        ref = f"{i // 5:02d}000/{i:05d}.png"
        (root / ref).parent.mkdir(parents=True, exist_ok=True)
        if i in corrupt:
            (root / ref).write_bytes(png_bytes(random_image(i))[:40])  # truncated file
            continue
        originals[ref] = random_image(i)
        Image.fromarray(originals[ref]).save(root / ref)
    return originals


def all_samples(out: Path) -> dict[str, dict]:
    """src -> raw sample, over every shard in the manifest (fails on duplicate sources)."""
    manifest = json.loads((out / "manifest.json").read_text())
    samples = {}
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            for sample in iter_shard_samples(out / shard["name"]):
                src = sample["src"].decode()
                assert src not in samples, f"duplicate sample {src}"
                samples[src] = sample
    return samples


def loader_images(out: Path, labelled=False) -> list[tuple[np.ndarray, int | None]]:
    dm = ShardDataModule(out, batch_size=1, num_workers=0, flip=False, labelled=labelled)
    result = []
    for batch in dm.train_dataloader():
        pixels = torch.round((batch["image"][0] + 1) * 127.5).to(torch.uint8).permute(1, 2, 0).numpy()
        result.append((pixels, batch["label"].item() if labelled else None))
    return result


def test_flat_folder_pixel_exact_with_val_and_corrupt(tmp_path):
    originals = make_flat_folder(tmp_path / "src", 14, corrupt=(3, 9))
    manifest = prepare_dataset(tmp_path / "src", tmp_path / "out", RES, maxcount=4, val=3, progress=False)
    assert manifest["counts"] == {"train": 9, "val": 3} and manifest["skipped_count"] == 2
    skipped = sorted(s["path"] for info in manifest["splits"].values() for s in info["skipped"])
    assert [Path(p).name for p in skipped] == ["00003.png", "00009.png"]
    assert verify_checksums(tmp_path / "out") == []
    samples = all_samples(tmp_path / "out")
    assert sorted(samples) == sorted(originals)  # every readable image exactly once, over train + val
    got = loader_images(tmp_path / "out")
    assert len(got) == 9
    for pixels, _ in got:  # the loader returns exactly the source pixels (png, no resize needed)
        assert sum(np.array_equal(pixels, o) for o in originals.values()) == 1


def test_resize_is_box_halving_then_centre_crop(tmp_path):
    source = random_image(7, size=(4 * RES, 2 * RES))  # 64 wide, 32 high -> box 2x -> 32x16 -> centre 16 columns
    (tmp_path / "src").mkdir()
    Image.fromarray(source).save(tmp_path / "src" / "wide.png")
    prepare_dataset(tmp_path / "src", tmp_path / "out", RES, progress=False)
    ((pixels, _),) = loader_images(tmp_path / "out")
    halved = source.reshape(RES, 2, 2 * RES, 2, 3).astype(np.float64).mean(axis=(1, 3))
    expected = halved[:, RES // 2 : RES // 2 + RES]
    assert np.abs(pixels.astype(np.float64) - expected).max() <= 1.0


def test_zip_source_matches_folder_source(tmp_path):
    make_flat_folder(tmp_path / "src", 7)
    with zipfile.ZipFile(tmp_path / "ffhq.zip", "w") as archive:
        for path in sorted((tmp_path / "src").rglob("*.png")):
            archive.write(path, "images/" + path.relative_to(tmp_path / "src").as_posix())
    a = prepare_dataset(tmp_path / "src", tmp_path / "a", RES, maxcount=3, progress=False)
    b = prepare_dataset(tmp_path / "ffhq.zip", tmp_path / "b", RES, maxcount=3, progress=False)
    assert a["counts"] == b["counts"] == {"train": 7}
    assert [s["sha256"] for s in a["splits"]["train"]["shards"]] != []
    assert {k: v["png"] for k, v in all_samples(tmp_path / "a").items()} == {
        k.removeprefix("images/"): v["png"] for k, v in all_samples(tmp_path / "b").items()
    }


def test_truncated_zip_source_is_a_clear_error(tmp_path):
    make_flat_folder(tmp_path / "src", 3)
    with zipfile.ZipFile(tmp_path / "ffhq.zip", "w") as archive:
        for path in sorted((tmp_path / "src").rglob("*.png")):
            archive.write(path, path.relative_to(tmp_path / "src").as_posix())
    data = (tmp_path / "ffhq.zip").read_bytes()
    (tmp_path / "ffhq.zip").write_bytes(data[: len(data) // 2])  # an interrupted download: no central directory
    with pytest.raises(PixditError, match="ffhq.zip is not a readable .zip"):
        prepare_dataset(tmp_path / "ffhq.zip", tmp_path / "out", RES, progress=False)


def test_parquet_source_both_column_styles(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "pq").mkdir()
    images = [random_image(100 + i) for i in range(10)]
    hf_style = pa.table(
        {
            "image": [{"bytes": png_bytes(x), "path": f"{i}.png"} for i, x in enumerate(images[:6])],
            "label": list(range(6)),
        }
    )
    pq.write_table(hf_style, tmp_path / "pq" / "train-00000.parquet", row_group_size=4)
    pq.write_table(pa.table({"png": [png_bytes(x) for x in images[6:]]}), tmp_path / "pq" / "train-00001.parquet")
    manifest = prepare_dataset(tmp_path / "pq", tmp_path / "out", RES, maxcount=4, progress=False)
    assert manifest["counts"] == {"train": 10} and manifest["options"]["kind"] == "parquet"
    samples = all_samples(tmp_path / "out")
    assert sorted(samples) == sorted(
        [f"train-00000.parquet#{i}" for i in range(6)] + [f"train-00001.parquet#{i}" for i in range(4)]
    )
    for pixels, _ in loader_images(tmp_path / "out"):
        assert sum(np.array_equal(pixels, x) for x in images) == 1
    pq.write_table(pa.table({"caption": ["no image here"]}), tmp_path / "pq" / "train-00002.parquet")
    with pytest.raises(PixditError, match="no image-bytes column.*caption"):
        prepare_dataset(tmp_path / "pq", tmp_path / "out2", RES, progress=False)


SYNSETS = ["n01440764", "n01443537", "n01484850"]  # sorted: class ids 0, 1, 2


def make_imagenet(root: Path, per_class=4):
    """train/<synset>/<synset>_<i>.JPEG and a flat val/ with devkit ground truth whose ILSVRC ids are NOT sorted."""
    for c, synset in enumerate(SYNSETS):
        (root / "train" / synset).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(random_image(1000 * c + i)).save(
                root / "train" / synset / f"{synset}_{i}.JPEG", format="PNG"
            )  # content type does not matter to PIL
    # devkit: ILSVRC2012_ID 1 -> n01484850, 2 -> n01440764, 3 -> n01443537 (+ a non-leaf synset, id 4)
    import scipy.io

    id_to_wnid = {1: SYNSETS[2], 2: SYNSETS[0], 3: SYNSETS[1], 4: "n00000001"}
    synsets = np.zeros((4,), dtype=[("ILSVRC2012_ID", "O"), ("WNID", "O"), ("words", "O"), ("num_children", "O")])
    for row, (ilsvrc_id, wnid) in enumerate(id_to_wnid.items()):
        synsets[row] = (ilsvrc_id, wnid, "words", 0 if ilsvrc_id <= 3 else 3)
    devkit = root / "ILSVRC2012_devkit_t12" / "data"
    devkit.mkdir(parents=True)
    scipy.io.savemat(devkit / "meta.mat", {"synsets": synsets})
    truth = [1, 2, 3, 3, 2, 1, 2]  # ILSVRC ids of val images 1..7
    (devkit / "ILSVRC2012_validation_ground_truth.txt").write_text("\n".join(map(str, truth)) + "\n")
    (root / "val").mkdir()
    for i in range(len(truth)):
        Image.fromarray(random_image(5000 + i)).save(root / "val" / f"ILSVRC2012_val_{i + 1:08d}.JPEG", format="PNG")
    return [SYNSETS.index(id_to_wnid[t]) for t in truth]


def test_imagenet_train_folders_and_val_devkit_labels(tmp_path):
    val_labels = make_imagenet(tmp_path / "imagenet")
    train = prepare_dataset(
        tmp_path / "imagenet" / "train", tmp_path / "train", RES, labels="folders", maxcount=5, progress=False
    )
    assert train["classes"] == SYNSETS and train["num_classes"] == 3 and train["counts"] == {"train": 12}
    assert json.loads((tmp_path / "train" / "classes.json").read_text()) == SYNSETS
    # round-robin dealing: each shard holds a cross-section of the (class-sorted) list
    assert [s["count"] for s in train["splits"]["train"]["shards"]] == [4, 4, 4]  # ceil(12 / 5) shards, balanced
    first_shard_labels = sorted(int(s["cls"]) for s in iter_shard_samples(tmp_path / "train" / "train-000000.tar"))
    assert set(first_shard_labels) == {0, 1, 2}
    for pixels, label in loader_images(tmp_path / "train", labelled=True):
        owners = [c for c in range(3) for i in range(4) if np.array_equal(pixels, random_image(1000 * c + i))]
        assert owners == [label]

    val = prepare_dataset(tmp_path / "imagenet" / "val", tmp_path / "val", RES, labels="folders", progress=False)
    assert val["classes"] == SYNSETS and val["counts"] == {"train": 7}
    for pixels, label in loader_images(tmp_path / "val", labelled=True):
        index = [i for i in range(7) if np.array_equal(pixels, random_image(5000 + i))]
        assert len(index) == 1 and label == val_labels[index[0]]


def test_zip_of_imagenet_train_folder_labels_from_the_synset_folders(tmp_path):
    make_imagenet(tmp_path / "imagenet")
    with zipfile.ZipFile(tmp_path / "train.zip", "w") as archive:  # as zipping train/ gives: train/<synset>/...
        for path in sorted((tmp_path / "imagenet" / "train").rglob("*.JPEG")):
            archive.write(path, path.relative_to(tmp_path / "imagenet").as_posix())
    manifest = prepare_dataset(tmp_path / "train.zip", tmp_path / "out", RES, labels="folders", progress=False)
    assert manifest["classes"] == SYNSETS and manifest["counts"] == {"train": 12}
    labels = {src: int(s["cls"]) for src, s in all_samples(tmp_path / "out").items()}
    assert labels == {f"train/{synset}/{synset}_{i}.JPEG": c for c, synset in enumerate(SYNSETS) for i in range(4)}


def test_imagenet_val_kaggle_csv(tmp_path):
    (tmp_path / "val").mkdir()
    rows = ["ImageId,PredictionString"]
    for i, synset in enumerate([SYNSETS[1], SYNSETS[0], SYNSETS[2]]):
        Image.fromarray(random_image(i)).save(tmp_path / "val" / f"ILSVRC2012_val_{i + 1:08d}.JPEG", format="PNG")
        rows.append(f"ILSVRC2012_val_{i + 1:08d},{synset} 1 2 3 4")
    (tmp_path / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    prepare_dataset(tmp_path / "val", tmp_path / "out", RES, labels="folders", progress=False)
    labels = {src: int(s["cls"]) for src, s in all_samples(tmp_path / "out").items()}
    assert labels == {
        "ILSVRC2012_val_00000001.JPEG": 1,
        "ILSVRC2012_val_00000002.JPEG": 0,
        "ILSVRC2012_val_00000003.JPEG": 2,
    }


def test_resume_after_interruption_keeps_shards_no_duplicates(tmp_path):
    make_flat_folder(tmp_path / "src", 23, corrupt=(4,))
    reference = prepare_dataset(tmp_path / "src", tmp_path / "ref", RES, maxcount=4, val=2, progress=False)
    out = tmp_path / "out"
    prepare_dataset(tmp_path / "src", out, RES, maxcount=4, val=2, progress=False)
    # simulate kills: before shard 2 was written, during shard 3 (a .tmp left), between shard 4's rename and record
    (out / "train-000002.tar").unlink()
    (out / ".prepare" / "train-000002.tar.json").unlink()
    (out / "train-000003.tar").rename(out / "train-000003.tar.tmp")
    (out / ".prepare" / "train-000003.tar.json").unlink()
    (out / ".prepare" / "train-000004.tar.json").unlink()
    (out / "manifest.json").unlink()
    kept = out / "train-000000.tar"
    os.utime(kept, (1, 1))
    resumed = prepare_dataset(tmp_path / "src", out, RES, maxcount=4, val=2, progress=False)
    assert kept.stat().st_mtime == 1  # finished shards are not rewritten
    assert resumed["splits"] == reference["splits"]  # same shards, counts, checksums, skipped list
    assert not list(out.glob("*.tmp"))
    assert len(all_samples(out)) == 22  # unique sources (all_samples asserts no duplicates)
    with pytest.raises(PixditError, match="different settings.*resolution"):
        prepare_dataset(tmp_path / "src", out, RES * 2, maxcount=4, val=2, progress=False)


def test_cli_parallel_jpg_limit(tmp_path):
    make_flat_folder(tmp_path / "src", 12)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "prepare_data.py"),
            "--source",
            str(tmp_path / "src"),
            "--out",
            str(tmp_path / "out"),
            "--resolution",
            str(RES),
            "--maxcount",
            "3",
            "--workers",
            "2",
            "--format",
            "jpg",
            "--quality",
            "90",
            "--limit",
            "10",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["counts"] == {"train": 10} and manifest["image_format"] == "jpg"
    assert len(manifest["splits"]["train"]["shards"]) == 4
    samples = all_samples(tmp_path / "out")
    assert all("jpg" in s for s in samples.values())
    assert sorted(samples) == sorted(f"{i // 5:02d}000/{i:05d}.png" for i in range(10))  # first 10 sorted
    batch = next(iter(ShardDataModule(tmp_path / "out", batch_size=10, num_workers=0).train_dataloader()))
    assert batch["image"].shape == (10, 3, RES, RES)


def test_cli_user_error_is_one_message(tmp_path, monkeypatch, capsys):
    import runpy

    monkeypatch.setattr(
        sys,
        "argv",
        ["prepare_data.py", "--source", str(tmp_path / "missing"), "--out", str(tmp_path / "x"), "--resolution", "8"],
    )
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "scripts" / "prepare_data.py"), run_name="__main__")
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"error: --source {tmp_path / 'missing'} does not exist\n"


def test_out_that_cannot_be_a_folder_is_one_error(tmp_path):
    make_flat_folder(tmp_path / "src", 2)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(PixditError, match="--out .*file is a file; give a folder"):
        prepare_dataset(tmp_path / "src", tmp_path / "file", RES, progress=False)
    with pytest.raises(PixditError, match=r"--out .*file/out: cannot create it \(Not a directory"):
        prepare_dataset(tmp_path / "src", tmp_path / "file" / "out", RES, progress=False)
    if os.geteuid() != 0:  # root may write anywhere
        (tmp_path / "locked").mkdir(mode=0o500)
        with pytest.raises(PixditError, match=r"--out .*locked/out: cannot create it \(Permission denied"):
            prepare_dataset(tmp_path / "src", tmp_path / "locked" / "out", RES, progress=False)


def test_disk_full_is_one_message_and_the_rerun_completes(tmp_path, monkeypatch):
    import errno

    from pixdit.data.shards import ShardWriter

    make_flat_folder(tmp_path / "src", 9)
    reference = prepare_dataset(tmp_path / "src", tmp_path / "ref", RES, maxcount=3, progress=False)
    write = ShardWriter.write
    calls = []

    def write_until_full(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 4:  # the disk fills up in the second shard
            raise OSError(errno.ENOSPC, "No space left on device", str(self.out_dir / "train-000001.tar.tmp"))
        return write(self, *args, **kwargs)

    monkeypatch.setattr(ShardWriter, "write", write_until_full)
    with pytest.raises(
        PixditError,
        match=r"disk full: no space left writing .*out/train-000001.tar.tmp .*free "
        r"space there.*re-run the same command",
    ):
        prepare_dataset(tmp_path / "src", tmp_path / "out", RES, maxcount=3, progress=False)
    monkeypatch.setattr(ShardWriter, "write", write)
    assert (
        prepare_dataset(tmp_path / "src", tmp_path / "out", RES, maxcount=3, progress=False)["splits"]
        == reference["splits"]
    )


def test_a_second_run_into_the_same_out_is_refused_naming_the_first(tmp_path):
    from pixdit.files import exclusive_lock

    make_flat_folder(tmp_path / "src", 4)
    out = tmp_path / "out"
    (out / ".prepare").mkdir(parents=True)
    command = [
        sys.executable,
        str(REPO / "scripts" / "prepare_data.py"),
        "--source",
        str(tmp_path / "src"),
        "--out",
        str(out),
        "--resolution",
        str(RES),
    ]
    with exclusive_lock(out / ".prepare" / "lock", what="test", fix="-"):  # a first run, in progress
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        with pytest.raises(PixditError, match=f"--out {out} is in use by pid {os.getpid()} on .* since "):
            prepare_dataset(tmp_path / "src", out, RES, progress=False)
    assert second.returncode == 2 and "Traceback" not in second.stderr
    assert f"error: --out {out} is in use by pid {os.getpid()} on " in second.stderr
    assert "wait for that run to finish" in second.stderr
    assert not (out / "manifest.json").exists()  # the second run wrote nothing
    assert prepare_dataset(tmp_path / "src", out, RES, progress=False)["counts"] == {"train": 4}  # lock released


def test_lock_on_a_file_system_without_locks_warns_and_goes_on(tmp_path, monkeypatch):
    import errno
    import fcntl

    from pixdit.files import exclusive_lock

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="--out X: cannot lock .*No locks available.*no other process writes there"):
        with exclusive_lock(tmp_path / "lock", what="--out X", fix="-"):
            assert (tmp_path / "lock").read_text().startswith(f"pid {os.getpid()} on ")
    assert (tmp_path / "lock").read_text() == ""  # a released lock names nobody


def _children(pid: int) -> list[int]:
    """Live (not zombie) child processes of `pid`, from /proc."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(stat.parent.name))
    return children


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc (Linux)")
def test_workers_exit_when_the_run_is_killed(tmp_path):
    import signal
    import time

    make_flat_folder(tmp_path / "src", 40)
    command = [
        sys.executable,
        str(REPO / "scripts" / "prepare_data.py"),
        "--source",
        str(tmp_path / "src"),
        "--out",
        str(tmp_path / "out"),
        "--resolution",
        str(RES),
        "--maxcount",
        "1",
        "--workers",
        "2",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        deadline = time.time() + 60
        while len(_children(process.pid)) < 2 and process.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        process.send_signal(signal.SIGSTOP)  # the run cannot finish now: its workers wait for it
        workers = _children(process.pid)
        assert process.poll() is None and len(workers) >= 2, "the run ended before its workers were seen"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        deadline = time.time() + 20
        while any(_alive(pid) for pid in workers) and time.time() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in workers if _alive(pid)], "pool workers outlived the killed run"
    finally:  # a leak must not outlive the test (only processes of this command: pids may be reused)
        for pid in [process.pid] + workers + _children(process.pid):
            with contextlib.suppress(OSError):
                if b"prepare_data.py" in (Path("/proc") / str(pid) / "cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)


def test_resume_rewrites_a_finished_shard_damaged_since(tmp_path):
    make_flat_folder(tmp_path / "src", 8)
    reference = prepare_dataset(tmp_path / "src", tmp_path / "out", RES, maxcount=4, progress=False)
    shard = tmp_path / "out" / "train-000001.tar"
    shard.write_bytes(shard.read_bytes()[:2048])  # a full disk or a bad copy, after the run
    assert prepare_dataset(tmp_path / "src", tmp_path / "out", RES, maxcount=4, progress=False) == reference
    assert verify_checksums(tmp_path / "out") == []


def test_bad_options_are_clear_errors(tmp_path):
    make_flat_folder(tmp_path / "src", 3)
    Image.fromarray(random_image(0)).save(tmp_path / "src" / "stray.png")
    with pytest.raises(PixditError, match="--labels folders: 1 images .* not inside a class folder"):
        prepare_dataset(tmp_path / "src", tmp_path / "o1", RES, labels="folders", progress=False)
    with pytest.raises(PixditError, match="no class folders and no ImageNet val ground truth"):
        prepare_dataset(tmp_path / "src" / "00000", tmp_path / "o1", RES, labels="folders", progress=False)
    with pytest.raises(PixditError, match="--val must be"):
        prepare_dataset(tmp_path / "src", tmp_path / "o2", RES, val=4, progress=False)
    with pytest.raises(PixditError, match="--format"):
        prepare_dataset(tmp_path / "src", tmp_path / "o3", RES, image_format="gif", progress=False)


def test_prepare_killed_then_rerun_completes_without_duplicates(tmp_path):
    """A real SIGKILL of prepare_data.py part-way, then the same command again: same result as one clean run."""
    import signal
    import time

    make_flat_folder(tmp_path / "src", 60)
    for path in (tmp_path / "src").rglob("*.png"):  # bigger sources: the run takes long enough to be killed
        Image.fromarray(np.kron(np.asarray(Image.open(path)), np.ones((16, 16, 1), np.uint8))).save(path)
    out = tmp_path / "out"
    command = [
        sys.executable,
        str(REPO / "scripts" / "prepare_data.py"),
        "--source",
        str(tmp_path / "src"),
        "--out",
        str(out),
        "--resolution",
        str(RES),
        "--maxcount",
        "2",
        "--val",
        "4",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while process.poll() is None and time.time() < deadline:
        if len(list((out / ".prepare").glob("train-*.json"))) >= 3:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.005)
    process.wait(timeout=60)
    resumed = prepare_dataset(tmp_path / "src", out, RES, maxcount=2, val=4, progress=False)
    reference = prepare_dataset(tmp_path / "src", tmp_path / "ref", RES, maxcount=2, val=4, progress=False)
    assert resumed["splits"] == reference["splits"]
    assert len(all_samples(out)) == 60 and not list(out.glob("*.tmp"))


# ---- every PIL image mode: converted by its bit depth, or skipped with the reason ----------------------------------
GRADIENT = np.arange(RES * RES).reshape(RES, RES) % 256  # every 8-bit level, 0..255


def colour_image() -> Image.Image:
    pixels = np.stack([GRADIENT, GRADIENT[::-1], GRADIENT.T], axis=-1).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


# mode -> (file format, the image): 8-bit modes come from one colour image and must come out as PIL converts them
EIGHT_BIT = {
    "1": "PNG",
    "L": "PNG",
    "LA": "PNG",
    "P": "PNG",
    "PA": "TIFF",
    "RGB": "PNG",
    "RGBA": "PNG",
    "RGBX": "TIFF",
    "CMYK": "TIFF",
    "YCbCr": "TIFF",
    "LAB": "TIFF",
}
# high-bit-depth greyscale: the stored value of 8-bit level k, and the file format
WIDE = {
    "I;16": (GRADIENT * 257, np.uint16, "PNG"),
    "I;16B": (GRADIENT * 257, ">u2", "TIFF"),
    "I": (np.rint(GRADIENT * ((2**31 - 1) / 255)), np.int32, "TIFF"),
    "F": (GRADIENT / 255, np.float32, "TIFF"),
}


def test_every_writable_pil_mode_is_converted_by_its_bit_depth(tmp_path):
    (tmp_path / "src").mkdir()
    expected = {}
    for mode, file_format in EIGHT_BIT.items():
        name = f"{mode.replace(';', '_')}.{file_format.lower()}"
        colour_image().convert(mode).save(tmp_path / "src" / name, format=file_format)
        with Image.open(tmp_path / "src" / name) as stored:
            assert stored.mode == {"RGBX": "RGB"}.get(mode, mode)  # the file really holds that mode
            expected[name] = np.asarray(stored.convert("RGB"))  # PIL's own conversion of 8-bit modes
    for mode, (values, dtype, file_format) in WIDE.items():
        name = f"{mode.replace(';', '_')}.{file_format.lower()}"
        image = (
            Image.fromarray(values.astype(dtype))
            if mode != "I;16B"
            else Image.frombytes("I;16B", (RES, RES), values.astype(dtype).tobytes())
        )
        image.save(tmp_path / "src" / name, format=file_format)
        with Image.open(tmp_path / "src" / name) as stored:
            assert stored.mode in (mode, "I;16") and stored.mode[0] == mode[0]
        expected[name] = np.repeat(GRADIENT[..., None], 3, axis=-1).astype(np.uint8)  # level k, exactly
    manifest = prepare_dataset(tmp_path / "src", tmp_path / "out", RES, progress=False)
    assert manifest["skipped_count"] == 0 and manifest["counts"]["train"] == len(expected)
    for name, sample in all_samples(tmp_path / "out").items():
        got = np.asarray(Image.open(io.BytesIO(sample["png"])))
        assert np.array_equal(got, expected[name]), name


def test_modes_no_file_format_keeps_are_converted_too():
    from pixdit.data.imageops import to_rgb8

    rgb = colour_image()
    for mode in ("HSV", "RGBa"):
        image = rgb.convert(mode)
        assert np.array_equal(np.asarray(to_rgb8(image)), np.asarray(image.convert("RGB"))), mode
    premultiplied = Image.merge("La", [Image.fromarray(GRADIENT.astype(np.uint8))] * 2)
    assert np.array_equal(np.asarray(to_rgb8(premultiplied)), np.asarray(premultiplied.convert("LA").convert("RGB")))
    native = Image.frombytes("I;16N", (RES, RES), (GRADIENT * 257).astype("=u2").tobytes())
    assert np.array_equal(np.asarray(to_rgb8(native))[..., 0], GRADIENT)


def test_images_with_no_faithful_8_bit_version_are_skipped_with_the_reason(tmp_path):
    (tmp_path / "src").mkdir()
    colour_image().save(tmp_path / "src" / "good.png")
    Image.fromarray((GRADIENT * 1.0).astype(np.float32)).save(tmp_path / "src" / "float255.tif")  # not 0..1
    nan = (GRADIENT / 255).astype(np.float32)
    nan[0, 0] = np.nan
    Image.fromarray(nan).save(tmp_path / "src" / "nan.tif")
    Image.fromarray((GRADIENT % 100).astype(np.uint16)).save(tmp_path / "src" / "faint16.png")  # < 1/255 of range
    Image.fromarray(-GRADIENT.astype(np.int32)).save(tmp_path / "src" / "negative.tif")
    manifest = prepare_dataset(tmp_path / "src", tmp_path / "out", RES, progress=False)
    assert manifest["counts"]["train"] == 1
    reasons = {Path(s["path"]).name: s["error"] for s in manifest["splits"]["train"]["skipped"]}
    assert sorted(reasons) == ["faint16.png", "float255.tif", "nan.tif", "negative.tif"]
    assert (
        "32-bit float greyscale image (mode F) with values in [0, 255]; pixdit maps [0, 1.0]" in reasons["float255.tif"]
    )
    assert "NaN" in reasons["nan.tif"]
    assert "16-bit greyscale image (mode I;16) with values in [0, 99]" in reasons["faint16.png"]
    assert "one flat grey level" in reasons["faint16.png"]
    assert "values in [-255, 0]" in reasons["negative.tif"]

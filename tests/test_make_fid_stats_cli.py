"""pixdit-make-fid-stats: settings it refuses before any expensive work (the Inception weights are not needed to
be told). The statistics themselves are tested in test_eval_pipeline.py."""

from pixdit.cli import make_fid_stats


def test_resolution_below_one_is_refused_before_the_weights_are_looked_for(tmp_path, capsys):
    for bad in ("0", "-32"):
        args = ["--shards", str(tmp_path), "--resolution", bad, "--inception-path", str(tmp_path / "missing.pt")]
        assert make_fid_stats.main(args) == 2
        assert capsys.readouterr().err == (
            f"error: --resolution must be >= 1 (pixels), got {bad}; leave it out to use the shards' own resolution\n"
        )

"""pixdit.config.construct: config sections -> objects, user mistakes named. .venv/bin/python -m pytest tests/test_config.py"""

import pytest

from pixdit.config import construct
from pixdit.errors import PixditError


def make(dirpath: str, every_n_train_steps: int = 10, name: str = "x"):
    return dirpath, every_n_train_steps, name


def test_a_key_pixdit_sets_itself_is_named_as_such():
    """callbacks.checkpoint.dirpath is a real ModelCheckpoint argument that pixdit fills in: say so, instead of
    calling it an unknown key (which is what the user would read if the check for unknown keys came first)."""
    with pytest.raises(PixditError, match=r"section: \['dirpath'\] is set by pixdit itself"):
        construct(make, {"dirpath": "/elsewhere"}, "section", dirpath="/run")


def test_unknown_key_and_word_for_number_are_named():
    with pytest.raises(
        PixditError, match=r"unknown key\(s\) \['every_n_train_step'\] in section; .*every_n_train_steps, name"
    ):
        construct(make, {"every_n_train_step": 3}, "section", dirpath="/run")
    with pytest.raises(PixditError, match=r"section.every_n_train_steps='abc' must be int"):
        construct(make, {"every_n_train_steps": "abc"}, "section", dirpath="/run")
    assert construct(make, {"every_n_train_steps": 3}, "section", dirpath="/run") == ("/run", 3, "x")


def test_fid_word_for_a_number_is_named(tmp_path):
    """callbacks.fid.every_n_train_steps=abc: a clear message, not a TypeError from comparing a word with 0."""
    from pixdit.callbacks import build_callbacks

    with pytest.raises(PixditError, match=r"callbacks.fid.every_n_train_steps='abc' must be int"):
        build_callbacks({"fid": {"every_n_train_steps": "abc"}}, tmp_path)
    assert build_callbacks({"fid": {"every_n_train_steps": 0, "at_end": False}}, tmp_path) == []  # off: not built

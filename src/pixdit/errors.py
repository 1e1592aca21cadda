"""User-facing errors.

`PixditError` marks a mistake the user can fix (a bad config value, missing data or weights, a shape the chosen
attention cannot handle). `train.py` and the scripts print such errors as one clear message instead of a traceback;
every other exception is a bug and keeps its traceback.
"""


class PixditError(Exception):
    """A user mistake, reported as a single message that names the parameter and the allowed values."""

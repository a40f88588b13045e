"""Name matching shared by the model and hardware catalogues."""

from __future__ import annotations


def normalize(name: str) -> str:
    """Lower-case, drop an org prefix ("facebook/opt-13b") and vendor word, unify separators."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = key.replace("_", "-").replace(" ", "-")
    return key.removeprefix("nvidia-")

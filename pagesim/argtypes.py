"""argparse `type=` converters that refuse bad values while the command line is parsed.

A bad value then ends the command before anything runs, with argparse's one line naming the flag
(`pagesim simulate: error: argument --rate: must be > 0 ...`) and exit code 2, instead of a
traceback, a silent replacement, or an error after minutes of simulation. Each converter returns
the parsed value (`out_dir` the text itself) or raises argparse.ArgumentTypeError.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

SEED_LIMIT = 2**32  # numpy's legacy seeding and most tools take seeds in [0, 2**32)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _checked(value: float, ok: bool, must: str, text: str) -> float:
    """`value` when `ok`, else the one-line error "<must>, got <text>"."""
    if not ok:
        raise argparse.ArgumentTypeError(f"{must}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (counts, sizes, widths)."""
    value = _int(text)
    return _checked(value, value >= 1, "must be an integer >= 1", text)


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    return _checked(value, value >= 0, "must be an integer >= 0", text)


def seed(text: str) -> int:
    """A seed: an integer in [0, 2**32)."""
    value = _int(text)
    return _checked(value, 0 <= value < SEED_LIMIT, "must be an integer in [0, 2**32)", text)


def positive_float(text: str) -> float:
    """A finite number > 0 (SLOs, limits, coefficients of variation)."""
    value = _float(text)
    return _checked(value, value > 0, "must be a finite number > 0", text)


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text)
    return _checked(value, value >= 0, "must be a finite number >= 0", text)


def fraction(text: str) -> float:
    """A number in (0, 1]."""
    value = _float(text)
    return _checked(value, 0 < value <= 1, "must be in (0, 1]", text)


def rate(text: str) -> float:
    """A request rate (req/s): finite and > 0, with a finite mean gap 1/rate."""
    value = positive_float(text)
    if not math.isfinite(1.0 / value):
        raise argparse.ArgumentTypeError(f"{text} req/s is too small: the mean gap 1/rate overflows")
    return value


def out_dir(text: str) -> str:
    """An output directory: new or existing, but neither it nor a folder above it an existing file
    (refused now rather than when the results are written, after the run)."""
    path = Path(text)
    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                where = "names an existing file" if p == path else f"is inside {p}, an existing file"
                raise argparse.ArgumentTypeError(f"{text} {where}; give a directory")
            break
    return text


def out_file(text: str) -> str:
    """An output file: not an existing folder, and no existing file in the way of its folders, with
    write permission where it goes (refused now rather than when it is written, after a long run)."""
    path = Path(text)
    if text.endswith(("/", "\\")) or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name")
    for p in path.parents:
        if p.exists() and not p.is_dir():
            raise argparse.ArgumentTypeError(f"{text}: {p} is an existing file, not a folder")
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not os.access(existing, os.W_OK):  # the file itself, or the folder where it (or its folders) would be made
        raise argparse.ArgumentTypeError(f"{text}: {existing} is not writable")
    return text

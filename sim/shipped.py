"""Data files the project ships beside its code (profiles, calibrations), found by path or name."""

from __future__ import annotations

import json
from pathlib import Path


def shipped_names(folder: Path) -> list[str]:
    """The names (file stems) of the JSON files shipped in `folder`."""
    return sorted(p.stem for p in folder.glob("*.json"))


def resolve_shipped(name: str | Path, folder: Path, kind: str) -> Path:
    """`name` as a file path, else the file of that name shipped in `folder`; a FileNotFoundError
    listing the shipped ones otherwise (`kind`: what the files are, for the message)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = folder / f"{name}.json"
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(f"no {kind} file {str(name)!r}; shipped {kind}s: "
                            f"{', '.join(shipped_names(folder)) or 'none'}")


def read_checked(path: Path, kind: str, fmt: str, version: int, fields: tuple[str, ...]) -> dict:
    """A pagesim data file's JSON object, checked for its format tag, its version and its required
    top-level fields; each error names the file and what is wrong (`kind`: what the file is)."""
    try:
        d = json.loads(path.read_text(encoding="utf-8-sig"))  # past a byte-order mark (was: refused)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from exc
    except (OSError, UnicodeDecodeError) as exc:  # a folder, unreadable, binary: name the file
        raise ValueError(f"{path}: cannot read: {exc}") from exc
    if not isinstance(d, dict) or d.get("format") != fmt:
        raise ValueError(f"{path}: not a pagesim {kind} (expected \"format\": \"{fmt}\")")
    if d.get("version") != version:
        raise ValueError(f"{path}: {kind} version {d.get('version')!r}; this pagesim reads {version}")
    for key in fields:
        if key not in d:
            raise ValueError(f"{path}: missing field {key!r}")
    return d

"""Data files the project ships beside its code (profiles, calibrations), found by path or name."""

from __future__ import annotations

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

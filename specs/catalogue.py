"""Finding a model: the shipped catalogue (HF config.json files in specs/models/), a config.json path,
a folder holding one, or a HF id ("meta-llama/Llama-2-7b-hf") looked up in folders of configs.

The catalogue is read once at import into `MODELS` (name -> spec); it is constant data, so the same
name always gives the same object.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from specs.json_file import read_json
from specs.model import ModelSpec
from specs.names import normalize

CATALOGUE_DIR = Path(__file__).parent / "models"

_MODEL_ALIASES = {
    "meta-llama-3-8b": "llama-3-8b", "llama3-8b": "llama-3-8b",
    "meta-llama-3-70b": "llama-3-70b", "llama3-70b": "llama-3-70b",
    "meta-llama-3.1-8b": "llama-3.1-8b", "llama3.1-8b": "llama-3.1-8b", "llama-3.1-8b-instruct": "llama-3.1-8b",
    "meta-llama-3.1-70b": "llama-3.1-70b", "llama3.1-70b": "llama-3.1-70b",
    "llama-1-7b": "llama-7b", "llama-1-13b": "llama-13b",
}


def read_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """The spec in one HF config.json file, named `name` (default: the file's stem, or its folder's
    name for a file called config.json). Errors name the file."""
    path = Path(path)
    if name is None:
        name = path.parent.name if path.name == "config.json" else path.stem
    cfg = read_json(path)
    return ModelSpec.from_hf_config(cfg, name=name, source=str(path))


def _catalogue() -> dict[str, ModelSpec]:
    return {p.stem: read_config(p) for p in sorted(CATALOGUE_DIR.glob("*.json"))}


MODELS: dict[str, ModelSpec] = _catalogue()


def find_config(name_or_path: str, search_dirs: Sequence[str | Path] = ()) -> Path | None:
    """The config file `name_or_path` names: itself, its config.json, or for a HF id
    `<last component lower-cased>.json` or `<that>/config.json` (or the component as given) in one
    of `search_dirs` (in order),
    then in the folder the name itself points into ("../models/Llama-2-7b-hf" finds
    ../models/llama-2-7b-hf.json). None when it names no file (it may still be a catalogue name)."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    given = _last_part(name_or_path)
    for d in [*search_dirs, *_beside(name_or_path)]:
        for last in dict.fromkeys((given.lower(), given)):  # lower-cased first, then as given
            for candidate in (Path(d) / f"{last}.json", Path(d) / last / "config.json"):
                if candidate.is_file():
                    return candidate
    return None


# Fine-tuned variants share their base model's shapes: "Mixtral-8x7B-Instruct-v0.1" is "mixtral-8x7b-v0.1",
# "Meta-Llama-3.1-8B-Instruct" is "llama-3.1-8b-instruct", "Qwen3-30B-A3B-Instruct-2507" (a release date,
# yymm) is "qwen3-30b-a3b". An fp8 checkpoint ("...-FP8", "...-FP8-dynamic") has them too, at one byte a weight.
_VARIANT_WORDS = {"instruct", "chat", "hf", "it", "base"}
_FP8_WORDS = {"fp8", "dynamic"}


def _is_release_date(word: str) -> bool:
    return len(word) == 4 and word.isdigit() and 23 <= int(word[:2]) <= 29 and 1 <= int(word[2:]) <= 12


def _last_part(name_or_path: str) -> str:
    """The name's last component, as given ("meta-llama/Llama-2-7b-hf/": "Llama-2-7b-hf")."""
    return name_or_path.strip().rstrip("/").rsplit("/", 1)[-1]


def _words(name: str) -> list[str]:
    """The lower-cased words of a model name, split at '-' and '_'."""
    return [w for w in name.lower().replace("_", "-").split("-") if w]


def _shape_key(name: str) -> tuple[str, ...]:
    words = _words(name)
    if words[:2] == ["meta", "llama"]:  # Meta's own ids spelled the family "Meta-Llama" until Llama 3.1
        words = words[1:]
    return tuple(w for w in words if w not in _VARIANT_WORDS | _FP8_WORDS and not _is_release_date(w))


def _is_fp8(name: str) -> bool:
    return "fp8" in _words(name)


def _variant_config(given: str, dirs: Sequence[str | Path]) -> Path | None:
    """The one config in `dirs` whose name equals `given` but for variant words (instruct, chat, hf,
    it, base, a "Meta-" before "Llama", a yymm release date, fp8), with a warning that says which
    file stands in (once per name and folders: a run resolves its model many times); None if none
    or several match."""
    return _variant_config_once(given, tuple(Path(d) for d in dirs))


@functools.lru_cache(maxsize=256)
def _variant_config_once(given: str, dirs: tuple[Path, ...]) -> Path | None:
    key = _shape_key(given)
    for d in dirs:
        d = Path(d)
        found = {p for p in d.glob("*.json") if _shape_key(p.stem) == key}
        found |= {p / "config.json" for p in d.iterdir() if p.is_dir() and (p / "config.json").is_file()
                  and _shape_key(p.name) == key} if d.is_dir() else set()
        if len(found) == 1:
            path = found.pop()
            fp8 = " read at one byte a weight (fp8)" if _is_fp8(given) and not _is_fp8(path.stem) else ""
            warnings.warn(f"model {given!r}: no config of that name; using {_shown(path)}{fp8} (the same model but for "
                          f"variant words such as instruct/chat/hf or a release date: the same shapes)", stacklevel=4)
            return path
    return None


def _shown(path: Path) -> str:
    """A path as a message shows it, never the machine's absolute path: relative to the working
    folder when it is near (../shared/models/...), else its folder and name."""
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        rel = ""
    if rel and not rel.startswith(os.path.join(os.pardir, os.pardir)):
        return rel
    return str(Path(path.parent.name) / path.name)


def catalogue_name(name: str) -> str | None:
    """The catalogue entry `name` (or an alias, org prefix and case aside) refers to, or None."""
    key = normalize(name)
    key = _MODEL_ALIASES.get(key, key)
    return key if key in MODELS else None


def load_model(name_or_path: str, search_dirs: Sequence[str | Path] = ()) -> ModelSpec:
    """A model spec from a path to a config.json, a folder with one, a catalogue name ("opt-13b",
    "facebook/opt-13b"), or a HF id found in `search_dirs` (see `find_config`), or failing those a
    variant of one of them (`_variant_config`). A path wins over a catalogue name. Unknown ->
    ValueError listing what was tried."""
    path = find_config(name_or_path, search_dirs)
    if path is not None:
        return read_config(path)
    key = catalogue_name(name_or_path)
    if key is not None:
        return MODELS[key]
    given = _last_part(name_or_path)
    variant = _variant_config(given, [*search_dirs, *_beside(name_or_path), CATALOGUE_DIR])
    if variant is not None:
        spec = read_config(variant)
        if _is_fp8(given) and spec.dtype_bytes > 1:  # fp8 weights; vLLM's default cache keeps the model's dtype
            return dataclasses.replace(spec, name=f"{spec.name}-fp8", dtype_bytes=1, kv_dtype_bytes=spec.dtype_bytes)
        return spec
    last = given.lower()
    tried = f"not a file or a folder with config.json; not in the catalogue (known: {', '.join(sorted(MODELS))})"
    if search_dirs:
        tried += f"; no {last}.json or {last}/config.json in {', '.join(str(d) for d in search_dirs)}"
    else:
        tried += "; for a HF id, give --models-dir with its config"
    raise ValueError(f"unknown model {name_or_path!r}: {tried}")


def resolve_model_name(name_or_path: str, search_dirs: Sequence[str | Path] = ()) -> str:
    """What a SimConfig's `model` takes for `name_or_path` so that `load_model` without the search
    folders finds the same spec: its config file's path (a variant's base config's, when the spec
    is that file's), its catalogue name, or else its own last component in its base config's folder
    ("<dir>/Qwen3-14B-FP8", found beside). Raises as `load_model` for an unknown model."""
    spec = load_model(name_or_path, search_dirs)
    path = find_config(name_or_path, search_dirs)
    if path is not None:
        return str(path)
    key = catalogue_name(name_or_path)
    if key is not None:
        return key
    if read_config(spec.source) == spec:  # a variant with its base model's spec: that config's path
        return spec.source
    given = _last_part(name_or_path)
    return str(Path(spec.source).parent / given)


def _beside(name_or_path: str) -> list[Path]:
    """The folder a name points into ("../models/Llama-2-7b-hf": ../models), if it is one."""
    parent = Path(name_or_path).expanduser().parent
    return [parent] if parent != Path(".") and parent.is_dir() else []


def get_model(name_or_path: str, search_dirs: Sequence[str | Path] = ()) -> ModelSpec:
    """Alias of `load_model` (the simulator's historic name)."""
    return load_model(name_or_path, search_dirs)

"""Cost models by name: "roofline", "linear" and "profiled" (sim.cost_model says what each is)."""

from __future__ import annotations

from typing import Any

from sim.cost_model import ConstantCostModel, CostModel, RooflineCostModel
from sim.profiled import ProfiledCostModel
from sim.specs import get_hardware, get_model

_REGISTRY = {"roofline": RooflineCostModel, "linear": ConstantCostModel}


def make_cost_model(name: str, **kw: Any) -> CostModel:
    """Build a registered cost model by name ("roofline", "linear" or "profiled"), case-insensitively.

    For "roofline", `model` and `hardware` may be spec objects or names ("opt-13b", "a100-40gb").
    For "profiled", `profile` is a profile file's path or a shipped profile's name, `block_size` the
    simulation's block size (default the profile's).
    """
    key = name.strip().lower()
    if key == "profiled":
        return ProfiledCostModel.from_profile(kw["profile"], sim_block_size=kw.get("block_size"))
    if key not in _REGISTRY:
        raise ValueError(f"unknown cost model {name!r}; known: {', '.join(sorted([*_REGISTRY, 'profiled']))}")
    if key == "roofline":
        if isinstance(kw.get("model"), str):
            kw["model"] = get_model(kw["model"])
        if isinstance(kw.get("hardware"), str):
            kw["hardware"] = get_hardware(kw["hardware"])
    return _REGISTRY[key](**kw)

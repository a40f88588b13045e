"""Specs, KV capacity and cost models (sim/specs.py, sim/cost_model.py)."""

from __future__ import annotations

import numpy as np
import pytest

from policies.plan import StepComposition
from sim.cost_model import (
    ConstantCostModel,
    CostModel,
    RooflineCostModel,
)
from sim.cost_registry import make_cost_model
from sim.specs import (
    HARDWARE,
    MODELS,
    GiB,
    ModelSpec,
    get_hardware,
    get_model,
    kv_capacity_blocks,
    kv_capacity_tokens,
)

OPT13 = get_model("opt-13b")
A100_40 = get_hardware("a100-40gb")


def decode(n: int, ctx_each: int) -> StepComposition:
    return StepComposition(num_decode_seqs=n, decode_context_tokens=n * ctx_each)


def prefill(n_seqs: int, tokens_each: int) -> StepComposition:
    pairs = n_seqs * tokens_each * (tokens_each + 1) // 2
    return StepComposition(num_prefill_seqs=n_seqs, prefill_tokens=n_seqs * tokens_each,
                           prefill_attn_pairs=pairs)


# --- specs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, published", [
    ("opt-13b", 12.9e9), ("opt-66b", 66e9), ("opt-175b", 175e9), ("llama-7b", 6.7e9),
    ("llama-13b", 13.0e9), ("llama-3-8b", 8.0e9), ("llama-3-70b", 70.6e9), ("smollm2-135m", 135e6),
])
def test_param_counts_near_public_figures(name: str, published: float) -> None:
    assert get_model(name).num_params == pytest.approx(published, rel=0.03)


def test_kv_bytes_per_token_opt13b_is_800kb() -> None:
    assert OPT13.kv_bytes_per_token == 800 * 1024
    assert get_model("llama-3-8b").kv_bytes_per_token == 128 * 1024  # GQA: 8 KV heads
    assert OPT13.weight_bytes == 2 * OPT13.num_params


def test_opt13b_on_a100_40gb_capacity_matches_vllm_paper() -> None:
    # vLLM paper: 12 GB of KV cache, 15.7K token slots. Must emerge, not be forced.
    tokens = kv_capacity_tokens(OPT13, A100_40)
    assert tokens == pytest.approx(15.7e3, rel=0.15)
    assert tokens * OPT13.kv_bytes_per_token / GiB == pytest.approx(12, rel=0.15)
    assert kv_capacity_blocks(OPT13, A100_40, block_size=16) == tokens // 16


def test_capacity_grows_with_tp_and_utilization() -> None:
    llama70 = get_model("llama-3-70b")
    h100 = get_hardware("h100-sxm")
    assert kv_capacity_tokens(llama70, h100, tp=8) > kv_capacity_tokens(llama70, h100, tp=4)
    default = kv_capacity_tokens(OPT13, A100_40)
    assert kv_capacity_tokens(OPT13, A100_40, gpu_memory_utilization=0.95) > default
    # An explicit reserve replaces the derived one.
    assert kv_capacity_tokens(OPT13, A100_40, activation_reserve_bytes=0) > default


def test_weights_that_do_not_fit_raise() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        kv_capacity_tokens(get_model("opt-175b"), A100_40)
    with pytest.raises(ValueError, match="does not fit"):
        kv_capacity_tokens(get_model("llama-3-70b"), get_hardware("h200"), tp=1)


def test_lookup_is_case_insensitive_with_aliases() -> None:
    assert get_hardware("A100-40GB") is A100_40
    assert get_hardware("NVIDIA H100 80GB HBM3") is HARDWARE["h100-sxm"]
    assert get_model("facebook/opt-13b") is OPT13
    assert get_model("meta-llama/Meta-Llama-3-8B") is MODELS["llama-3-8b"]
    assert get_model("HuggingFaceTB/SmolLM2-135M") is MODELS["smollm2-135m"]


def test_unknown_names_raise_listing_known_ones() -> None:
    with pytest.raises(ValueError, match="opt-13b") as e:
        get_model("gpt-5")
    assert "smollm2-135m" in str(e.value)
    with pytest.raises(ValueError, match="a100-40gb"):
        get_hardware("tpu-v5")
    with pytest.raises(ValueError, match=r"linear.*roofline"):
        make_cost_model("vidur")


def test_model_spec_validates() -> None:
    with pytest.raises(ValueError, match="arch"):
        ModelSpec("x", "gpt2", 2, 64, 4, 4, 16, 256, 100, 128)
    with pytest.raises(ValueError, match="multiple"):
        ModelSpec("x", "llama", 2, 64, 4, 3, 16, 256, 100, 128)


# --- roofline -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def roof() -> RooflineCostModel:
    return RooflineCostModel(OPT13, A100_40)


def test_empty_step_costs_nothing(roof: RooflineCostModel) -> None:
    assert roof.step_time(StepComposition()) == 0.0


def test_roofline_monotonic_in_tokens_and_context(roof: RooflineCostModel) -> None:
    prefills = [roof.step_time(prefill(1, n)) for n in (1, 16, 128, 512, 2048, 4096)]
    assert np.all(np.diff(prefills) > 0)
    batches = [roof.step_time(decode(n, 500)) for n in (1, 2, 8, 32, 128, 256)]
    assert np.all(np.diff(batches) > 0)
    contexts = [roof.step_time(decode(32, c)) for c in (1, 10, 100, 1000, 2000)]
    assert np.all(np.diff(contexts) > 0)
    cached = [roof.step_time(StepComposition(num_prefill_seqs=1, prefill_tokens=64, prefill_attn_pairs=64 * p,
                                             prefill_context_tokens=p)) for p in (0, 100, 1000)]
    assert np.all(np.diff(cached) > 0)


def test_small_batch_decode_is_memory_bound(roof: RooflineCostModel) -> None:
    model = RooflineCostModel(OPT13, A100_40, memory_efficiency=0.8, overhead_s=4e-3)
    expected = 4e-3 + OPT13.weight_bytes / (A100_40.mem_bandwidth * 0.8)
    assert model.step_time(decode(1, 500)) == pytest.approx(expected, rel=0.05)
    # The linear layers' time is their weight bytes over bandwidth: FLOPs play no part at batch 1.
    layer_bytes = OPT13.num_layers * OPT13.params_per_layer * OPT13.dtype_bytes
    linear = model.breakdown(decode(1, 500))["linear"]
    assert linear == pytest.approx(layer_bytes / (A100_40.mem_bandwidth * 0.8), rel=0.01)


def test_large_prefill_is_compute_bound(roof: RooflineCostModel) -> None:
    parts = roof.breakdown(prefill(4, 1024))
    flops = 2 * OPT13.num_layers * OPT13.params_per_layer * 4096
    assert parts["linear"] == pytest.approx(flops / (A100_40.peak_flops * 0.7), rel=1e-9)


def test_breakdown_sums_to_step_time(roof: RooflineCostModel) -> None:
    c = StepComposition(num_prefill_seqs=2, prefill_tokens=300, prefill_attn_pairs=40000,
                        prefill_context_tokens=50, num_decode_seqs=10, decode_context_tokens=4000,
                        swap_in_blocks=3, swap_out_blocks=2, copy_blocks=1)
    assert sum(roof.breakdown(c).values()) == pytest.approx(roof.step_time(c), rel=1e-12)


@pytest.mark.parametrize("tp", [1, 2])
def test_decode_step_times_equals_step_time(tp: int) -> None:
    rng = np.random.default_rng(0)
    seqs = np.concatenate([[0, 1], rng.integers(1, 300, size=50)])
    ctx = seqs * rng.integers(1, 3000, size=seqs.size)
    for model in (RooflineCostModel(get_model("opt-66b"), get_hardware("a100-80gb"), tp=tp),
                  ConstantCostModel(1e-4, 2e-4, 5e-3), _LoopOnly()):
        got = model.decode_step_times(seqs, ctx)
        want = [model.step_time(StepComposition(num_decode_seqs=int(n), decode_context_tokens=int(k)))
                for n, k in zip(seqs, ctx, strict=True)]
        # bit for bit: skipping ahead must land on the very times stepping computes
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal([model.decode_step_time(int(n), int(k)) for n, k in zip(seqs, ctx)], want)
        if isinstance(model, RooflineCostModel):  # the scalar decode shortcut equals the general sum
            general = [float(model._total(model._composition_groups(
                StepComposition(num_decode_seqs=int(n), decode_context_tokens=int(k))))) if n else 0.0
                for n, k in zip(seqs, ctx, strict=True)]
            np.testing.assert_array_equal(want, general)
        for n in {int(x) for x in seqs[:10]}:  # a window's series of one batch size, as price_repeat asks
            series = [int(n) * j + 7 for j in range(1, 9)]
            np.testing.assert_array_equal(model.decode_step_series(n, 7, 8),
                                          [model.decode_step_time(n, k) for k in series])
            np.testing.assert_array_equal(model.decode_step_series(n, 7, 8),
                                          model.decode_step_times(np.full(8, n), np.array(series)))


class _GeneralPath(RooflineCostModel):
    """The roofline priced by its general path only (a subclass never takes the float path)."""


@pytest.mark.parametrize("tp", [1, 2])
def test_float_step_time_equals_the_general_sum(tp: int) -> None:
    # compositions with prefills, swaps and copies: the dense model's plain-float step_time must
    # give the general path's (the operator groups added in order) bit for bit
    rng = np.random.default_rng(1)
    spec, hw = get_model("opt-66b"), get_hardware("a100-80gb")
    fast, general = RooflineCostModel(spec, hw, tp=tp), _GeneralPath(spec, hw, tp=tp)
    comps = [StepComposition(num_prefill_seqs=p, prefill_tokens=t, prefill_attn_pairs=t * (t + 1) // 2 + t * x,
                             prefill_context_tokens=x, num_decode_seqs=d, decode_context_tokens=d * int(k),
                             swap_in_blocks=si, swap_out_blocks=so, copy_blocks=cp)
             for p, t, x, d, k, si, so, cp in zip(*(rng.integers(lo, hi, 200).tolist() for lo, hi in (
                 (0, 4), (1, 3000), (0, 500), (0, 200), (1, 4000), (0, 3), (0, 3), (0, 2))), strict=True)]
    comps = [StepComposition(**{**c.counts(), "prefill_tokens": c.prefill_tokens if c.num_prefill_seqs else 0,
                                "prefill_attn_pairs": c.prefill_attn_pairs if c.num_prefill_seqs else 0,
                                "prefill_context_tokens": c.prefill_context_tokens if c.num_prefill_seqs else 0})
             for c in comps]
    assert sum(c.num_prefill_seqs > 0 for c in comps) > 100 and sum(c.swap_in_blocks > 0 for c in comps) > 50
    got = [fast.step_time(c) for c in comps]
    want = [general.step_time(c) for c in comps]
    assert got == want
    for c, t in zip(comps, want, strict=True):
        total = 0.0
        for part in general.breakdown(c).values():
            total = total + part
        assert t == (total if not c.is_empty else 0.0)


def test_tensor_parallel_speeds_up_a_big_model() -> None:
    opt66 = get_model("opt-66b")
    a100 = get_hardware("a100-80gb")
    tp1, tp2 = RooflineCostModel(opt66, a100, tp=1), RooflineCostModel(opt66, a100, tp=2)
    for c in (decode(8, 500), decode(128, 1000), prefill(2, 1024)):
        assert tp2.step_time(c) < tp1.step_time(c)
    assert tp2.breakdown(decode(8, 500))["allreduce"] > 0
    assert tp1.breakdown(decode(8, 500))["allreduce"] == 0


def test_swap_time_scales_with_blocks(roof: RooflineCostModel) -> None:
    one = roof.swap_time(1, 16)
    assert one > 0
    assert roof.swap_time(10, 16) == pytest.approx(10 * one)
    # bytes double with the block size; the per-copy latencies (2 per layer) do not
    latency = 2 * roof.model.num_layers * roof.memcpy_latency_s
    assert roof.swap_time(1, 32) - latency == pytest.approx(2 * (one - latency))
    bytes_16 = 16 * roof.model.kv_bytes_per_token / (roof.hardware.pcie_bandwidth * 0.75)
    assert one == pytest.approx(latency + bytes_16)
    base = roof.step_time(decode(4, 100))
    with_swap = roof.step_time(StepComposition(num_decode_seqs=4, decode_context_tokens=400, swap_in_blocks=6,
                                               swap_out_blocks=4))
    assert with_swap == pytest.approx(base + roof.swap_time(10, 16))
    # A swap-only iteration still pays the fixed overhead.
    swap_only = roof.step_time(StepComposition(swap_out_blocks=5))
    assert swap_only == pytest.approx(roof.overhead_s + roof.swap_time(5, 16))


def test_make_cost_model_resolves_names() -> None:
    m = make_cost_model("Roofline", model="opt-13b", hardware="A100-40GB", tp=1)
    assert isinstance(m, RooflineCostModel) and m.model is OPT13
    lin = make_cost_model("linear", prefill_per_token=1e-4, decode_per_seq=2e-4, base=5e-3)
    assert isinstance(lin, ConstantCostModel)
    with pytest.raises(ValueError, match="efficiency"):
        RooflineCostModel(OPT13, A100_40, memory_efficiency=1.5)


# --- linear ---------------------------------------------------------------------------------------

def test_constant_model_by_hand() -> None:
    m = ConstantCostModel(prefill_per_token=1e-4, decode_per_seq=2e-3, base=0.01, swap_per_block=1e-3)
    c = StepComposition(num_prefill_seqs=1, prefill_tokens=100, prefill_attn_pairs=5050, num_decode_seqs=5,
                        decode_context_tokens=500, swap_in_blocks=2)
    assert m.step_time(c) == pytest.approx(0.01 + 100 * 1e-4 + 5 * 2e-3 + 2 * 1e-3)
    assert m.step_time(StepComposition()) == 0.0


class _LoopOnly(CostModel):
    """Exercises the base class's default (looping) decode_step_times."""

    def step_time(self, c: StepComposition) -> float:
        return 0.0 if c.is_empty else 1e-3 + 1e-6 * c.decode_context_tokens

    def swap_time(self, num_blocks: int, block_size: int) -> float:
        return 0.0


def test_small_blocks_make_swapping_dearer_than_recomputing(roof: RooflineCostModel) -> None:
    """Per token, a swap out and back in costs 2 x (2L call latencies / block size + bytes); recompute
    costs a prefill share. For OPT-13B on an A100 the latencies decide: swapping 1-token blocks
    costs more than recomputing, 256-token blocks less (the vLLM paper's Figure 19 trade-off)."""
    def swap_per_token(bs: int) -> float:
        return 2 * roof.swap_time(1, bs) / bs

    recompute = roof.step_time(prefill(1, 1024)) / 1024
    assert swap_per_token(1) > recompute > swap_per_token(256)
    assert swap_per_token(1) > 3 * swap_per_token(16)

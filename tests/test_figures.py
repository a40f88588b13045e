"""Every study's figure in the house style (analysis.plots): written as a PNG, its panels labelled,
one colour per policy/router/setup shared by every figure, the legend under the panels, curves on
log axes rather than clipped, and the interval said in the title with seeds. Built from small
hand-made tables, so no simulation runs here."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from analysis.block_size import block_size_figure, block_size_plot
from analysis.capacity import capacity_figure, capacity_plot
from analysis.disagg import disagg_figure, disagg_plot
from analysis.plots import latency_vs_rate, series_colors, serving_figure, serving_panels
from analysis.policy_study import policy_figure, policy_plot
from analysis.preemption import preemption_figure, preemption_plot
from analysis.routing import routing_figure, routing_plot
from analysis.seeds import seeds_note

PNG = b"\x89PNG\r\n\x1a\n"
RATES = (1.0, 2.0, 4.0)


def _serving_table(by: str, keys: list[str], seeds: int = 1, seed: int = 0) -> pd.DataFrame:
    """A served workload's headline columns per (key, rate[, seed]): latencies spanning three decades
    (what a clipped linear axis used to cut off) and throughput falling behind the rate."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, key in enumerate(keys):
        for rate in RATES:
            for s in range(seeds):
                slow = (1 + i) * rate ** 4 * rng.uniform(0.9, 1.1)
                rows.append({by: key, "rate": rate, **({"seed": s} if seeds > 1 else {}),
                             "throughput": min(rate, 2.5 / (1 + i)), "ttft_p50": 0.01 * slow, "ttft_p90": 0.03 * slow,
                             "tpot_p50": 0.02 * (1 + i), "tpot_p90": 0.03 * (1 + i), "e2e_p90": 2 * slow,
                             "ttft_mean": 0.02 * slow, "mean_normalized_latency": 0.01 * slow,
                             "prefix_hit_fraction": rng.uniform(0, 1), "slo_attainment": rng.uniform(0, 1),
                             "min_client_attainment": rng.uniform(0, 1), "max_service_gap": 100 * slow})
    return pd.DataFrame(rows)


def _ylabels(fig: plt.Figure) -> list[str]:
    return [ax.get_ylabel() for ax in fig.axes if ax.get_visible()]


def _legend_under_the_panels(fig: plt.Figure) -> list[str]:
    """The figure legend's texts, after checking that it sits below every panel (covers no data)."""
    fig.canvas.draw()
    assert len(fig.legends) == 1, "one legend for the figure"
    legend_top = fig.legends[0].get_window_extent().y1
    assert all(legend_top <= ax.get_window_extent().y0 for ax in fig.axes if ax.get_visible())
    return [t.get_text() for t in fig.legends[0].get_texts()]


def _line_colors(fig: plt.Figure) -> dict[str, str]:
    return {line.get_label(): line.get_color() for ax in fig.axes for line in ax.get_lines()
            if not line.get_label().startswith("_")}


def test_a_name_keeps_its_colour_in_every_figure_whatever_else_is_drawn():
    alone, with_others = series_colors(["orca-max"]), series_colors(["vllm", "sjf", "orca-max", "my-plugin"])
    assert alone["orca-max"] == with_others["orca-max"]
    assert len(set(with_others.values())) == 4  # a plug-in takes a colour no built-in in the figure has
    assert series_colors(["fcfs"])["fcfs"] == series_colors(["vllm"])["vllm"]  # an alias is the same policy
    # the policy figure and the serving figure draw vllm in one colour, in either order of policies
    sweep = serving_figure(_serving_table("policy", ["orca-max", "vllm"]))
    study = policy_figure(_serving_table("policy", ["vllm", "orca-max"], seeds=3))
    assert _line_colors(sweep)["vllm"] == _line_colors(study)["vllm"] == series_colors(["vllm"])["vllm"]
    plt.close("all")


def test_serving_panels_draw_what_bench_serve_reports_on_log_axes_with_the_legend_below(tmp_path):
    table = _serving_table("policy", ["vllm", "orca-max"])
    fig = serving_figure(table, "t.csv, opt-13b on a100-40gb")
    assert _ylabels(fig) == ["achieved throughput (req/s)", "TTFT (s)", "time per output token (s)",
                             "E2E latency p90 (s)"]
    # TTFT and E2E span 3 decades: log axes; time per output token spans 3x: linear; no limit clips any
    assert [ax.get_yscale() for ax in fig.axes] == ["linear", "log", "linear", "log"]
    ttft = fig.axes[1]
    assert ttft.get_ylim()[1] >= table.ttft_p90.max() and ttft.get_ylim()[0] <= table.ttft_p50.min()
    labels = _legend_under_the_panels(fig)
    assert {"vllm", "orca-max", "offered rate", "p50", "p90"} <= set(labels)
    assert any(lab.startswith("saturation") for lab in labels)
    assert fig._suptitle.get_text() == "t.csv, opt-13b on a100-40gb"
    plt.close(fig)
    assert serving_panels(table, tmp_path / "serving.png").read_bytes()[:8] == PNG


def test_the_sweep_figure_has_no_clipping_limit(tmp_path):
    table = _serving_table("policy", ["vllm", "orca-max"])
    path = latency_vs_rate(table, tmp_path / "latency_vs_rate.png", "t.csv")
    assert path.read_bytes()[:8] == PNG


def test_routing_figure_is_the_serving_panels_per_router_and_the_prefix_cache_share(tmp_path):
    table = _serving_table("router", ["round-robin", "prefix-affinity"], seeds=3)
    title = "t.csv, 4 replicas of opt-13b" + seeds_note(3)
    fig = routing_figure(table, title)
    assert _ylabels(fig)[:4] == ["achieved throughput (req/s)", "TTFT (s)", "time per output token (s)",
                                 "E2E latency p90 (s)"]
    assert _ylabels(fig)[4] == "prompt tokens from prefix cache" and fig.axes[4].get_ylim() == (0, 1)
    assert {"round-robin", "prefix-affinity"} <= set(_legend_under_the_panels(fig))
    assert "95% t interval over 3 seeds" in fig._suptitle.get_text()
    assert fig.axes[1].collections, "with seeds, each line has its interval band"
    plt.close(fig)
    assert routing_plot(table, tmp_path / "routing.png", title).read_bytes()[:8] == PNG


def test_disagg_figure_names_each_split(tmp_path):
    table = _serving_table("setup", ["colocated", "1+3", "2+2"])
    fig = disagg_figure(table, "t.csv, 4 GPUs of opt-13b")
    assert _ylabels(fig)[-1] == "mean normalized latency (s/token)"
    assert {"colocated", "1+3 (prefill+decode)", "2+2 (prefill+decode)"} <= set(_legend_under_the_panels(fig))
    plt.close(fig)
    assert disagg_plot(table, tmp_path / "disagg.png").read_bytes()[:8] == PNG


def test_capacity_figure_marks_a_rate_no_replica_count_serves(tmp_path):
    answers = pd.DataFrame({"router": ["least-loaded"] * 3, "rate": list(RATES), "min_replicas": [1, 3, None],
                            "gpus": [1, 3, None], "simulations": [1, 3, 4]})
    fig = capacity_figure(answers, "t.csv, opt-13b, TTFT <= 1 s", max_replicas=8)
    assert _ylabels(fig) == ["fewest replicas meeting the SLOs"]
    assert "more than 8 replicas" in _legend_under_the_panels(fig)
    marked = [line for line in fig.axes[0].get_lines() if line.get_marker() == "^"]
    assert len(marked) == 1 and list(marked[0].get_xdata()) == [4.0] and list(marked[0].get_ydata()) == [8]
    assert fig.axes[0].get_ylim()[1] > 8  # the mark is inside the frame
    plt.close(fig)
    assert capacity_plot(answers, tmp_path / "capacity.png", max_replicas=8).read_bytes()[:8] == PNG


def test_policy_figure_bounds_shares_and_marks_saturation(tmp_path):
    table = _serving_table("policy", ["vllm", "sjf"], seeds=3)
    fig = policy_figure(table, "t.csv" + seeds_note(3))
    assert _ylabels(fig) == ["finished requests/s", "normalized latency (s/token)", "TTFT p90 (s)", "SLO attainment",
                             "worst client's SLO attainment", "max service gap between active clients (tokens)"]
    assert fig.axes[3].get_ylim()[1] == pytest.approx(1.02)
    assert {"vllm", "sjf"} <= set(_legend_under_the_panels(fig))
    plt.close(fig)
    assert policy_plot(table, tmp_path / "policies.png").read_bytes()[:8] == PNG


def test_block_size_and_preemption_figures_keep_the_house_legend(tmp_path):
    sizes = [8, 16, 32]
    table = pd.DataFrame([{"rate": r, "block_size": b, "mean_normalized_latency": 0.01 * r * (1 + abs(b - 16) / 8),
                           "internal_frag": b / 200, "reference_decode_ms": 10 + 40 / b} for r in (1.0, 2.0)
                          for b in sizes])
    fig = block_size_figure(table, "t.csv, opt-13b")
    assert fig.axes[0].get_ylabel() == "mean normalized latency / the best block size's"
    assert _legend_under_the_panels(fig)[0].startswith("1 req/s (best")
    plt.close(fig)
    assert block_size_plot(table, tmp_path / "block_size.png").read_bytes()[:8] == PNG

    micro = pd.DataFrame({"block_size": sizes, "swap_ms": [1.0, 2.0, 4.0], "recompute_ms": [3.0, 3.5, 4.5]})
    e2e = pd.DataFrame({"block_size": sizes * 2, "preemption": ["swap"] * 3 + ["recompute"] * 3,
                        "mean_normalized_latency": [0.1, 0.12, 0.2, 0.11, 0.1, 0.15]})
    fig = preemption_figure(micro, e2e, "opt-13b on a100-40gb")
    assert _ylabels(fig) == ["time (ms)", "mean normalized latency (s/token)"]
    assert _legend_under_the_panels(fig) == ["swap (out + in)", "recompute"]  # once, for both panels
    plt.close(fig)
    assert preemption_plot(micro, None, tmp_path / "preemption.png").read_bytes()[:8] == PNG

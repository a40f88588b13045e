"""The seed summary every study shares (analysis.seeds.add_seed_summary): the table of means and
intervals, the printed lines, and the few-seeds warning, made in one place (pagesim policies too)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pandas as pd
import pytest

from analysis.policy_study import METRICS, PolicyStudy, policy_report
from analysis.report import Report
from analysis.seeds import add_seed_summary
from sim.run import SimConfig


def _policies_table(seeds: int, slo: bool = True) -> pd.DataFrame:
    rng = np.random.default_rng(7)
    return pd.DataFrame([{"policy": p, "rate": r, "seed": s, **{m: rng.uniform(0.1, 1) for m in METRICS},
                          "slo_attainment": rng.uniform(0.5, 1) if slo else np.nan, "wall_s": 0.1}
                         for p in ("vllm", "sjf") for r in (1.0, 2.0) for s in range(seeds)])


def test_two_seeds_warn_and_print_each_configurations_interval():
    table = _policies_table(2)
    report = Report()
    with pytest.warns(UserWarning, match=r"only 2 seeds: .*t = 12\.71 .*--seeds 3 or more"):
        summary = add_seed_summary(report, table, ["policy", "rate"], "x_summary.csv", "throughput")
    assert list(report.files) == ["x_summary.csv"]
    assert len(summary) == 4 and (summary.seeds == 2).all()
    lines = [str(line) for line in report.lines]
    assert "throughput, mean [95% t interval] over 2 seeds:" in lines[0]
    first = summary.iloc[0]
    assert lines[1] == (f"  vllm 1.0: {first.throughput:.4g} [{first.throughput_ci95_low:.4g}, "
                        f"{first.throughput_ci95_high:.4g}]")


def test_three_seeds_do_not_warn_and_one_seed_says_it_has_no_interval():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        add_seed_summary(Report(), _policies_table(3), ["policy", "rate"], "x.csv", "throughput")
        report = Report()
        add_seed_summary(report, _policies_table(1), ["policy", "rate"], "x.csv", "throughput")
    assert "one seed: no interval" in str(report.lines[0]) and "[" not in str(report.lines[1])


def test_policy_report_takes_its_summary_and_warning_from_add_seed_summary():
    study = PolicyStudy("sharegpt-like", 10, SimConfig(), ["vllm", "sjf"], [1.0, 2.0], seeds=2)
    with pytest.warns(UserWarning, match="only 2 seeds"):
        report = policy_report(study, _policies_table(2))
    assert {"policies.csv", "policies_summary.csv", "policies.png"} <= set(report.files)
    assert "slo_attainment, mean [95% t interval] over 2 seeds:" in "\n".join(map(str, report.lines))
    # without an SLO, attainment is NaN everywhere: the lines give normalized latency instead
    report = policy_report(dataclasses.replace(study, seeds=3), _policies_table(3, slo=False))
    assert "mean_normalized_latency, mean [95% t interval] over 3 seeds:" in "\n".join(map(str, report.lines))


def test_the_policies_figure_title_names_a_trace_file_not_its_path(tmp_path, monkeypatch):
    import analysis.policy_study as ps
    titles = []
    monkeypatch.setattr(ps, "policy_plot", lambda table, path, title="": titles.append(title))
    study = PolicyStudy("/data/traces/azure_conv.csv", 10, SimConfig(), ["vllm"], [1.0], seeds=3, title="opt-13b")
    report = policy_report(study, _policies_table(3))
    report.files["policies.png"](tmp_path / "policies.png")
    assert titles == ["azure_conv.csv, 10 requests, opt-13b; mean and 95% t interval over 3 seeds"]

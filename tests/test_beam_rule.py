"""The simulated beam rule's q: fitting it, and what it does to sharing."""

from __future__ import annotations

import numpy as np
import pytest

from sim.executor import fit_beam_rank_decay
from sim.run import SimConfig, run_simulation
from traces import resolve_trace


@pytest.mark.parametrize("q", [0.2, 0.5, 0.8])
def test_fit_recovers_q_from_multinomial_picks(q):
    rng = np.random.default_rng(1)
    k = 4
    p = q ** np.arange(k)
    counts = rng.multinomial(k, p / p.sum(), size=5000).sum(axis=0)
    assert fit_beam_rank_decay(counts) == pytest.approx(q, abs=0.02)


def test_fit_edge_cases():
    assert fit_beam_rank_decay([10, 10, 10]) == pytest.approx(1.0, abs=1e-3)  # uniform: q = 1
    assert fit_beam_rank_decay([100, 0, 0]) < 1e-3                            # always the best beam
    for bad in ([5], [0, 0], [3, -1]):
        with pytest.raises(ValueError, match="rank_counts"):
            fit_beam_rank_decay(bad)


def test_a_smaller_q_makes_beams_share_more():
    from analysis.sharing import sharing_table

    trace = resolve_trace("alpaca-like", num_requests=60, rate=5.0, seed=0)
    savings = {}
    for q in (0.1, 0.9):
        table = sharing_table(trace, SimConfig(beam_rank_decay=q), [5.0], [("beam", 4)])
        savings[q] = float(table.saving.iloc[0])
    assert savings[0.1] > savings[0.9] > 0


def test_decay_outside_its_range_is_rejected():
    trace = resolve_trace("alpaca-like", num_requests=2, rate=1.0, seed=0)
    with pytest.raises(ValueError, match="beam_rank_decay"):
        run_simulation(SimConfig(beam_rank_decay=0.0, beam_width=2), trace)


def _picks_file(tmp_path, vectors: dict[str, int], width: int = 3):
    import json

    path = tmp_path / "beams.json"
    path.write_text(json.dumps({"widths": [{"width": width, "pick_vectors": vectors}]}))
    return path


def test_pick_tables_load_and_drive_the_simulated_beams(tmp_path):
    from analysis.sharing import sharing_saving
    from sim.executor import load_beam_picks

    spread = _picks_file(tmp_path, {"1,1,1": 1})  # every beam always continues: no pruning, no forks
    tables = load_beam_picks(spread)
    assert list(tables) == [3] and tables[3].vectors.tolist() == [[1, 1, 1]] and tables[3].probs.tolist() == [1.0]
    trace = resolve_trace("alpaca-like", num_requests=40, rate=5.0, seed=0)
    cfg = SimConfig(beam_width=3)
    only_prompt, _ = sharing_saving(trace, SimConfig(beam_width=3, beam_picks=str(spread)))
    collapse = _picks_file(tmp_path, {"3,0,0": 1})  # the best beam takes all: beams stay one lineage
    most, _ = sharing_saving(trace, SimConfig(beam_width=3, beam_picks=str(collapse)))
    rule, _ = sharing_saving(trace, cfg)
    assert only_prompt < rule < most


@pytest.mark.parametrize("content, message", [
    ("{", "not a `pagesim beams` file"),
    ('{"widths": [{"width": 1, "pick_vectors": {"1": 1}}]}', r"widths\[0\]"),
    ('{"widths": [{"width": 3, "pick_vectors": {"2,2,0": 5}}]}', "summing to 3"),
])
def test_bad_pick_tables_name_the_problem(tmp_path, content, message):
    from sim.executor import load_beam_picks

    path = tmp_path / "b.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        load_beam_picks(path)
    assert str(path) in str(e.value)

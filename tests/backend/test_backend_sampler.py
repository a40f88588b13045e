import pytest

torch = pytest.importorskip("torch")

from backend.sampler import (
    BeamSearcher,
    Sampler,
    SamplingParams,
    filtered_probs,
    greedy,
    log_softmax,
    token_logprobs,
)


def test_greedy_and_logprobs():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, -1.0, 0.0]])
    assert greedy(logits).tolist() == [1, 0]
    lp = log_softmax(logits)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(2))
    torch.testing.assert_close(token_logprobs(logits, torch.tensor([1, 2])), lp[[0, 1], [1, 2]])


def test_filtered_probs_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    torch.testing.assert_close(filtered_probs(logits, [2], [1.0]), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top-p 0.7: 0.5 then 0.3 reaches it; 0.15 and 0.05 are cut
    torch.testing.assert_close(filtered_probs(logits, [0], [0.7]), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    torch.testing.assert_close(filtered_probs(logits, [0], [0.5]), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(filtered_probs(logits, [0], [1.0]), logits.exp())


def test_sampler_is_seeded_and_respects_params():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(1.0), SamplingParams(0.0), SamplingParams(0.7, top_k=1), SamplingParams(1.3, top_p=1e-6),
              SamplingParams(1.0, top_k=5), SamplingParams(2.0, top_k=3, top_p=0.9)]
    a = Sampler(seed=7)(logits, params)
    b = Sampler(seed=7)(logits, params)
    assert torch.equal(a, b)
    g = greedy(logits)
    assert a[1] == g[1] and a[2] == g[2] and a[3] == g[3]
    assert a[4] in logits[4].topk(5).indices and a[5] in logits[5].topk(3).indices


def test_sampler_frequencies():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]])).repeat(4000, 1)
    s = Sampler(seed=1)(logits, [SamplingParams(1.0)] * 4000)
    freq = torch.bincount(s, minlength=3).float() / 4000
    torch.testing.assert_close(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03, rtol=0)


def test_sampling_params_validation():
    for kw, field in [({"temperature": -1}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)


def test_beam_searcher_by_hand():
    """Vocabulary of 4 (token 3 = EOS), 2 beams, log-probs chosen so that a beam finishes first."""
    lp = torch.log
    bs = BeamSearcher(num_beams=2, eos_token_ids=[3], max_new_tokens=3)
    c = bs.step(lp(torch.tensor([[0.1, 0.5, 0.25, 0.15]])))
    # top-4 order: 1, 2, 3 (EOS, but not within the top 2: it does not finish), 0
    assert [(x.parent, x.token) for x in c] == [(0, 1), (0, 2)]
    assert bs.finished == [] and not bs.done
    c = bs.step(lp(torch.tensor([[0.05, 0.05, 0.1, 0.8], [0.7, 0.1, 0.1, 0.1]])))
    # candidates: [1,3] 0.4, [2,0] 0.175, [1,2] 0.05, ... -> [1,3] finishes (score log(0.4)/2)
    assert bs.finished[0][1] == [1, 3]
    assert bs.finished[0][0] == pytest.approx(float(lp(torch.tensor(0.4))) / 2, abs=1e-6)
    assert (c[0].parent, c[0].token) == (1, 0)
    bs.step(lp(torch.tensor([[0.25, 0.25, 0.25, 0.25]] * 2)))
    assert bs.done and len(bs.finished) == 2
    best = bs.best(2)
    assert best[0] == ([1, 3], pytest.approx(float(lp(torch.tensor(0.4))) / 2, abs=1e-6))
    assert best[1][0][:2] == [2, 0]
    assert best[1][1] == pytest.approx(float(lp(torch.tensor(0.175 * 0.25))) / 3, abs=1e-6)
    with pytest.raises(RuntimeError):
        bs.step(lp(torch.tensor([[0.25, 0.25, 0.25, 0.25]] * 2)))

"""Reference generation loops over `ModelRunner` (for tests and demos): no scheduler, block tables
kept by hand over the project's block pool (policies.block_manager.BlockPool: reference counts and
a free queue). Forked beams share their parent's full blocks and copy its last partial block
(copy-on-write through `Batch.copies`). The live executor replaces this with the project's block
manager and scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.model_runner import Batch, ModelRunner, SeqInput
from backend.sampler import BeamSearcher, greedy, log_softmax
from policies.block_manager import BlockPool


@dataclass
class _Seq:
    tokens: list[int]      # prompt + generated
    computed: int          # tokens whose K/V are cached
    table: list[int]
    done: bool = False


def _take(pool: BlockPool, n: int) -> list[int]:
    if n > pool.num_free:
        raise RuntimeError("out of KV-cache blocks")
    return pool.take_ids(n)


def _grow(seq: _Seq, pool: BlockPool, upto: int, block_size: int) -> None:
    need = -(-upto // block_size) - len(seq.table)
    if need > 0:
        seq.table += _take(pool, need)


def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_id: int | None = None, prefill_chunk: int | None = None) -> list[list[int]]:
    """Greedy continuations (generated tokens only, EOS included) of all prompts, batched: each
    step feeds every unfinished sequence either its next prompt chunk (at most `prefill_chunk`
    tokens) or its last token."""
    bs = runner.block_size
    pool = BlockPool(runner.num_gpu_blocks)
    seqs = [_Seq(list(p), 0, []) for p in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    while True:
        active = [i for i, s in enumerate(seqs) if not s.done]
        if not active:
            return outs
        feeds = []
        for i in active:
            s = seqs[i]
            n = len(s.tokens) - s.computed
            if prefill_chunk:
                n = min(n, prefill_chunk)
            _grow(s, pool, s.computed + n, bs)
            feeds.append(SeqInput(s.tokens[s.computed:s.computed + n], s.computed, s.table,
                                  s.computed + n == len(s.tokens)))
        logits = runner.execute(Batch(feeds))
        next_tokens = iter(greedy(logits).tolist())
        for i, f in zip(active, feeds):
            s = seqs[i]
            s.computed += len(f.token_ids)
            if not f.samples:
                continue
            t = next(next_tokens)
            s.tokens.append(t)
            outs[i].append(t)
            if t == eos_token_id or len(outs[i]) >= max_new_tokens:
                s.done = True
                pool.release_ids(s.table)


def beam_search(runner: ModelRunner, prompt: list[int], num_beams: int, max_new_tokens: int,
                eos_token_id: int | list[int], length_penalty: float = 1.0,
                early_stopping: bool | str = False) -> list[tuple[list[int], float]]:
    """HF-compatible beam search; returns the finished hypotheses (generated tokens, score), best first."""
    bs = runner.block_size
    pool = BlockPool(runner.num_gpu_blocks)
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    searcher = BeamSearcher(num_beams, eos, max_new_tokens, length_penalty, early_stopping)
    root = _Seq(list(prompt), 0, [])
    _grow(root, pool, len(prompt), bs)
    logits = runner.execute(Batch([SeqInput(prompt, 0, root.table)]))
    root.computed = len(prompt)
    beams = [root]
    while True:
        cands = searcher.step(log_softmax(logits))
        if searcher.done:
            return searcher.best(num_beams)
        beams, copies = _fork(beams, cands, pool, bs)
        feeds = [SeqInput([b.tokens[-1]], b.computed, b.table) for b in beams]
        logits = runner.execute(Batch(feeds, copies=copies))
        for b in beams:
            b.computed += 1


def _fork(parents: list[_Seq], cands, pool: BlockPool, bs: int) -> tuple[list[_Seq], list[tuple[int, int]]]:
    """New beams from (parent, token) candidates: share the parent's full blocks, copy its partial
    last block (if any) into a fresh one; then drop the parents' references."""
    beams, copies = [], []
    for c in cands:
        p = parents[c.parent]
        full = p.computed // bs
        table = p.table[:full]
        for b in table:
            pool.share(pool.blocks[b])
        if p.computed % bs:
            dst, = _take(pool, 1)
            copies.append((p.table[full], dst))
            table.append(dst)
        child = _Seq(p.tokens + [c.token], p.computed, table)
        _grow(child, pool, child.computed + 1, bs)
        beams.append(child)
    for p in parents:
        pool.release_ids(p.table)
    return beams, copies

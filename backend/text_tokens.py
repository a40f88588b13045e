"""Tokenizers for a server with no model behind it (`pagesim serve --emulate`), and the fixed output
vocabulary it answers in.

- `load_tokenizer(path)`: a HF tokenizer folder (tokenizer.json, with tokenizer_config.json for its
  chat template; loaded by `transformers`) or a GGUF file (backend.tokenizer.GGUFTokenizer).
- `ByteChunkTokenizer`: the documented approximation when no tokenizer is at hand. A text is cut
  into chunks of `BYTES_PER_TOKEN` UTF-8 bytes (4: what English averages under BPE vocabularies of
  32k-128k tokens); a chunk's id is a hash of its bytes into [0, vocab_size), so equal prompts get
  equal ids and prefix caching finds what it would with a real tokenizer. Ids decode only when they
  are in the output vocabulary (every other id decodes to nothing: a prompt is never decoded).
  Its chat template writes each message as "<|role|>\\n" + content + "\\n" and ends with
  "<|assistant|>\\n".
- `output_vocabulary(tokenizer)`: the ids an emulated server answers with: common short English
  words, each one token with a leading space, kept only when a run of them re-tokenizes to the same
  ids (so a client that counts the tokens of the text agrees with the server's usage).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

BYTES_PER_TOKEN = 4
# three-letter words: " the" is one 4-byte chunk, so the approximation round-trips them exactly
WORDS = ("the and for are but not you all any can had her was one our out day get has him his how man new now "
         "old see two way who boy did its let put say she too use sun sea sky red big cat dog run sit top "
         "end far few got job key lot map may own pay set ten war yes yet art bad bed box car cup cut eat "
         "eye fly fun god hot ice law leg lie low mix oil pen pot raw row sad six tax tea toy win").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


class ByteChunkTokenizer:
    """encode / decode as the module docstring says; `vocab_size` ids, no special tokens."""

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < len(WORDS) * 4:
            raise ValueError(f"vocab_size: {vocab_size} is too small for the approximate tokenizer")
        self.vocab_size = vocab_size
        self.chat_template = CHAT_TEMPLATE
        self.bos_token = self.eos_token = ""
        self.bos_token_id = self.eos_token_id = None
        self._text: dict[int, str] = {}
        for w in WORDS:
            piece = " " + w
            self._text.setdefault(self._id(piece.encode()), piece)  # a colliding word is left out

    def _id(self, chunk: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(chunk, digest_size=8).digest(), "little") % self.vocab_size

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        data = text.encode()
        return [self._id(data[i:i + BYTES_PER_TOKEN]) for i in range(0, len(data), BYTES_PER_TOKEN)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._text
        return "".join(text.get(i, "") for i in ids)

    def word_ids(self) -> list[int]:
        """The ids of the words this tokenizer decodes, in WORDS order."""
        return list(self._text)


def output_vocabulary(tokenizer) -> list[int]:
    """The output ids of the module docstring, in WORDS order; ValueError when none qualify."""
    if isinstance(tokenizer, ByteChunkTokenizer):
        return tokenizer.word_ids()
    ids: list[int] = []
    for w in WORDS:
        got = _encode_plain(tokenizer, " " + w)
        if len(got) == 1 and got[0] not in ids:
            ids.append(got[0])
    # keep those that survive a run: a word that merges with its neighbours would change the count
    text = tokenizer.decode(ids + ids, skip_special_tokens=True)
    again = _encode_plain(tokenizer, text)
    if again != ids + ids:
        keep = set(ids) & set(again)
        ids = [i for i in ids if i in keep]
    if not ids:
        raise ValueError("--tokenizer: none of the output words is a single token of this tokenizer")
    return ids


def _encode_plain(tokenizer, text: str) -> list[int]:
    """Ids of `text` without a beginning-of-sequence token."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))  # transformers
    except TypeError:
        return list(tokenizer.encode(text, add_bos=False))             # GGUFTokenizer


def load_tokenizer(path: str | Path):
    """A HF tokenizer folder or a GGUF file (module docstring); ValueError naming --tokenizer."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        from backend.tokenizer import GGUFTokenizer
        return GGUFTokenizer.from_gguf(p)
    if p.is_dir() and (p / "tokenizer.json").exists():
        try:  # deferred: transformers takes seconds to import, and only a folder needs it
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ValueError(f"--tokenizer {path}: a HF tokenizer folder needs transformers ({e})") from None
        try:
            return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except Exception as e:  # transformers raises many kinds for a broken folder
            raise ValueError(f"--tokenizer {path}: not a usable HF tokenizer folder ({type(e).__name__}: {e})") from None
    raise ValueError(f"--tokenizer {path}: expected a .gguf file or a folder with tokenizer.json")

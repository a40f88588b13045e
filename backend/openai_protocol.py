"""OpenAI request parsing and response shapes for `pagesim serve` (plain dicts and dataclasses, no
web framework): /v1/completions and /v1/chat/completions bodies are checked field by field, and a
bad one raises `ApiError`, which the server answers with OpenAI's error object

    {"error": {"message": ..., "type": "invalid_request_error", "param": <field or null>, "code": ...}}

Supported: model, prompt (text, token ids, or a list of either) / messages, max_tokens
(max_completion_tokens), temperature, top_p, n, seed, stop, stream, stream_options (include_usage,
continuous_usage_stats), and vLLM's extras ignore_eos and top_k. Fields that would change the
output in ways the live engine cannot (penalties, logprobs, logit_bias, tools, echo, suffix,
best_of > n, JSON response formats) are refused when set to anything but their neutral value;
fields OpenAI does not know are refused by name, as OpenAI does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's (legacy) completions default
MAX_STOP = 4

# field -> its neutral value(s): accepted only with one of these
_NEUTRAL = {
    "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "repetition_penalty": (1, 1.0),
    "logprobs": (False, 0), "top_logprobs": (0,), "logit_bias": ({},), "echo": (False,), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (True, False), "min_tokens": (0,), "response_format": ({"type": "text"},),
}
_IGNORED = {"user", "metadata", "store", "service_tier", "request_id", "priority"}  # no effect on output
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "stream", "stream_options",
           "ignore_eos", "top_k", "best_of"}
_COMPLETION = _COMMON | {"prompt"} | set(_NEUTRAL) | _IGNORED
_CHAT = _COMMON | {"messages", "max_completion_tokens"} | set(_NEUTRAL) | _IGNORED


class ApiError(Exception):
    """An OpenAI-style error: HTTP `status`, message, type, the offending `param`, and a `code`;
    `headers`: extra response headers (e.g. connection: close)."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type, self.headers = status, param, code, type, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class GenerationParams:
    max_tokens: int | None   # None: what the context leaves (chat's default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


@dataclass
class ParsedRequest:
    """A checked request: one or more prompts (token ids), each answered with n choices."""

    kind: str                                   # "completion" | "chat"
    prompts: list[list[int]]
    params: GenerationParams
    created: int = field(default_factory=lambda: int(time.time()))


# ---- parsing --------------------------------------------------------------------------------------
def parse_completion(body: object, model: str, tokenizer) -> ParsedRequest:
    body = _object(body)
    _check_fields(body, _COMPLETION, model)
    if body.get("logprobs") is not None:  # here 0 (or false) still asks for the sampled tokens' logprobs
        raise ApiError("'logprobs' is not supported by this server (only null)", param="logprobs",
                       code="unsupported_parameter")
    prompt = body.get("prompt")
    if prompt is None:
        raise ApiError("'prompt' is required", param="prompt")
    prompts = [_prompt_ids(p, tokenizer) for p in _prompt_list(prompt)]
    params = _params(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS)
    return ParsedRequest("completion", prompts, params)


def parse_chat(body: object, model: str, tokenizer) -> ParsedRequest:
    body = _object(body)
    _check_fields(body, _CHAT, model)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    text = render_chat(tokenizer, [_message(m, i) for i, m in enumerate(messages)])
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = _params(body, key, None)
    return ParsedRequest("chat", [tokenizer.encode(text)], params)


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The model's chat template (Jinja, from its tokenizer metadata) with a generation prompt."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise ApiError("this model has no chat template; use /v1/completions", param="messages")
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True, bos_token=getattr(tokenizer, "bos_token", ""),
            eos_token=getattr(tokenizer, "eos_token", ""))
    except Exception as e:  # a template that raises on these messages (e.g. roles out of order)
        raise ApiError(f"the chat template rejected these messages: {e}", param="messages") from None


def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    return body


def _check_fields(body: dict, known: set[str], model: str) -> None:
    for k in body:
        if k not in known:
            raise ApiError(f"Unrecognized request argument supplied: {k}", param=k, code="unsupported_parameter")
    for k, neutral in _NEUTRAL.items():
        v = body.get(k)
        if v is not None and v not in neutral:
            raise ApiError(f"'{k}' is not supported by this server (only {neutral[0]!r})", param=k,
                           code="unsupported_parameter")
    name = body.get("model")
    if name is None:
        raise ApiError("'model' is required", param="model")
    if name != model:
        raise ApiError(f"The model `{name}` does not exist.", status=400, param="model", code="model_not_found")


def _prompt_list(prompt: object) -> list[object]:
    """A prompt is a string, a list of token ids, or a non-empty list of either (a batch)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return prompt
    raise ApiError("'prompt' must be a string, a list of token ids, or a non-empty list of either", param="prompt")


def _prompt_ids(p: object, tokenizer) -> list[int]:
    if isinstance(p, str):
        ids = tokenizer.encode(p) if p else []
    elif isinstance(p, list) and all(_is_int(t) for t in p):
        ids = list(p)
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise ApiError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    else:
        raise ApiError("each prompt must be a string or a list of token ids", param="prompt")
    if not ids:
        raise ApiError("the prompt is empty", param="prompt")
    return ids


def _message(m: object, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ApiError(f"messages[{i}] must be an object with a 'role' and a 'content'", param="messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text ones, each with its text (str() made
        # a missing or null text "" or "None" in the prompt)
        if any(not isinstance(c, dict) or c.get("type") != "text" or not isinstance(c.get("text"), str)
               for c in content):
            raise ApiError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': <string>}}) "
                           "are supported", param="messages")
        content = "".join(c["text"] for c in content)
    if not isinstance(content, str):
        raise ApiError(f"messages[{i}].content must be a string or a list of text parts", param="messages")
    return {"role": m["role"], "content": content}


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or v > hi:
        bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
        raise ApiError(f"'{key}' must be a number in {bound}, got {v!r}", param=key)
    return float(v)


def _int(body: dict, key: str, default: int | None, lo: int) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if not _is_int(v) or v < lo:
        raise ApiError(f"'{key}' must be an integer >= {lo}, got {v!r}", param=key)
    return v


def _params(body: dict, max_key: str, default_max: int | None) -> GenerationParams:
    n = _int(body, "n", 1, 1)
    best_of = _int(body, "best_of", n, 1)
    if best_of != n:
        raise ApiError("'best_of' other than n is not supported", param="best_of", code="unsupported_parameter")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP
                             or not all(isinstance(s, str) and s for s in stop)):
        raise ApiError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} of them", param="stop")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or any(opts.get(k) is not None and not isinstance(opts[k], bool)
                                         for k in ("include_usage", "continuous_usage_stats")):
        raise ApiError("'stream_options' must be an object whose include_usage and continuous_usage_stats "
                       "are true or false", param="stream_options")
    for k, key in (("stream", "stream"), ("ignore_eos", "ignore_eos")):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise ApiError(f"'{key}' must be true or false", param=k)
    return GenerationParams(
        max_tokens=_int(body, max_key, default_max, 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=_int(body, "top_k", 0, 0) if body.get("top_k") != -1 else 0,  # vLLM spells "no cut" -1
        n=n, seed=_int(body, "seed", None, 0), stop=tuple(stop or ()), ignore_eos=bool(body.get("ignore_eos")),
        stream=bool(body.get("stream")), include_usage=bool(opts.get("include_usage")),
        continuous_usage=bool(opts.get("continuous_usage_stats")))


# ---- responses ------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice(kind: str, index: int, text: str, finish_reason: str | None, delta: bool) -> dict:
    """One choice of a response (delta=False) or of a stream chunk (delta=True)."""
    if kind == "completion":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if delta:
        return {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def envelope(kind: str, rid: str, created: int, model: str, choices: list[dict], stream: bool) -> dict:
    obj = {"completion": "text_completion", "chat": "chat.completion"}[kind]
    if stream and kind == "chat":
        obj = "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}

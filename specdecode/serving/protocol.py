"""The OpenAI request and response shapes the server speaks: validation in, JSON objects out.

Validation is strict on purpose: a parameter the engine would silently ignore (logprobs, penalties,
tools, ...) is refused with a 400 naming it, so a client never believes it got what it did not. Such a
parameter at its neutral value (`presence_penalty: 0`, `tools: []`, ...: what several client libraries send
by default) asks for nothing and passes. Parameters sent as `null` count as absent, as OpenAI's own API treats
them.
"""

import random
import time
import uuid
from dataclasses import dataclass

from specdecode.engine.decode import Completion
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

MAX_CHOICES = 16
MAX_PROMPTS = 64  # a completions request's batch of prompts (OpenAI's and vLLM's list of prompts)
MAX_STOP_STRINGS = 4
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the room left
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "user"}
_COMMON |= {"top_k"}  # vLLM's and SGLang's extension (0 or -1: off)
_COMMON |= {"speculative"}  # ours: false decodes this request without drafts (to compare speeds)


def _is_zero(value: object) -> bool:
    return type(value) in (int, float) and value == 0


# parameters accepted only at the value that asks for nothing, by endpoint: name -> is that value
_NEUTRAL_BOTH = {"presence_penalty": _is_zero, "frequency_penalty": _is_zero, "logit_bias": lambda v: v == {}}
NEUTRAL = {
    "completions": _NEUTRAL_BOTH | {"echo": lambda v: v is False, "best_of": lambda v: type(v) is int and v == 1},
    "chat": _NEUTRAL_BOTH
    | {"logprobs": lambda v: v is False, "tools": lambda v: v == [], "tool_choice": lambda v: v == "none"}
    | {"response_format": lambda v: v == {"type": "text"}},
}
SUPPORTED = {
    "completions": _COMMON | {"prompt"} | set(NEUTRAL["completions"]),
    "chat": _COMMON | {"messages", "max_completion_tokens"} | set(NEUTRAL["chat"]),
}
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}  # OpenAI's -> ours


class ApiError(SpecDecodeError):
    """A request the server refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass
class GenerationRequest:
    """A validated request: what to submit to the engine, each prompt `n` times with seeds `seeds` (choice
    p * n + j is prompt p's j-th)."""

    prompts: list[list[int]]
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...]
    seeds: list[int]
    stream: bool
    include_usage: bool
    speculate: bool = True


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ApiError(f"'{name}' must be a number in [{low:g}, {high:g}], got {value!r}", param=name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ApiError(f"'{name}' must be an integer {bound}, got {value!r}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOP_STRINGS:
        raise ApiError(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", param="stop")
    return tuple(s for s in stops if s)


def _text(content: object) -> str | None:
    """A message's text: its string, or its content parts of type text joined by newlines (as vLLM joins them)."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) and content else [None]
    if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        return "\n".join(p["text"] for p in parts)
    return None


def _message(m: object) -> dict:
    """A chat message as the chat template takes it (a developer message is a system message)."""
    role, text = (m.get("role"), _text(m.get("content"))) if isinstance(m, dict) else (None, None)
    if not isinstance(role, str) or role not in _ROLES or text is None:
        raise ApiError(
            f"every message needs a role in {', '.join(_ROLES)} and a content: a string or a list of text parts "
            f"({{type: text, text}}; this server reads text only), got {m!r}",
            param="messages",
        )
    return {"role": _ROLES[role], "content": text}


def _prompts(body: dict, chat: bool, target: Target) -> list[list[int]]:
    """The token ids of each prompt: a chat's one; a completion's text, its token ids, or a list of either."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError("'messages' must be a non-empty list of {role, content} objects", param="messages")
        return [target.encode_chat([_message(m) for m in messages])]
    prompt = body.get("prompt")
    batch = prompt if isinstance(prompt, list) and prompt and not all(type(t) is int for t in prompt) else [prompt]
    prompts = []
    for item in batch[: MAX_PROMPTS + 1]:
        if isinstance(item, str) and item:
            prompts.append(target.encode(item, chat=False))
        elif isinstance(item, list) and item and all(type(t) is int and 0 <= t < target.vocab_size for t in item):
            prompts.append(list(item))
    if len(prompts) != len(batch) or len(batch) > MAX_PROMPTS:
        raise ApiError(
            f"'prompt' must be a non-empty string, a list of token ids, or a list of up to {MAX_PROMPTS} of either",
            param="prompt",
        )
    return prompts


def parse_request(
    body: object, chat: bool, target: Target, model_names: tuple[str, ...], max_len: int
) -> GenerationRequest:
    """Check an OpenAI completions / chat completions body for a model of `model_names`; raise `ApiError` with
    what is wrong."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    body = {k: v for k, v in body.items() if v is not None}
    kind = "chat" if chat else "completions"
    unsupported = sorted(set(body) - SUPPORTED[kind])
    if unsupported:
        raise ApiError(f"unsupported parameter '{unsupported[0]}'", param=unsupported[0], code="unsupported_parameter")
    for name, neutral in NEUTRAL[kind].items():
        if name in body and not neutral(body[name]):
            raise ApiError(
                f"'{name}' is supported only at its neutral value (asking for nothing), got {body[name]!r}",
                param=name,
                code="unsupported_parameter",
            )
    if "model" not in body:
        raise ApiError("'model' is required", param="model")
    if body["model"] not in model_names:
        served = ", ".join(f"'{name}'" for name in model_names)
        raise ApiError(f"the model '{body['model']}' does not exist; this server serves {served}", 404, "model")
    prompts = _prompts(body, chat, target)
    longest = max(len(p) for p in prompts)  # every prompt gets the same max_tokens
    max_tokens = _integer(body, "max_tokens", 1)
    if chat and max_tokens is None:
        max_tokens = _integer(body, "max_completion_tokens", 1)
    if longest >= max_len:
        raise ApiError(
            f"the prompt has {longest} tokens but this server's context holds {max_len} per request",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        max_tokens = max_len - longest if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, max_len - longest)
    elif longest + max_tokens > max_len:
        raise ApiError(
            f"the prompt has {longest} tokens and max_tokens is {max_tokens}, but this server's context "
            f"holds {max_len} per request: lower max_tokens or shorten the prompt",
            param="max_tokens",
            code="context_length_exceeded",
        )
    temperature, top_p = _number(body, "temperature", 1.0, 0, 2), _number(body, "top_p", 1.0, 0, 1)
    top_k = max(_integer(body, "top_k", -1) or 0, 0)
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    except SpecDecodeError as e:  # the ranges above leave only top_p = 0
        raise ApiError(str(e), param="top_p") from e
    n = _integer(body, "n", 1, MAX_CHOICES) or 1
    seed = _integer(body, "seed", -(2**63))
    base = random.randrange(2**62) if seed is None else seed % 2**63
    stream = body.get("stream", False)
    options = body.get("stream_options", {})
    if not isinstance(stream, bool) or not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError("'stream' must be a boolean and 'stream_options' at most {include_usage}", param="stream")
    speculate = body.get("speculative", True)
    if not isinstance(speculate, bool):
        raise ApiError(f"'speculative' must be a boolean, got {speculate!r}", param="speculative")
    return GenerationRequest(
        speculate=speculate,
        prompts=prompts,
        params=params,
        max_tokens=max_tokens,
        stop=_stop(body),
        seeds=[base + i for i in range(n)],
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
    )


# ---------------------------------------------------------------- responses
def response_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def spec_decode_stats(completion: Completion, index: int, time_to_first_token_s: float | None) -> dict:
    """A choice's speculative statistics, like SGLang's meta_info.spec_accept_length but per round."""
    stats = completion.stats.to_dict()
    stats["time_to_first_token_s"] = None if time_to_first_token_s is None else round(time_to_first_token_s, 4)
    return {"index": index, **stats}


def usage(prompt_tokens: int, completions: list[Completion]) -> dict:
    generated = sum(len(c.token_ids) for c in completions)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated}


def choice(chat: bool, index: int, text: str, finish_reason: str) -> dict:
    """A choice of a full (non-streamed) response."""
    if chat:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chunk_choice(chat: bool, index: int, text: str | None, finish_reason: str | None, first: bool) -> dict:
    """A choice of a stream chunk; chat chunks carry a delta, the first one with the role."""
    if not chat:
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    delta = {} if text is None else {"content": text}
    if first:
        delta = {"role": "assistant", **delta}
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def envelope(chat: bool, request_id: str, model: str, choices: list[dict], stream: bool, **extra) -> dict:
    kind = ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": choices, **extra}

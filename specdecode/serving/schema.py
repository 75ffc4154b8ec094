"""The request and response bodies as pydantic models: the OpenAPI schema FastAPI publishes at /docs.

Requests are still validated by `protocol.parse_request`, whose errors name the parameter the way OpenAI's
do (a pydantic 422 would not); these models describe the same fields, and the tests check that they
cover exactly the parameters `protocol.SUPPORTED` accepts and that every response the server sends
validates against them.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="the served model's name (see /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="new tokens at most")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy decoding; default 1")
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=16, description="independent choices")
    stream: bool | None = Field(None, description="server-sent events, OpenAI's chunk format")
    stream_options: dict[Literal["include_usage"], bool] | None = None
    stop: str | list[str] | None = Field(None, description="up to 4 stop strings")
    seed: int | None = Field(None, description="choice i samples with seed + i")
    user: str | None = None
    top_k: int | None = Field(None, ge=-1, description="the k most likely tokens only; 0 or -1 (the default): off")
    speculative: bool | None = Field(None, description="false: decode this request without drafts (default true)")
    presence_penalty: Literal[0] | None = Field(None, description="accepted at 0 only (no penalty)")
    frequency_penalty: Literal[0] | None = Field(None, description="accepted at 0 only (no penalty)")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="accepted empty only")


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text, token ids, or a list of up to 64 of either (choice p * n + j answers prompt p)"
    )
    echo: Literal[False] | None = Field(None, description="accepted false only")
    best_of: Literal[1] | None = Field(None, description="accepted at 1 only")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"] = Field(description="developer: a system message")
    content: str | list[TextPart] = Field(description="text, or text parts (joined by newlines)")


class TextFormat(BaseModel):
    type: Literal["text"]


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, description="an alias of max_tokens")
    logprobs: Literal[False] | None = Field(None, description="accepted false only")
    tools: list[dict] | None = Field(None, max_length=0, description="accepted empty only")
    tool_choice: Literal["none"] | None = Field(None, description="accepted 'none' only")
    response_format: TextFormat | None = Field(None, description="accepted {type: text} only")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChoiceStats(BaseModel):
    """One choice's speculative decoding, round by round (accepted lengths count the target's own token)."""

    model_config = ConfigDict(extra="allow")

    index: int
    new_tokens: int
    rounds: int
    mean_accepted_length: float
    accepted_lengths: list[int]
    per_position_acceptance: list[float]
    proposers: dict[str, int] = Field(description="rounds whose verified drafts each part of a hybrid made")
    tokens_per_s: float
    time_to_first_token_s: float | None


class SpecDecode(BaseModel):
    drafter: str
    scheduler: str
    draft_length: int
    choices: list[ChoiceStats]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length", "cancelled"]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: Literal["stop", "length", "cancelled"]


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: Usage
    spec_decode: SpecDecode


class CompletionResponse(_Response):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


def request_body(model: type[BaseModel]) -> dict:
    """`openapi_extra` for a route whose body `parse_request` validates: the schema, documented only."""
    reference = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": reference}}}}


def add_request_schemas(openapi: dict, models: tuple[type[BaseModel], ...]) -> dict:
    """Put the request models (and the models they use) into the OpenAPI document's components."""
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return openapi

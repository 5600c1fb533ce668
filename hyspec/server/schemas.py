"""Request bodies of the OpenAI-compatible API (pydantic v2).

Field names follow OpenAI; the non-OpenAI ones (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, draft, ...) arrive through the client's `extra_body`, as with
vLLM. Types are strict (a string where a number belongs is a 400, not a coercion); fields
this server does not know are ignored. Value ranges are checked in hyspec.server.params,
where the model's limits are known."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict


class _Base(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Base):
    include_usage: Optional[bool] = False


class ResponseFormat(_Base):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    json_schema: Optional[dict[str, Any]] = None  # {"name", "schema", "strict", "description"}


class _Sampling(_Base):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None  # OpenAI's newer name (wins over max_tokens)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    penalty_last_n: Optional[int] = None
    sampling_mode: Optional[Literal["rejection", "coupled"]] = None
    seed: Optional[int] = None
    n: Optional[int] = 1
    stop: Optional[Union[str, list[str]]] = None
    include_stop_str_in_output: Optional[bool] = False  # (vLLM's): the text ends after the stop string
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: Optional[bool] = False
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[ResponseFormat] = None
    draft: Optional[int] = None
    return_token_ids: Optional[bool] = False  # extension: each choice also carries `token_ids`
    user: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None
    # constrained decoding beyond response_format (extensions, vLLM's names); at most one
    guided_json: Optional[Union[dict[str, Any], bool, str]] = None  # a JSON schema (object, true / false, or JSON text)
    guided_regex: Optional[str] = None
    guided_grammar: Optional[str] = None  # Lark grammar text (llguidance's dialect)
    guided_choice: Optional[list[str]] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class TextPart(_Base):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(_Base):
    model_config = ConfigDict(strict=True, extra="allow")  # tool_calls, name, ... reach the template
    role: str
    content: Optional[Union[str, list[TextPart]]] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: Optional[bool] = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None  # hyspec.tools checks them
    reasoning_effort: Optional[str] = None  # passed to the chat template (templates that read it)
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[Any] = None  # OpenAI's deprecated names: refused, naming `tools`
    function_call: Optional[Any] = None


class TokenizeRequest(_Base):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: Optional[bool] = True
    tools: Optional[list[dict[str, Any]]] = None  # rendered with the messages, as chat renders them
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeRequest(_Base):
    model: Optional[str] = None
    tokens: list[int]

"""Request bodies of the OpenAI-compatible API (pydantic v2).

Field names follow OpenAI; the non-OpenAI ones (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, draft, ...) arrive through the client's `extra_body`, as with
vLLM. Types are strict (a string where a number belongs is a 400, not a coercion); fields
this server does not know are ignored, except vLLM's that would change the output and are
not implemented (declared below as `Any`, refused by hyspec.server.params.refuse_unsupported
when set to anything but their "off" value). Value ranges are checked in
hyspec.server.params, where the model's limits are known."""

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
    best_of: Optional[int] = None  # only = n (params.sampling)
    # vLLM's fields that change the output and are not implemented: a 400 when set (params.UNSUPPORTED),
    # never silently ignored
    min_tokens: Optional[Any] = None
    prompt_logprobs: Optional[Any] = None
    use_beam_search: Optional[Any] = None
    truncate_prompt_tokens: Optional[Any] = None
    skip_special_tokens: Optional[Any] = None
    return_tokens_as_token_ids: Optional[Any] = None
    bad_words: Optional[Any] = None
    allowed_token_ids: Optional[Any] = None
    logits_processors: Optional[Any] = None
    structured_outputs: Optional[Any] = None
    guided_whitespace_pattern: Optional[Any] = None
    extra_body: Optional[Any] = None  # the openai client's argument, sent as a field by mistake


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = False
    suffix: Optional[str] = None


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
    # vLLM's chat extensions that change the output and are not implemented (params.UNSUPPORTED_CHAT)
    chat_template: Optional[Any] = None
    continue_final_message: Optional[Any] = None
    echo: Optional[Any] = None
    documents: Optional[Any] = None


class TokenizeRequest(_Base):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: Optional[bool] = True
    tools: Optional[list[dict[str, Any]]] = None  # rendered with the messages, as chat renders them
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # (refused where set, as by the chat route: the ids would not be those chat renders)
    chat_template: Optional[Any] = None
    continue_final_message: Optional[Any] = None


class DetokenizeRequest(_Base):
    model: Optional[str] = None
    tokens: list[int]

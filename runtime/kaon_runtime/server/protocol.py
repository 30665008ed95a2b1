"""OpenAI wire format: request bodies (validated strictly) and the responses we send back.

Requests are strict about the fields we know: a malformed value is a 400, and "1" is not an
integer. Unknown top-level fields are accepted and ignored, as vLLM does, because the ecosystem's
clients send extensions of their own; the server logs each such name once and lists them in the
response's x-kaon-ignored-fields header (server/extensions.py), so a typo is still visible.
Nested objects stay closed: an unknown field inside one is a 400.

A request model owns its translation into the engine's SamplingParams (`to_sampling_params`, as
vLLM's request models do), so what a field means is written beside the field.

One module for the whole wire format, over 300 lines: the models refer to each other, and the
OpenAPI document is generated from them together.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from kaon_runtime.sampling import SamplingParams

# JSON integers are unbounded; seeds and top_k end up in torch's 64-bit integers.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

# The validators' cross-field rules, as JSON Schema for the OpenAPI document.
_STREAM_OPTIONS_NEED_STREAM: dict[str, Any] = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
_TOP_LOGPROBS_NEED_LOGPROBS: dict[str, Any] = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}
_NON_EMPTY: dict[str, Any] = {"type": "string", "minLength": 1}
_TOKEN_IDS: dict[str, Any] = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_TOKEN_ID_KEYS: dict[str, Any] = {"propertyNames": {"pattern": "^[0-9]{1,9}$"}}

# ---- requests --------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _OpenTopLevel(_Strict):
    """A request body: unknown fields are kept in model_extra and ignored (see the module's docstring).

    An explicit null for an optional field means its default, as in OpenAI's API (its optional
    parameters are nullable: `"n": null` is n=1) and vLLM's; clients that serialize every field send them.
    """

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items()
                if not (v is None and k in fields and not fields[k].is_required() and not _takes_none(fields[k]))}


def _takes_none(field) -> bool:
    """The field's own type has None (max_tokens: None means up to the context): a null keeps that meaning."""
    return type(None) in get_args(field.annotation)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk (with include_usage)


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the schema is always enforced; accepted for OpenAI's clients


class ResponseFormat(_Strict):
    """OpenAI's response_format: free text, any JSON object, or JSON valid against a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required by, and only by, type 'json_schema'")
        return self


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: at most one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def sampling_fields(self) -> dict[str, Any]:
        fields = {"json_schema": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": bool(self.json_object)}
        chosen = {k: v for k, v in fields.items() if v not in (None, False)}
        if len(chosen) > 1:
            raise ValueError(f"structured_outputs: set one of json, regex, choice, grammar, json_object, got "
                             f"{sorted(chosen)}")
        return chosen


class _SamplingRequest(_OpenTopLevel):
    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM]})

    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # not OpenAI's; as in vLLM (-1 or 0: off)
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = Field(None, json_schema_extra={"anyOf": [
        _NON_EMPTY, {"type": "array", "items": _NON_EMPTY}, {"type": "null"}]})
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # not OpenAI's; benchmarks need fixed-length outputs
    user: str | None = None  # an end-user tag for abuse tracking; it does not change the output
    metadata: dict[str, str] | None = None  # OpenAI's; ignored
    service_tier: str | None = None  # OpenAI's; ignored: one tier here
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, json_schema_extra=_TOKEN_ID_KEYS)  # token id (as a string, as OpenAI sends it) -> bias
    # vLLM's extensions.
    repetition_penalty: float = Field(1.0, gt=0, le=65536)
    min_tokens: int = Field(0, ge=0)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # 0 is refused by SamplingParams, as vLLM does
    min_p: float = Field(0.0, ge=0, le=1)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:<id>"
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # per prompt token (completions: on each choice)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # no prefix-cache sharing across salts
    # Structured output: OpenAI's response_format, or vLLM's structured_outputs (not both).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older spelling of structured_outputs (still sent by many clients): the same constraints.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted; xgrammar always
    guided_whitespace_pattern: str | None = None  # accepted; the grammar's own whitespace

    @model_validator(mode="after")
    def _supported(self):
        if any(not key.isdigit() or len(key) > 9 for key in self.logit_bias or {}):
            raise ValueError("logit_bias: keys must be token ids")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        guided = self._guided()
        if guided is not None and self.structured_outputs is not None:
            raise ValueError("set structured_outputs or the guided_* fields, not both")
        structured = self.structured_outputs is not None or guided is not None
        if structured and self.response_format not in (None, ResponseFormat(type="text")):
            raise ValueError("set response_format or structured_outputs, not both")
        return self

    def _guided(self) -> StructuredOutputs | None:
        """vLLM's guided_json / guided_regex / guided_choice / guided_grammar as structured_outputs."""
        fields = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        chosen = {k: v for k, v in fields.items() if v is not None}
        return StructuredOutputs.model_validate(chosen) if chosen else None

    def output_constraint(self) -> dict[str, Any]:
        """The SamplingParams fields of the requested structured output (empty: free text)."""
        structured = self.structured_outputs or self._guided()
        if structured is not None:
            return structured.sampling_fields()
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return {}
        if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
            return {"json_object": True}
        return {"json_schema": fmt.json_schema.schema_}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM's continuous_usage_stats, which (as in vLLM) needs include_usage."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def scored_prompt(self) -> int | None:
        """How many alternatives to score per prompt token (vLLM's prompt_logprobs); None: the prompt is not scored."""
        return self.prompt_logprobs

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         constraint: dict[str, Any]) -> SamplingParams:
        """What both endpoints share; each passes its own token limit, logprobs and structured output
        (`constraint`: SamplingParams' json_schema=..., or nothing for free text)."""
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
            max_tokens=max_tokens, stop=self.stop_list, ignore_eos=self.ignore_eos, logprobs=logprobs, n=self.n,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens, min_p=self.min_p, stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            prompt_logprobs=self.scored_prompt(), cache_salt=self.cache_salt,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens, **constraint)


class CompletionRequest(_SamplingRequest):
    # A prompt (a string or token ids) or a batch of them (server/batch.py).
    prompt: str | list[int] | list[str] | list[list[int]] = Field(json_schema_extra={"anyOf": [
        _NON_EMPTY, _TOKEN_IDS, {"type": "array", "items": _NON_EMPTY, "minItems": 1},
        {"type": "array", "items": _TOKEN_IDS, "minItems": 1}]})
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False  # the prompt before the completion; with logprobs, the prompt's logprobs too
    suffix: str | None = Field(None, json_schema_extra={"type": "null"})  # insertion: not supported

    @model_validator(mode="after")
    def _echo_alone(self):
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ValueError("max_tokens 0 only scores a prompt: it needs echo or prompt_logprobs")
        if self.suffix is not None:
            raise ValueError("suffix is not supported by this server")
        return self

    def scored_prompt(self) -> int | None:
        """vLLM's prompt_logprobs, or echo with logprobs (what evaluation harnesses send): the larger;
        echo with max_tokens 0 alone scores the prompt with no alternatives."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        if wanted:
            return max(wanted)
        return 0 if self.echo and self.max_tokens == 0 else None

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs, self.output_constraint())


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None only for an assistant's tool calls
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's calls, earlier in the conversation
    tool_call_id: str | None = None  # a tool message answers this call
    # What OpenAI's clients send back with an assistant message they got (message.model_dump()): accepted,
    # not shown to the model.
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    annotations: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        # An image, audio or file part: said in words (else pydantic's union error, "Input should be a valid string").
        parts = data.get("content") if isinstance(data, dict) else None
        if isinstance(parts, list):
            kinds = sorted({part.get("type") for part in parts if isinstance(part, dict)} - {"text"}, key=str)
            if kinds:
                raise ValueError(f"content parts of type {', '.join(map(repr, kinds))} are not supported: "
                                 "this server takes text parts only")
        return data

    @model_validator(mode="after")
    def _content_unless_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (HF's shape: tool_calls and tool_call_id when present)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: no arguments
    strict: bool | None = None  # the schema is always enforced when a call is forced


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(_SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # deprecated by OpenAI, still widely sent
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # None: true, as OpenAI

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _tool_choice_fits_tools(self):
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError("tools: function names must be unique")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, "
                             "which is not among the tools")
        if self.forces_tool_call and self.output_constraint():
            raise ValueError("a forced tool call (tool_choice 'required' or a named function) cannot be "
                             "combined with response_format")
        return self

    @property
    def tools_offered(self) -> bool:
        """Tools are described to the model and its calls parsed (tool_choice none: neither)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def max_output_tokens(self) -> int | None:
        """max_completion_tokens, or the deprecated max_tokens; None: up to the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per generated token; None: no logprobs asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def to_sampling_params(self, constraint: dict[str, Any] | None = None) -> SamplingParams:
        """`constraint`: the structured output the chat's plan settled on (a forced tool call's grammar
        takes response_format's place: server/tool_calls.py); None: the request's own."""
        return self._sampling_params(self.max_output_tokens, self.num_logprobs,
                                     self.output_constraint() if constraint is None else constraint)


# /tokenize and /detokenize, as vLLM has them (server/tokenize.py).


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True  # messages: end with the assistant's turn, as chat completions do
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send prompt or messages (one of them)")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class DetokenizeResponse(BaseModel):
    prompt: str


# Loading and unloading LoRA adapters, as vLLM has them (server/lora_routes.py).


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; the name is what counts


# ---- responses -------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class OmitsNone(BaseModel):
    """A model whose `omitted_when_none` fields are left out of its JSON while None, as OpenAI
    leaves out what a response has not got (a null would read as present)."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler) -> dict[str, Any]:
        out = handler(self)
        for key in self.omitted_when_none:
            if out.get(key) is None:
                out.pop(key, None)
        return out


class PromptLogprob(BaseModel):
    logprob: float
    decoded_token: str


class CompletionChoice(OmitsNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)  # vLLM sends it only when asked

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: per prompt token (None first), its token id -> logprob, and the top alternatives.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    """The full response, and also each streamed chunk (OpenAI uses one object for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(OmitsNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("tool_calls",)  # only when calls were made

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(OmitsNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None  # vLLM's, when asked for


class DeltaFunction(OmitsNone):
    omitted_when_none: ClassVar[tuple[str, ...]] = ("name", "arguments")

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitsNone):
    """A streamed call: index, id, type and name in its first chunk, then fragments of its arguments."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class DeltaMessage(OmitsNone):
    # A delta carries only what changed: the role once, then content; the last one is {}.
    omitted_when_none: ClassVar[tuple[str, ...]] = ("role", "content", "tool_calls")

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kaon"
    # Optional as in vLLM's card: the engine always sets it; kaon-router's list, which has no engine
    # behind it, leaves it out.
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's directory (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

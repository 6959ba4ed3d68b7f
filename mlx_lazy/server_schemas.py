"""The server's request bodies (pydantic models, strict: ``"5"`` is not a number), the bounds on
their fields (:class:`Bounds`, the cost model) and the ``"pruning"`` field read into a
:class:`~mlx_lazy.config.PruningConfig` (:func:`pruning_config`). Needs the ``[server]`` extra.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, ClassVar, Dict, List, Literal, Optional, Union

from .extras import needs_extra

with needs_extra("server", "the server"):
    from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                          StringConstraints, ValidationInfo, field_validator)

from .config import PRUNING_FIELDS, PruningConfig
from .errors import UserInputError, shown
from .inputs import json_depth
from .policies import compose
from .server_logprobs import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS
from .server_worker import APIError


class Bounds:
    """Every request field whose cost grows with its size, and its bound: no body within
    them costs more than a bounded amount of time or memory before it is refused.

    Cost model, per request, n being the body's bytes:

    * the body: read, parsed and validated in O(n); ``max_body_bytes`` (413) is checked on
      the bytes as they arrive, before any parsing. Fields the server ignores (``user``,
      ``parallel_tool_calls``, ...) cost their parse only, within that bound.
    * a prompt's text: tokenizing is O(bytes) and the slowest step a body can ask for (1-2 s
      per MB on a CPU), so a text too long to fit ``prompt_tokens`` is refused (413)
      before the tokenizer runs: a token stands for at most ``token_bytes`` bytes of text
      (:func:`token_bytes`), so more than ``prompt_tokens * token_bytes`` bytes cannot fit.
    * token ids: checked against the vocabulary in O(ids); more than ``prompt_tokens`` is 413.
    * ``messages``: the chat template renders O(messages + bytes); at most
      :data:`MAX_MESSAGES` (OpenAI's own limit), their text as a prompt's text above, an
      assistant message's ``tool_calls`` at most :data:`MAX_TOOL_CALLS`, each call's
      ``arguments`` parsed once more (O(bytes)) for the template.
    * ``tools``: at most :data:`MAX_TOOLS` (OpenAI's limit), each function's ``parameters``
      nested at most :data:`MAX_SCHEMA_DEPTH` deep (the template's ``tojson`` recurses
      through it); their JSON counts as the prompt's text above. A request that offers tools
      renders the template twice and tokenizes the prompt twice (with and without them, to
      find the definitions' tokens, :func:`~mlx_lazy.server_tools.tools_end`).
    * ``stop``: the check is linear in the generated text for each stop string
      (:class:`~mlx_lazy.server_worker.StopText`), its set-up linear in their length, and a
      stream withholds at most the longest one less a character: at most :data:`MAX_STOPS`
      of :data:`MAX_STOP_CHARS`.
    * ``logit_bias``: every decode step adds each bias, O(entries); at most
      :data:`MAX_LOGIT_BIAS` entries, each a token of the vocabulary.
    * ``logprobs`` / ``top_logprobs``: every decode step selects the alternatives on the
      device, O(vocabulary), and reads at most :data:`MAX_TOP_LOGPROBS` + 1 values; the
      answer holds them, at most that many per generated token.
    * ``pruning``: checked against the model in O(its size) before the request is queued.
    * ``max_tokens``: within the model's context (400 otherwise).

    Args:
        prompt_tokens: the most prompt tokens accepted (None: no limit known).
        token_bytes: the most bytes of text one token stands for (None: not known).
    """

    def __init__(self, prompt_tokens: Optional[int], token_bytes: Optional[int]) -> None:
        self.prompt_tokens, self.token_bytes = prompt_tokens, token_bytes

    @property
    def text_bytes(self) -> Optional[int]:
        """The most bytes of prompt text that could fit ``prompt_tokens`` tokens."""
        if self.prompt_tokens is None or self.token_bytes is None:
            return None
        return self.prompt_tokens * self.token_bytes

    def check_text(self, nbytes: int, param: str) -> None:
        """Refuse, before tokenizing, a prompt of ``nbytes`` bytes of text that cannot fit.

        Raises:
            APIError: 413.
        """
        limit = self.text_bytes
        if limit is not None and nbytes > limit:
            raise APIError(413, f"the prompt's text has {nbytes} bytes; at most "
                                f"{self.prompt_tokens} tokens are accepted, which no text "
                                f"longer than {limit} bytes fits", param=param,
                           code="context_length_exceeded")

    def check_tokens(self, n: int, param: str) -> None:
        """Refuse a prompt of ``n`` tokens longer than ``prompt_tokens``.

        Raises:
            APIError: 413.
        """
        if self.prompt_tokens is not None and n > self.prompt_tokens:
            raise APIError(413, f"the prompt has {n} token{'s' * (n != 1)}; this server "
                                f"accepts at most "
                                f"{self.prompt_tokens}", param=param,
                           code="context_length_exceeded")


MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 500
MAX_MESSAGES = 2048  # OpenAI's limit
MAX_LOGIT_BIAS = 1024
MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_SCHEMA_DEPTH = 64  # of a function's parameters: objects and arrays within each other
MAX_ID_CHARS = 256  # a tool call's id, a history call's function name
#: ``repetition_penalty`` lies in [this, its inverse]: far beyond any that helps, and logits
#: (tens at most) divided or multiplied by it stay finite in float32.
MIN_REPETITION_PENALTY = 1e-3


def token_bytes(tokenizer) -> Optional[int]:
    """The most bytes of text one token of ``tokenizer`` stands for (None when the tokenizer
    cannot say): the longest token decoded alone, plus the leading space a decoder may drop,
    times 4 when the tokenizer normalizes its input first (NFKC may shrink a 4-byte character
    to one byte). About a second for a vocabulary of 150K tokens, once."""
    try:
        ids = [[i] for i in tokenizer.get_vocab().values()]
        longest = max((len(t.encode("utf-8", "surrogatepass"))
                       for t in tokenizer.batch_decode(ids)), default=0)
    except (AttributeError, TypeError, ValueError):  # not a Hugging Face tokenizer
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    shrink = 1 if backend is not None and backend.normalizer is None else 4
    return (longest + 1) * shrink


class _Strict(BaseModel):
    # Strict: "5" is not a number; unknown fields are ignored, since OpenAI clients send
    # many (frequency_penalty, user, ...) that this server does not use.
    model_config = ConfigDict(strict=True, extra="ignore")


def _utf8(text: str) -> str:
    """``text`` when it can be encoded (JSON's ``"\\ud800"`` decodes to a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid text: {text[e.start]!r} at index {e.start} is a lone "
                         "surrogate") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]


StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


def _schema(parameters: Dict[str, Any]) -> Dict[str, Any]:
    """A function's ``parameters`` (a JSON schema object) when it nests at most
    :data:`MAX_SCHEMA_DEPTH` deep."""
    if json_depth(parameters, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"nests deeper than {MAX_SCHEMA_DEPTH} objects and arrays")
    return parameters


def _json_object(arguments: str) -> str:
    """A call's ``arguments`` when they are a JSON object ("" stands for ``{}``)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object, not {type(value).__name__}")
    return arguments


#: OpenAI's function names (letters, digits, underscores and dashes) and dots and colons,
#: which MCP clients' names hold.
FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class Function(_Strict):
    name: FunctionName
    description: Optional[Text] = None
    parameters: Optional[Annotated[Dict[str, Any], AfterValidator(_schema)]] = None
    strict: Optional[bool] = None


class Tool(_Strict):
    """A tool a request offers (OpenAI's function tool)."""

    type: Literal["function"]
    function: Function


class CalledFunction(_Strict):
    name: Annotated[Text, Field(min_length=1, max_length=MAX_ID_CHARS)]
    arguments: Annotated[Text, AfterValidator(_json_object)]


class ToolCall(_Strict):
    """A call an earlier assistant message made (the ``tool_calls`` an answer gave)."""

    id: Annotated[Text, Field(min_length=1, max_length=MAX_ID_CHARS)]
    type: Literal["function"]
    function: CalledFunction


class Message(_Strict):
    """A chat message. Checked in order, each against the fields before it: ``tool_calls``
    only on an assistant message, ``tool_call_id`` on a tool message (and only there),
    ``content`` present (not null) unless an assistant message has tool calls."""

    role: Literal["system", "user", "assistant", "tool"]
    tool_calls: Optional[Annotated[List[ToolCall], Field(max_length=MAX_TOOL_CALLS)]] = None
    tool_call_id: Annotated[Optional[Annotated[Text, Field(min_length=1,
                                                           max_length=MAX_ID_CHARS)]],
                            Field(validate_default=True)] = None
    name: Optional[Annotated[Text, Field(max_length=MAX_ID_CHARS)]] = None
    content: Annotated[Union[Text, List[TextPart], None], Field(validate_default=True)] = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_by_the_assistant(cls, calls: Optional[List[ToolCall]], info: ValidationInfo):
        if calls and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"only an assistant message makes tool calls, not a "
                             f"{info.data['role']} message")
        return calls

    @field_validator("tool_call_id")
    @classmethod
    def _id_for_a_tool(cls, tool_call_id: Optional[str], info: ValidationInfo):
        role = info.data.get("role")
        if role == "tool" and tool_call_id is None:
            raise ValueError("a tool message needs the id of the call it answers")
        if role not in ("tool", None) and tool_call_id is not None:
            raise ValueError(f"only a tool message answers a call, not a {role} message")
        return tool_call_id

    @field_validator("content")
    @classmethod
    def _content_present(cls, content, info: ValidationInfo):
        # (a role or tool_calls that failed is the error to report, not this)
        if content is None and {"role", "tool_calls"} <= set(info.data) and not (
                info.data["role"] == "assistant" and info.data["tool_calls"]):
            raise ValueError("content is required (it may be null only in an assistant "
                             "message with tool_calls)")
        return content

    def text(self) -> str:
        """The content's text ("" for none)."""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content or [])

    def text_bytes(self) -> int:
        """The bytes of its text, for :meth:`Bounds.check_text`."""
        return len(self.text().encode()) + sum(
            len(c.function.arguments.encode()) + len(c.function.name.encode())
            for c in self.tool_calls or [])


class StreamOptions(_Strict):
    include_usage: bool = False


_NOTHING = (None, False, 0, "")


class RequestBody(_Strict):
    """The fields both endpoints' bodies share (OpenAI's, plus ``pruning``)."""

    model: Optional[str] = None
    max_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    # allow_inf_nan=False: NaN fails every bound, and was reported as out of range.
    temperature: Optional[Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]] = None
    top_p: Optional[Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]] = None
    seed: Optional[Annotated[int, Field(ge=0, lt=2**64)]] = None  # mx.random.seed's domain
    stop: Union[StopString, Annotated[List[StopString], Field(max_length=MAX_STOPS)], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[Literal[1]] = None
    # mlx-lm server's sampling fields beyond OpenAI's (0 / 1.0: off)
    top_k: Optional[Annotated[int, Field(ge=0)]] = None
    min_p: Optional[Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]] = None
    # bounded: 1e-40 is 0 in float32, and logits divided by it were inf, then NaN (garbage)
    repetition_penalty: Optional[Annotated[float, Field(
        ge=MIN_REPETITION_PENALTY, le=1 / MIN_REPETITION_PENALTY, allow_inf_nan=False)]] = None
    logit_bias: Optional[Annotated[Dict[str, Annotated[float, Field(ge=-100.0, le=100.0,
                                                                    allow_inf_nan=False)]],
                                   Field(max_length=MAX_LOGIT_BIAS)]] = None
    pruning: Union[Text, Dict[Text, Any], None] = None
    # OpenAI fields that ask for what this server does not produce: the value that asks
    # nothing (null, false, 0, "", best_of 1, as clients send by default) passes, any other
    # is refused (unsupported()) rather than answered without it. A chat request's tools are
    # answered (ChatRequest.tools), a completion's are not. (logprobs: each endpoint's own.)
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Any]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    modalities: Optional[List[str]] = None
    #: The fields :meth:`unsupported` checks, in the order it reports them, with the values
    #: that ask nothing of them.
    UNSUPPORTED: ClassVar[Dict[str, tuple]] = {
        "echo": _NOTHING, "suffix": _NOTHING, "best_of": (*_NOTHING, 1),
        "presence_penalty": _NOTHING, "frequency_penalty": _NOTHING,
        "response_format": (*_NOTHING, {}, {"type": "text"}), "tools": (*_NOTHING, []),
        "tool_choice": (*_NOTHING, "none", "auto"), "modalities": (*_NOTHING, [], ["text"])}

    def unsupported(self) -> Optional[str]:
        """The first of :attr:`UNSUPPORTED` set to ask for something this server does not do,
        else None."""
        return next((name for name, nothing in self.UNSUPPORTED.items()
                     if getattr(self, name) not in nothing), None)

    def alternatives(self) -> Optional[int]:
        """How many alternatives each generated token's log probability comes with (0: its
        own only); None when log probabilities are not asked for."""
        return None


class ChatRequest(RequestBody):
    messages: Annotated[List[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None
    tools: Optional[Annotated[List[Tool], Field(max_length=MAX_TOOLS)]] = None
    # OpenAI's: true asks for each token's log probability, top_logprobs for that many
    # alternatives too (only with logprobs true; 0 or null asks nothing)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    #: tools are answered (``tool_choice`` "required" or a named function is not: the server
    #: cannot force a call)
    UNSUPPORTED: ClassVar[Dict[str, tuple]] = {
        name: nothing for name, nothing in RequestBody.UNSUPPORTED.items() if name != "tools"}

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, n: Optional[int], info: ValidationInfo) -> Optional[int]:
        # (a logprobs that failed is the error to report, not this)
        if n and "logprobs" in info.data and not info.data["logprobs"]:
            raise ValueError("top_logprobs needs logprobs: true")
        return n

    def alternatives(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def offers_tools(self) -> bool:
        """Whether the request offers tools to call (some, and ``tool_choice`` not
        ``"none"``)."""
        return bool(self.tools) and self.tool_choice != "none"

    def text_bytes(self) -> int:
        """The bytes of the text the prompt is rendered from: the messages' and the tools'
        definitions (as JSON), for :meth:`Bounds.check_text`."""
        return sum(m.text_bytes() for m in self.messages) + sum(
            len(t.model_dump_json(exclude_none=True)) for t in self.tools or [])


def _one_prompt(prompt: Any) -> Any:
    """``prompt`` unless it is OpenAI's batch, a list of strings (or of token-id lists),
    which was refused as "prompt[0]: Input should be a valid integer"."""
    if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
        raise ValueError("a batch of prompts is not supported: send one prompt, a string or "
                         "a list of token ids")
    return prompt


def _legacy_logprobs(value: Any) -> Any:
    """A completion's ``logprobs``: false (as some clients send) asks nothing, true is no
    count of alternatives."""
    if value is False:
        return None
    if value is True:
        raise ValueError(f"must be the number of alternatives to return for each token, 0 to "
                         f"{MAX_COMPLETION_LOGPROBS}, not true")
    return value


class CompletionRequest(RequestBody):
    prompt: Annotated[Union[Annotated[str, StringConstraints(min_length=1),
                                      AfterValidator(_utf8)],
                            Annotated[List[int], Field(min_length=1)]],
                      BeforeValidator(_one_prompt)]
    # OpenAI's legacy field: N asks for each token's log probability and N alternatives
    logprobs: Annotated[Optional[Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)]],
                        BeforeValidator(_legacy_logprobs)] = None
    top_logprobs: Optional[int] = None  # a chat field: 0 or null only

    @field_validator("top_logprobs")
    @classmethod
    def _not_here(cls, n: Optional[int]) -> Optional[int]:
        if n:
            raise ValueError(f"not a completion's field: logprobs N (0 to "
                             f"{MAX_COMPLETION_LOGPROBS}) asks for N alternatives")
        return n

    def alternatives(self) -> Optional[int]:
        return self.logprobs


INTERNAL_FIELDS = ("source", "fingerprint")  # PruningConfig fields set by schedule files only


def pruning_config(spec: Union[str, Dict[str, Any]], default: PruningConfig,
                   num_layers: Optional[int] = None) -> PruningConfig:
    """The configuration a ``"pruning"`` value asks for (not yet checked against a model).

    A string is a method (its preset). An object holds :class:`PruningConfig` fields other
    than :data:`INTERNAL_FIELDS`; with a ``"method"`` it overrides that preset, without one
    the server's ``default``. JSON arrays become tuples; with ``num_layers``, one longer than
    that is refused before any is checked (a list names one item per cut, at most one cut per
    layer).

    Raises:
        APIError: 400 for an unknown preset, method or field, or a field of the wrong type.
    """
    if isinstance(spec, str):
        fields, method = {}, spec
    else:
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()}
        method = fields.pop("method", None)
        names = {f.name for f in dataclasses.fields(PruningConfig)} - set(INTERNAL_FIELDS)
        unknown = sorted(set(fields) - names)
        if unknown:
            raise APIError(400, f"unknown pruning field {shown(unknown[0], 40)}; fields are "
                                f"{', '.join(sorted(names))}", param=f"pruning.{unknown[0]}")
        long = next((k for k, v in fields.items() if isinstance(v, tuple)
                     and num_layers is not None and len(v) > num_layers), None)
        if long is not None:
            raise APIError(400, f"pruning.{long} has {len(fields[long])} items; the model has "
                                f"{num_layers} layers, at most one cut each",
                           param=f"pruning.{long}")
    if method is not None:
        try:
            compose(method)
        except UserInputError as e:
            raise APIError(400, str(e),
                           param="pruning" if isinstance(spec, str) else "pruning.method") from None
    try:  # PruningConfig checks its fields' types on construction
        if method is None:  # cuts given over a schedule file's are the user's
            mine = {"source": None} if set(fields) & set(PRUNING_FIELDS) else {}
            return dataclasses.replace(default, **fields, **mine)
        return PruningConfig.preset(method, **fields)
    except UserInputError as e:  # naming the field it refuses (keep[1])
        raise APIError(400, str(e), param=f"pruning.{e.field}" if e.field else "pruning"
                       ) from None

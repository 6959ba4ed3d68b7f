"""The server's request bodies (pydantic models, strict: ``"5"`` is not a number), the bounds on
their fields (:class:`Bounds`, the cost model) and the ``"pruning"`` field read into a
:class:`~mlx_lazy.config.PruningConfig` (:func:`pruning_config`). Needs the ``[server]`` extra.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Dict, List, Literal, Optional, Union

from .extras import needs_extra

with needs_extra("server", "the server"):
    from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                          StringConstraints)

from .config import PRUNING_FIELDS, PruningConfig
from .errors import UserInputError, shown
from .policies import compose
from .server_worker import APIError


class Bounds:
    """Every request field whose cost grows with its size, and its bound: no body within
    them costs more than a bounded amount of time or memory before it is refused.

    Cost model, per request, n being the body's bytes:

    * the body: read, parsed and validated in O(n); ``max_body_bytes`` (413) is checked on
      the bytes as they arrive, before any parsing. Fields the server ignores (``tools``,
      ``user``, ...) cost their parse only, within that bound.
    * a prompt's text: tokenizing is O(bytes) and the slowest step a body can ask for (1-2 s
      per MB on a CPU), so a text too long to fit ``prompt_tokens`` is refused (413)
      before the tokenizer runs: a token stands for at most ``token_bytes`` bytes of text
      (:func:`token_bytes`), so more than ``prompt_tokens * token_bytes`` bytes cannot fit.
    * token ids: checked against the vocabulary in O(ids); more than ``prompt_tokens`` is 413.
    * ``messages``: the chat template renders O(messages + bytes); at most
      :data:`MAX_MESSAGES` (OpenAI's own limit), their text as a prompt's text above.
    * ``stop``: the check is linear in the generated text for each stop string
      (:class:`~mlx_lazy.server_worker.StopText`), its set-up linear in their length, and a
      stream withholds at most the longest one less a character: at most :data:`MAX_STOPS`
      of :data:`MAX_STOP_CHARS`.
    * ``logit_bias``: every decode step adds each bias, O(entries); at most
      :data:`MAX_LOGIT_BIAS` entries, each a token of the vocabulary.
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


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Union[Text, List[TextPart]]


class StreamOptions(_Strict):
    include_usage: bool = False


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
    # is refused (unsupported()) rather than answered without it.
    logprobs: Union[bool, int, None] = None
    top_logprobs: Optional[int] = None
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    response_format: Optional[Dict[str, Any]] = None
    tools: Optional[List[Any]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    modalities: Optional[List[str]] = None

    def unsupported(self) -> Optional[str]:
        """The first field set to ask for something this server does not do, else None."""
        return next((name for name, nothing in UNSUPPORTED.items()
                     if getattr(self, name) not in nothing), None)


_NOTHING = (None, False, 0, "")
#: Fields :meth:`RequestBody.unsupported` checks, in the order it reports them, with the
#: values that ask nothing of them.
UNSUPPORTED = {"logprobs": _NOTHING, "top_logprobs": _NOTHING, "echo": _NOTHING,
               "suffix": _NOTHING, "best_of": (*_NOTHING, 1), "presence_penalty": _NOTHING,
               "frequency_penalty": _NOTHING,
               "response_format": (*_NOTHING, {}, {"type": "text"}), "tools": (*_NOTHING, []),
               "tool_choice": (*_NOTHING, "none", "auto"),
               "modalities": (*_NOTHING, [], ["text"])}


class ChatRequest(RequestBody):
    messages: Annotated[List[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1)]] = None


def _one_prompt(prompt: Any) -> Any:
    """``prompt`` unless it is OpenAI's batch, a list of strings (or of token-id lists),
    which was refused as "prompt[0]: Input should be a valid integer"."""
    if isinstance(prompt, list) and any(isinstance(p, (str, list)) for p in prompt):
        raise ValueError("a batch of prompts is not supported: send one prompt, a string or "
                         "a list of token ids")
    return prompt


class CompletionRequest(RequestBody):
    prompt: Annotated[Union[Annotated[str, StringConstraints(min_length=1),
                                      AfterValidator(_utf8)],
                            Annotated[List[int], Field(min_length=1)]],
                      BeforeValidator(_one_prompt)]


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

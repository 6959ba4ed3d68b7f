"""Tool calls in the server's chat completions, as mlx-lm's server reads them: the model's
tokenizer (mlx-lm's ``TokenizerWrapper``) names the text that opens and closes a call
(``tool_call_start`` / ``tool_call_end``, ``<tool_call>`` / ``</tool_call>`` for Qwen) and the
parser that reads the text between them (``tool_parser``, one of ``mlx_lm.tool_parsers``).

* :class:`CallSplitter` splits the generated text at those markers, on the generation thread,
  before the stop strings see it (they apply to the text outside calls only).
* :func:`parse_calls` reads one call's text into OpenAI ``tool_calls`` items.
* :class:`ChatOutput` turns the worker's events into an answer's ``content`` and
  ``tool_calls`` and its ``finish_reason``, the same for a stream and a whole response.
* :func:`tools_end` finds where a rendered prompt's tool definitions end, so that pruning
  keeps them (the request's anchors).

Nothing here needs the ``[server]`` extra.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .prompt_cache import common_prefix

log = logging.getLogger("mlx_lazy.server")

#: A piece of generated text: ``("text", s)`` outside any call, ``("call", s)`` the text of a
#: call between its markers, ``("raw", s)`` a call's text the markers left unterminated
#: (markers included), which is answered as text.
Piece = Tuple[str, str]


class CallSplitter:
    """Splits streamed text into the text outside tool calls and each call's text.

    Text that may begin ``start`` is withheld until it does or cannot (at most
    ``len(start) - 1`` characters); a call's text is withheld until ``end`` closes it (an
    empty ``end``, as Mistral's ``[TOOL_CALLS]`` format has: the calls run to the end of the
    answer). Each :meth:`feed` costs time linear in its text (amortized): the search for
    ``end`` resumes where the last one left off.
    """

    def __init__(self, start: str, end: str) -> None:
        if not start:
            raise ValueError("a tool call's opening marker must not be empty")
        self.start, self.end = start, end
        self.in_call = False
        self._buf = ""  # the text fed and in no piece yet (an open call's with its marker)
        self._searched = 0  # in a call: _buf[:this] holds no ``end``
        #: where the pieces the last :meth:`feed` or :meth:`finish` returned lie in the text
        #: fed, counted back from its end: ``(start, end)``, markers included (one after
        #: another, no gaps)
        self.spans: List[Tuple[int, int]] = []

    def _piece(self, out: List[Piece], kind: str, text: str, size: int) -> None:
        """Add a piece of the first ``size`` characters withheld."""
        out.append((kind, text))
        self.spans.append((len(self._buf), len(self._buf) - size))
        self._buf = self._buf[size:]

    def feed(self, text: str) -> List[Piece]:
        """Add ``text``; the pieces now known whole."""
        out: List[Piece] = []
        self.spans = []
        self._buf += text
        while True:
            if not self.in_call:
                i = self._buf.find(self.start)
                if i < 0:
                    safe = len(self._buf) - _partial(self._buf, self.start)
                    if safe:
                        self._piece(out, "text", self._buf[:safe], safe)
                    return out
                if i:
                    self._piece(out, "text", self._buf[:i], i)
                self.in_call, self._searched = True, len(self.start)
            elif not self.end:  # closed by the end of the answer only
                return out
            else:
                j = self._buf.find(self.end, self._searched)
                if j < 0:
                    self._searched = max(len(self.start), len(self._buf) - len(self.end) + 1)
                    return out
                self.in_call = False
                self._piece(out, "call", self._buf[len(self.start):j], j + len(self.end))

    def finish(self, cut: bool) -> List[Piece]:
        """The withheld text at the end of the generation. A call left open is read as a call
        when the model ended it (its end-of-sequence token: ``cut`` False, as mlx-lm's server
        reads it), and answered as its raw text, markers included, when ``max_tokens`` cut it
        (``cut`` True): a call whose arguments may be missing their end is not made."""
        out: List[Piece] = []
        self.spans = []
        if self.in_call:
            self.in_call = False
            self._piece(out, "raw" if cut else "call",
                        self._buf if cut else self._buf[len(self.start):], len(self._buf))
        elif self._buf:
            self._piece(out, "text", self._buf, len(self._buf))
        return out


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (shorter than it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def parse_calls(parser: Callable[[str, Any], Any], text: str,
                tools: Optional[List[dict]]) -> Optional[List[dict]]:
    """The OpenAI ``tool_calls`` items (``id``, ``type``, ``function.name``,
    ``function.arguments`` as a JSON string) that ``parser`` (a tokenizer's ``tool_parser``)
    reads in one call's ``text`` (the id the parser read, else a new one); None when it
    cannot read it, or reads something that is not a call: a non-empty ``name`` and
    ``arguments`` that are a JSON object (or a string holding one; absent: ``{}``)."""
    try:
        parsed = parser(text, tools)
    except Exception as e:  # a parser's error, whatever its kind, is the model's bad call
        log.warning("a tool call could not be parsed (%s: %s); answered as text",
                    type(e).__name__, e)
        return None
    out = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        name = call.get("name") if isinstance(call, dict) else None
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not (isinstance(name, str) and name and isinstance(arguments, dict)):
            log.warning("a tool call parsed to %.200r, not a name and arguments; answered as "
                        "text", call)
            return None
        given = call.get("id")  # a parser may read the model's own id (Mistral's)
        out.append({"id": given if isinstance(given, str) and given
                    else "call_" + uuid.uuid4().hex[:24], "type": "function",
                    "function": {"name": name,
                                 "arguments": json.dumps(arguments, ensure_ascii=False)}})
    return out or None


class ChatOutput:
    """A chat answer assembled from the worker's events: :meth:`content` for its text,
    :meth:`call` for a call's text, :meth:`end` at its end. Each returns what to send now
    (a stream sends it as it comes, a whole response joins it), and :meth:`take` the log
    probabilities of the tokens of what they returned (when asked for).

    Without ``parser`` (no tools offered) text passes through unchanged. With one, a call's
    text becomes ``tool_calls`` items, or, when it cannot be parsed, text (markers
    included); text that is only whitespace is withheld until more text follows, and dropped
    at the end of an answer that made a call (the newline between two calls, or after one,
    is not an answer's content). A token goes with its text: the tokens of a call that
    became ``tool_calls`` and of dropped whitespace are no content's, and are dropped too.
    """

    def __init__(self, parser: Optional[Callable[[str, Any], Any]] = None,
                 tools: Optional[List[dict]] = None, markers: Tuple[str, str] = ("", "")) -> None:
        self.parser, self.tools, self.markers = parser, tools, markers
        self.calls = 0  # tool_calls items made so far
        self._held = ""
        self._held_tokens: List[Any] = []
        self._ready: List[Any] = []

    def content(self, text: str, tokens: Sequence[Any] = ()) -> str:
        """The text to send for ``text`` outside calls (of ``tokens``)."""
        if self.parser is None:
            self._ready += tokens
            return text
        text, self._held = self._held + text, ""
        tokens, self._held_tokens = self._held_tokens + list(tokens), []
        if text.strip():
            self._ready += tokens
            return text
        self._held, self._held_tokens = text, tokens
        return ""

    def call(self, text: str, tokens: Sequence[Any] = ()) -> Tuple[str, List[dict]]:
        """The text and the ``tool_calls`` items (without ``index``) to send for a call's
        ``text`` (of ``tokens``)."""
        calls = None if self.parser is None else parse_calls(self.parser, text, self.tools)
        if calls is None:
            start, end = self.markers
            return self.content(start + text + end, tokens), []
        self._held, self._held_tokens = "", []
        self.calls += len(calls)
        return "", calls

    def end(self) -> str:
        """The withheld text to send at the end: none after a call."""
        held, self._held = self._held, ""
        tokens, self._held_tokens = self._held_tokens, []
        if self.calls:
            return ""
        self._ready += tokens
        return held

    def take(self) -> List[Any]:
        """The tokens of the text returned since the last call (their log probabilities)."""
        out, self._ready = self._ready, []
        return out

    def finish_reason(self, reason: str) -> str:
        """``"tool_calls"`` for an answer that made a call and ended as the model chose
        (``"stop"``); ``reason`` otherwise (``"length"`` stays: the answer was cut)."""
        return "tool_calls" if self.calls and reason == "stop" else reason


def tools_end(with_tools: Sequence[int], without: Sequence[int]) -> int:
    """How many leading tokens of a prompt rendered with tool definitions (``with_tools``)
    reach the end of the definitions, given the same messages rendered without them
    (``without``): the tokens before the common end of the two (all of them when the
    definitions follow the conversation, so that nothing before them is pruned either);
    0 when the two are the same (the template does not render the tools)."""
    prefix = common_prefix(with_tools, without)
    if prefix == len(with_tools) == len(without):
        return 0
    shortest = min(len(with_tools), len(without))
    suffix = 0
    while (suffix < shortest - prefix
           and with_tools[len(with_tools) - 1 - suffix] == without[len(without) - 1 - suffix]):
        suffix += 1
    return len(with_tools) - suffix

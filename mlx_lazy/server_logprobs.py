"""Log probabilities in the server's answers (``logprobs`` / ``top_logprobs``).

* :class:`LogprobSampler` wraps a generation's sampler: beside each token it draws, it
  selects on the device (``mx.argpartition``) from the log probability vector it is given
  (:func:`~mlx_lazy.api.generate_step`'s: the log-softmax of the logits after the logits
  processors, ``logit_bias`` and ``repetition_penalty``, before the sampler's temperature,
  ``top_p``, ``top_k`` and ``min_p``, as mlx-lm's server reports them) the token's value and
  the ``k`` largest, evaluated with the token; :func:`token_logprob` reads them.
* :class:`TokenTexts` says how a token shows: its bytes (the tokenizer's own, byte-level or
  SentencePiece byte fallback) and its text, or ``"bytes:\\xe6\\x97"`` for a token that is
  part of a character (as OpenAI shows one).
* :class:`Aligner` ties each token to the text it produced, so that a token goes out with the
  piece of text that completes its own (a stream's chunk), and a token whose text a stop
  string cut away entirely does not go out at all.
* :func:`chat_logprobs` and :func:`completion_logprobs` are the two answers' shapes.

Nothing here needs the ``[server]`` extra.
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

#: The most alternatives a chat request's ``top_logprobs`` asks for (OpenAI's limit) and a
#: completion's ``logprobs`` (OpenAI's legacy limit).
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
#: What a log probability that is not a finite number (a logit masked to -inf) is reported
#: as: OpenAI's value for "very unlikely" (JSON has no -Infinity).
UNLIKELY = -9999.0


@dataclasses.dataclass
class TokenLogprob:
    """One generated token's log probability and its ``top`` alternatives (each
    ``(text, bytes, logprob)``, most likely first); ``offset``: where its text begins in the
    answer's text (set by :class:`Aligner`)."""

    token: str
    bytes: Tuple[int, ...]
    logprob: float
    top: Tuple[Tuple[str, Tuple[int, ...], float], ...] = ()
    offset: int = 0


class TokenTexts:
    """How the tokens of ``tokenizer`` (mlx-lm's ``TokenizerWrapper``) show in log
    probabilities, cached by id. A token's bytes are what its streaming detokenizer adds for
    it: a byte-level BPE token's bytes (GPT-2's byte alphabet), a SentencePiece piece with
    its ``▁`` a space and ``<0xNN>`` the byte NN; for other tokenizers the UTF-8 of the token
    decoded alone. Its text is its bytes decoded when they are whole UTF-8 characters, else
    ``"bytes:"`` and the bytes as ``\\xNN`` escapes."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        detokenizer = getattr(tokenizer, "detokenizer", None)  # mlx-lm's, a shallow copy
        self._bpe = self._spm = None
        kind = type(detokenizer).__name__
        if kind == "BPEStreamingDetokenizer":
            from mlx_lm.tokenizer_utils import _byte_decoder
            self._bpe, self._decoder = detokenizer.tokenmap, _byte_decoder()
        elif kind == "SPMStreamingDetokenizer":
            self._spm = detokenizer.tokenmap
        self._cache: Dict[int, Tuple[str, Tuple[int, ...]]] = {}

    def __call__(self, token: int) -> Tuple[str, Tuple[int, ...]]:
        """``(text, bytes)`` of ``token``."""
        found = self._cache.get(token)
        if found is None:
            raw = self._bytes(token)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._cache[token] = (text, tuple(raw))
        return found

    def _bytes(self, token: int) -> bytes:
        if self._bpe is not None and token < len(self._bpe):
            return b"".join(bytes([self._decoder[c]]) if c in self._decoder else c.encode()
                            for c in self._bpe[token])
        if self._spm is not None and token < len(self._spm):
            return self._spm[token].replace("\u2581".encode(), b" ")
        return self.tokenizer.decode([token]).encode("utf-8", "replace")


def _finite(value: float) -> float:
    return value if math.isfinite(value) else UNLIKELY


#: What :class:`LogprobSampler` computes for a token: the float32 log probabilities of the
#: token and of the ``k`` most likely (``(k + 1,)``), and the latter's ids (``(k,)``).
Draw = Tuple[mx.array, mx.array]


class LogprobSampler:
    """``sampler`` (a generation's), which also selects for each token it draws that token's
    log probability and the ``k`` largest (:data:`Draw`), on the device and evaluated in the
    token's own ``mx.async_eval``: reading them (:func:`token_logprob`) waits for nothing
    the token did not, and asking for log probabilities adds no evaluation to a step.

    :meth:`pop` hands the draws out in order: :func:`~mlx_lazy.api.generate_step`'s n-th
    draw is its n-th token (on a GPU it draws the next token before handing out the last).
    """

    def __init__(self, sampler: Callable[[mx.array], mx.array], k: int) -> None:
        self.sampler, self.k = sampler, k
        self._draws: "collections.deque[Draw]" = collections.deque()

    def __call__(self, logprobs: mx.array) -> mx.array:
        """The token (1,) ``sampler`` draws from ``logprobs`` (1, vocabulary)."""
        token = self.sampler(logprobs)
        row = logprobs[0]
        top = (mx.argpartition(-row, kth=self.k - 1)[:self.k] if self.k
               else mx.zeros((0,), mx.uint32))
        values = row[mx.concatenate([token, top])].astype(mx.float32)
        mx.async_eval(token, values, top)
        self._draws.append((values, top))
        return token

    def pop(self) -> Draw:
        """The oldest draw not handed out yet."""
        return self._draws.popleft()


def token_logprob(draw: Draw, token: int, texts: TokenTexts) -> TokenLogprob:
    """``token``'s entry from its :class:`LogprobSampler` ``draw``, with the ``k`` most likely
    tokens (ties: the lower id first)."""
    values, top = draw
    chosen, *rest = values.tolist()
    ranked = sorted(zip(top.tolist(), rest), key=lambda p: (-_finite(p[1]), p[0]))
    return TokenLogprob(*texts(token), _finite(chosen),
                        tuple((*texts(i), _finite(v)) for i, v in ranked))


class Aligner:
    """Ties generated tokens to the text they produced, in the characters fed to the stop and
    tool-call checks (``fed``). A token whose detokenized text is empty (part of a character,
    a space held until the next token) joins the tokens up to the next that produces text:
    the group owns that text, ``[start, end)``. :meth:`upto` hands out the tokens whose text
    ends by a point, or (``partial``, at a stop string) begins before it."""

    def __init__(self) -> None:
        self.fed = 0
        self._groups: "collections.deque[Tuple[int, int, List[TokenLogprob]]]" = \
            collections.deque()
        self._open: List[TokenLogprob] = []

    def add(self, entry: Optional[TokenLogprob], chars: int) -> None:
        """A step's token (None: one that is no part of the answer, the end-of-sequence
        token) and the characters of text it brought (its detokenized segment)."""
        if entry is not None:
            self._open.append(entry)
        if not chars:
            return
        if self._open:  # each token begins at the character its first byte is part of
            decoder, before = codecs.getincrementaldecoder("utf-8")("replace"), 0
            for e in self._open:
                e.offset = self.fed + min(before, chars - 1)
                before += len(decoder.decode(bytes(e.bytes)))
            self._groups.append((self.fed, self.fed + chars, self._open))
            self._open = []
        self.fed += chars

    def upto(self, pos: int, partial: bool = False) -> List[TokenLogprob]:
        """The tokens, not handed out yet, whose text ends at ``pos`` or before (``partial``:
        whose text begins before ``pos``)."""
        out: List[TokenLogprob] = []
        groups = self._groups
        while groups and (groups[0][1] <= pos or (partial and groups[0][0] < pos)):
            out += groups.popleft()[2]
        return out

    def rest(self) -> List[TokenLogprob]:
        """Every token not handed out yet, those without text too (the end of an answer)."""
        for e in self._open:
            e.offset = self.fed
        out = [e for g in self._groups for e in g[2]] + self._open
        self._groups.clear()
        self._open = []
        return out

    def drop(self) -> None:
        """Forget the tokens not handed out (after a stop string)."""
        self.rest()


def chat_logprobs(entries: Sequence[TokenLogprob]) -> Dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [...], "refusal": None}``."""
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(b)} for t, b, v in e.top]}
        for e in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob]) -> Dict[str, Any]:
    """A completion choice's legacy ``logprobs``: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (per token, the alternatives and the chosen token, text to logprob: two
    tokens that show alike keep the larger) and ``text_offset`` (into the choice's text)."""
    tops = []
    for e in entries:
        top: Dict[str, float] = {}
        for t, _, v in e.top:
            top.setdefault(t, v)
        top.setdefault(e.token, e.logprob)
        tops.append(top)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": [e.offset for e in entries]}

"""Offline long-context tasks, generated deterministically from a seed.

Each task is a small dataclass whose :meth:`Task.parts` draws one problem from a
``random.Random`` (instruction, needles, question, references, answer prefix, filler units).
:func:`build_samples` then fits the filler to a target prompt length measured with the
model's own tokenizer *after* the chat template is applied, and inserts the needles at
depths spread over the context.

Tasks (``TASKS``):

- ``passkey``: the classic pass-key retrieval prompt over repeated filler sentences.
- ``niah_single`` / ``niah_multikey`` / ``niah_multivalue``: RULER-style needles
  ("One of the special magic numbers for {key} is: {value}.") in a haystack of natural
  English prose: the help texts shipped with every Python install
  (``pydoc_data.topics``), cleaned to sentences.
- ``kv_retrieval``: a JSON object of random key/value strings; return one key's value.
- ``multidoc_qa``: several short documents (prose + one biographical fact each); exactly
  one document answers "In which city was X born?".

:func:`build_prompt` gives plain prose of exactly N tokens (the speed benchmark's prompts).

The same ``(seed, task, length, index)`` always gives the same prompt; the randomness is
seeded with a string, which Python hashes deterministically (no ``PYTHONHASHSEED`` effect).
"""

from __future__ import annotations

import functools
import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

# ----------------------------------------------------------------------------------------
# Samples


@dataclass(frozen=True)
class Sample:
    """One benchmark prompt, ready to feed to a model (chat template already applied)."""

    task: str
    index: int
    seed: int
    target_tokens: int
    prompt: str  # full text fed to the model: chat template + answer prefix
    tokens: tuple[int, ...]  # ``prompt`` encoded with the model's tokenizer
    question: str
    references: tuple[str, ...]
    match: str  # primary metric, see :mod:`mlx_lazy.bench.metrics`
    depths: tuple[float, ...]  # relative positions of the needles in the context (0..1)
    max_tokens: int  # generation budget (answers are short)

    @property
    def n_tokens(self) -> int:
        """Actual prompt length in tokens (≤ ``target_tokens``)."""
        return len(self.tokens)

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (without the long prompt text and tokens)."""
        return {
            "task": self.task,
            "index": self.index,
            "seed": self.seed,
            "target_tokens": self.target_tokens,
            "prompt_tokens": self.n_tokens,
            "question": self.question,
            "references": list(self.references),
            "match": self.match,
            "depths": [round(d, 3) for d in self.depths],
        }


@dataclass(frozen=True)
class Parts:
    """The pieces of one problem, before fitting to a length."""

    instruction: str
    needles: tuple[str, ...]
    question: str
    answer_prefix: str
    references: tuple[str, ...]
    filler: Callable[[int], str]  # i -> i-th filler unit (infinite stream)
    separator: str = " "


# ----------------------------------------------------------------------------------------
# Word lists and haystack text

_ADJECTIVES = (
    "ancient brave calm clever curious daring eager fancy gentle golden happy hidden "
    "humble jolly kind lively lucky mighty noble proud quiet rapid royal shiny silent "
    "silly smooth swift tender tiny vivid wise witty young zealous"
).split()
_NOUNS = (
    "anchor apple badger barrel beacon canyon castle comet desert dragon falcon forest "
    "garden harbor island jungle kettle lantern meadow mirror mountain oyster panther "
    "pepper planet river rocket saddle tiger tulip valley violin walrus willow"
).split()
_FIRST_NAMES = (
    "Alice Bruno Clara Dmitri Elena Farid Greta Hiro Ines Jonas Kira Lucas Maya Nikolai "
    "Olga Pablo Quinn Rosa Samir Tara Umar Vera Wendell Xenia Yusuf Zora"
).split()
_SURNAMES = (
    "Abbott Brennan Castillo Duarte Eriksen Fontaine Galloway Hartmann Ivanova Jaworski "
    "Kowalski Lindqvist Moreau Nakamura Okafor Petrov Quintero Rasmussen Santoro Takahashi "
    "Underwood Valdez Whitaker Yamada Zimmerman"
).split()
_CITIES = (
    "Lisbon Oslo Nairobi Toronto Kyoto Lima Dublin Warsaw Cairo Hanoi Quito Tallinn "
    "Seville Bergen Porto Krakow Accra Osaka Geneva Perth Santiago Helsinki Valencia "
    "Manila Tunis Bogota Riga Antwerp Glasgow Zagreb"
).split()
_PROFESSIONS = (
    "architect baker carpenter chemist dentist engineer farmer geologist historian "
    "journalist librarian musician nurse painter pharmacist pilot sculptor surveyor "
    "teacher translator"
).split()

PASSKEY_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)


@functools.lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """English sentences from the Python help texts (``pydoc_data.topics``), cleaned.

    Titles, underlines, indented code/grammar blocks and symbol-heavy sentences are
    dropped; what remains is ordinary prose, in a fixed order (sorted topic names).
    """
    from pydoc_data.topics import topics

    sentences: list[str] = []
    for name in sorted(topics):
        lines = topics[name].splitlines()
        paragraphs: list[list[str]] = [[]]
        for i, line in enumerate(lines):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            is_title = bool(nxt) and set(nxt.strip()) <= set("*=-~^") and nxt.strip() != ""
            is_rule = line.strip() != "" and set(line.strip()) <= set("*=-~^")
            if not line.strip() or line.startswith(" ") or is_title or is_rule:
                paragraphs.append([])
                continue
            paragraphs[-1].append(line.strip())
        for para in paragraphs:
            text = " ".join(para)
            for sent in re.split(r"(?<=[.!?])\s+(?=[A-Z])", text):
                if _is_prose(sent):
                    sentences.append(sent)
    return tuple(sentences)


def build_prompt(tokenizer: Any, n_tokens: int, offset: int = 0) -> list[int]:
    """Exactly ``n_tokens`` token ids of English prose (:func:`prose_sentences`, repeated if
    needed), starting ``offset`` sentences in (different offsets give different texts).

    The prose is encoded 100 sentences at a time, only as far as needed (no single encode
    exceeds the tokenizer's maximum length, so transformers stays quiet).
    """
    sentences = prose_sentences()
    ids: list[int] = []
    i = offset
    while len(ids) < n_tokens:
        chunk = " ".join(sentences[(i + j) % len(sentences)] for j in range(100))
        new = list(tokenizer.encode(chunk if not ids else " " + chunk))
        if not new:
            raise ValueError("the tokenizer produced no tokens for the benchmark prose")
        ids += new
        i += 100
    return ids[:n_tokens]


def _is_prose(sentence: str) -> bool:
    if not (40 <= len(sentence) <= 300) or not sentence.endswith("."):
        return False
    if not sentence[0].isupper() or any(s in sentence for s in ("::", ">>>", "__", "()", "[", "{")):
        return False
    letters = sum(c.isalpha() or c == " " for c in sentence)
    return letters / len(sentence) > 0.93 and not re.search(r"\d", sentence)


def _prose_stream(rng: random.Random) -> Callable[[int], str]:
    """Consecutive prose sentences from a random starting point (wrapping around)."""
    sents = prose_sentences()
    start = rng.randrange(len(sents))
    return lambda i: sents[(start + i) % len(sents)]


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randrange(10 ** (n - 1), 10**n))


def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"


def _distinct(rng: random.Random, make: Callable[[random.Random], str], n: int) -> list[str]:
    """``n`` different items drawn with ``make``.

    Raises:
        ValueError: ``make`` has fewer than ``n`` to give (it looped forever: 1,191 keys of
            the 1,190 adjective-noun pairs).
    """
    out: list[str] = []
    seen, misses = set(), 0
    while len(out) < n:
        item = make(rng)
        if item in seen:
            misses += 1
            if misses > 100 * n + 10_000:
                raise ValueError(f"cannot draw {n} different keys or values: no new one in "
                                 f"{misses} draws after {len(out)} (ask for fewer)")
            continue
        seen.add(item)
        out.append(item)
    return out


# ----------------------------------------------------------------------------------------
# Tasks

_NIAH_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the numbers afterwards."
)


def _magic(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


@dataclass(frozen=True)
class Task:
    """Base class: a named problem generator with a primary metric and an answer budget."""

    name: ClassVar[str] = ""
    match: ClassVar[str] = "all"
    max_tokens: int = 16

    def parts(self, rng: random.Random) -> Parts:  # pragma: no cover - abstract
        """Draw one problem."""
        raise NotImplementedError


@dataclass(frozen=True)
class Passkey(Task):
    """Pass-key retrieval in repeated filler (Mohtashami & Jaggi, 2023)."""

    name: ClassVar[str] = "passkey"
    match: ClassVar[str] = "any"
    digits: int = 5
    max_tokens: int = 12

    def parts(self, rng: random.Random) -> Parts:
        key = _digits(rng, self.digits)
        return Parts(
            instruction=(
                "There is an important info hidden inside a lot of irrelevant text. Find it "
                "and memorize it. I will quiz you about the important information there."
            ),
            needles=(f"The pass key is {key}. Remember it. {key} is the pass key.",),
            question="What is the pass key?",
            answer_prefix="The pass key is",
            references=(key,),
            filler=lambda i: PASSKEY_FILLER,
        )


@dataclass(frozen=True)
class NiahSingle(Task):
    """One magic-number needle in natural prose."""

    name: ClassVar[str] = "niah_single"
    match: ClassVar[str] = "all"
    digits: int = 7

    def parts(self, rng: random.Random) -> Parts:
        key, value = _word_key(rng), _digits(rng, self.digits)
        return _niah_parts(rng, [_magic(key, value)], key, (value,), plural=False)


@dataclass(frozen=True)
class NiahMultiKey(Task):
    """Several needles with different keys; the question asks for one of them."""

    name: ClassVar[str] = "niah_multikey"
    match: ClassVar[str] = "all"
    num_keys: int = 4
    digits: int = 7

    def parts(self, rng: random.Random) -> Parts:
        keys = _distinct(rng, _word_key, self.num_keys)
        values = _distinct(rng, lambda r: _digits(r, self.digits), self.num_keys)
        target = rng.randrange(self.num_keys)
        needles = [_magic(k, v) for k, v in zip(keys, values)]
        return _niah_parts(rng, needles, keys[target], (values[target],), plural=False)


@dataclass(frozen=True)
class NiahMultiValue(Task):
    """Several needles for the same key; all values must be returned."""

    name: ClassVar[str] = "niah_multivalue"
    match: ClassVar[str] = "all"
    num_values: int = 3
    digits: int = 7
    max_tokens: int = 40

    def parts(self, rng: random.Random) -> Parts:
        key = _word_key(rng)
        values = _distinct(rng, lambda r: _digits(r, self.digits), self.num_values)
        return _niah_parts(rng, [_magic(key, v) for v in values], key, tuple(values), plural=True)


def _niah_parts(
    rng: random.Random, needles: Sequence[str], key: str, refs: tuple[str, ...], plural: bool
) -> Parts:
    what = "all the special magic numbers" if plural else "the special magic number"
    prefix = (
        f"The special magic numbers for {key} mentioned in the provided text are"
        if plural
        else f"The special magic number for {key} mentioned in the provided text is"
    )
    return Parts(
        instruction=_NIAH_INSTRUCTION,
        needles=tuple(needles),
        question=(f"What {'are' if plural else 'is'} {what} for {key} mentioned in the "
                  "provided text?"),
        answer_prefix=prefix,
        references=refs,
        filler=_prose_stream(rng),
    )


@dataclass(frozen=True)
class KVRetrieval(Task):
    """Key-value retrieval from a JSON object of random strings (Liu et al., 2023)."""

    name: ClassVar[str] = "kv_retrieval"
    match: ClassVar[str] = "all"
    key_chars: int = 8
    max_tokens: int = 20

    def parts(self, rng: random.Random) -> Parts:
        alphabet = string.ascii_lowercase + string.digits

        def token(r: random.Random) -> str:
            return "".join(r.choice(alphabet) for _ in range(self.key_chars))

        key, value = token(rng), token(rng)
        # Filler pairs come from their own generator so the stream is infinite and stable.
        sub = random.Random(rng.random())
        pairs: dict[int, str] = {}

        def filler(i: int) -> str:
            while len(pairs) <= i:
                pairs[len(pairs)] = f'"{token(sub)}": "{token(sub)}",'
            return pairs[i]

        return Parts(
            instruction=(
                "Extract the value corresponding to the specified key in the JSON object "
                "below.\n\nJSON data:"
            ),
            needles=(f'"{key}": "{value}",',),
            question=f'Key: "{key}"\nThe value associated with the specified key is:',
            answer_prefix=f'The value associated with the key "{key}" is "',
            references=(value,),
            filler=filler,
            separator="\n",
        )


@dataclass(frozen=True)
class MultiDocQA(Task):
    """Synthetic multi-document QA: one of many short documents answers the question."""

    name: ClassVar[str] = "multidoc_qa"
    match: ClassVar[str] = "f1"
    sentences_per_doc: int = 2

    def parts(self, rng: random.Random) -> Parts:
        prose = _prose_stream(rng)
        sub = random.Random(rng.random())
        people: dict[int, str] = {}

        def person(r: random.Random) -> str:
            return f"{r.choice(_FIRST_NAMES)} {r.choice(_SURNAMES)}"

        name = person(rng)
        city = rng.choice(_CITIES)

        def doc(i: int, who: str, where: str) -> str:
            topic = " ".join(
                prose(i * self.sentences_per_doc + j) for j in range(self.sentences_per_doc)
            )
            job = _PROFESSIONS[(i * 7 + len(who)) % len(_PROFESSIONS)]
            return (
                f"Document (Title: {who})\n{who} was born in {where} and worked as a {job}. "
                f"{topic}\n"
            )

        def filler(i: int) -> str:
            while len(people) <= i:
                other = person(sub)
                if other != name:
                    people[len(people)] = other
            return doc(i + 1, people[i], _CITIES[(i * 11 + 3) % len(_CITIES)])

        return Parts(
            instruction=(
                "Write a high-quality answer for the given question using only the provided "
                "documents (some of which might be irrelevant)."
            ),
            needles=(doc(0, name, city),),
            question=f"Question: In which city was {name} born?",
            answer_prefix=f"{name} was born in",
            references=(city,),
            filler=filler,
            separator="\n",
        )


TASKS: dict[str, type[Task]] = {
    t.name: t for t in (Passkey, NiahSingle, NiahMultiKey, NiahMultiValue, KVRetrieval, MultiDocQA)
}
QUICK_TASKS: tuple[str, ...] = ("passkey", "niah_single", "multidoc_qa")


def get_task(name: str) -> Task:
    """Instantiate a task by name (ValueError lists the valid names)."""
    try:
        return TASKS[name]()
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose from {sorted(TASKS)}") from None


# ----------------------------------------------------------------------------------------
# Prompt rendering and length fitting


def render_prompt(tokenizer: Any, user_text: str, answer_prefix: str) -> str:
    """Apply the tokenizer's chat template (if it has one) and append the answer prefix."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = f"{user_text}\n\nAnswer: "
    return text + answer_prefix


def encode(tokenizer: Any, text: str) -> list[int]:
    """Encode like ``mlx_lm.stream_generate`` does (no second BOS after a template's)."""
    bos = getattr(tokenizer, "bos_token", None)
    add_special = bos is None or not text.startswith(bos)
    return list(tokenizer.encode(text, add_special_tokens=add_special))


@dataclass
class _Fitter:
    """Fits the filler of one problem to a token budget."""

    tokenizer: Any
    parts: Parts
    depths: tuple[float, ...]
    units: list[str] = field(default_factory=list)

    def unit(self, i: int) -> str:
        """The i-th filler unit (memoized: fillers may be stateful streams)."""
        while len(self.units) <= i:
            self.units.append(self.parts.filler(len(self.units)))
        return self.units[i]

    def render(self, n_units: int) -> str:
        p = self.parts
        body = [self.unit(i) for i in range(n_units)]
        # Insert from the deepest needle so earlier insert positions stay valid.
        for depth, needle in sorted(zip(self.depths, p.needles), reverse=True):
            body.insert(round(depth * n_units), needle)
        user = f"{p.instruction}\n\n{p.separator.join(body)}\n\n{p.question}"
        return render_prompt(self.tokenizer, user, p.answer_prefix)

    def length(self, n_units: int) -> int:
        return len(encode(self.tokenizer, self.render(n_units)))

    def fit(self, target: int) -> tuple[str, list[int]]:
        """The prompt with the most filler units whose token count is ≤ ``target``."""
        base = self.length(0)
        if base > target:
            raise ValueError(
                f"prompt length {target} is too short for this task: it needs at least {base} "
                "tokens without any filler; pass a larger --lengths value"
            )
        # Estimate from per-unit token counts, then correct with exact measurements.
        empty = len(encode(self.tokenizer, ""))
        n, total = 0, base
        while True:
            cost = len(encode(self.tokenizer, self.parts.separator + self.unit(n))) - empty
            if total + cost > target:
                break
            total, n = total + cost, n + 1
        while n > 0 and self.length(n) > target:
            n -= 1
        while self.length(n + 1) <= target:
            n += 1
        text = self.render(n)
        return text, encode(self.tokenizer, text)


def sample_depths(rng: random.Random, n_needles: int, index: int,
                  n_samples: int) -> tuple[float, ...]:
    """Needle depths: the first needle spread evenly over samples, the others at random."""
    first = (index + 0.5) / max(n_samples, 1)
    rest = [rng.uniform(0.05, 0.95) for _ in range(n_needles - 1)]
    return tuple([first, *rest])


def build_samples(
    tokenizer: Any, task: str | Task, length: int, n: int, seed: int = 0
) -> list[Sample]:
    """``n`` samples of one task, each fitted to at most ``length`` prompt tokens."""
    task_obj = get_task(task) if isinstance(task, str) else task
    samples = []
    for i in range(n):
        rng = random.Random(f"mlx-lazy-bench/{seed}/{task_obj.name}/{length}/{i}")
        parts = task_obj.parts(rng)
        depths = sample_depths(rng, len(parts.needles), i, n)
        text, tokens = _Fitter(tokenizer, parts, depths).fit(length)
        samples.append(
            Sample(
                task=task_obj.name,
                index=i,
                seed=seed,
                target_tokens=length,
                prompt=text,
                tokens=tuple(tokens),
                question=parts.question,
                references=parts.references,
                match=task_obj.match,
                depths=depths,
                max_tokens=task_obj.max_tokens,
            )
        )
    return samples


def build_suite(
    tokenizer: Any, tasks: Sequence[str], lengths: Sequence[int], n: int, seed: int = 0
) -> list[Sample]:
    """All samples for every (task, length), in a stable order."""
    return [s for t in tasks for L in lengths for s in build_samples(tokenizer, t, L, n, seed)]


# ----------------------------------------------------------------------------------------
# Conversations: one document, a question per turn about a needle no earlier turn asked about


@dataclass(frozen=True)
class Conversation:
    """A document holding one magic-number needle per turn, and the turns' questions.

    ``document`` is the first user message's text before its question; turn ``i`` asks
    ``questions[i]``, the assistant's reply starts with ``answer_prefixes[i]`` and is right
    when it holds ``references[i]``.
    """

    index: int
    document: str
    questions: tuple[str, ...]
    answer_prefixes: tuple[str, ...]
    references: tuple[str, ...]
    depths: tuple[float, ...]


def build_conversations(tokenizer: Any, length: int, n: int, turns: int = 4, seed: int = 0,
                        digits: int = 7) -> list[Conversation]:
    """``n`` conversations whose first prompt is at most ``length`` tokens; needle ``i`` (asked
    in turn ``i``) sits at a random depth of the document."""
    out = []
    for i in range(n):
        rng = random.Random(f"mlx-lazy-bench/conversation/{seed}/{length}/{i}")
        keys = _distinct(rng, _word_key, turns)
        values = _distinct(rng, lambda r: _digits(r, digits), turns)
        depths = tuple(rng.uniform(0.05, 0.95) for _ in range(turns))
        questions = tuple(f"What is the special magic number for {k} mentioned in the "
                          "provided text?" for k in keys)
        prefixes = tuple(f"The special magic number for {k} mentioned in the provided text is"
                         for k in keys)
        parts = Parts(instruction=_NIAH_INSTRUCTION,
                      needles=tuple(_magic(k, v) for k, v in zip(keys, values)),
                      question=questions[0], answer_prefix=prefixes[0],
                      references=(values[0],), filler=_prose_stream(rng))
        fitter = _Fitter(tokenizer, parts, depths)
        fitter.fit(length)
        n_units = 0
        while fitter.length(n_units + 1) <= length:
            n_units += 1
        body = [fitter.unit(j) for j in range(n_units)]
        for depth, needle in sorted(zip(depths, parts.needles), reverse=True):
            body.insert(round(depth * n_units), needle)
        document = f"{parts.instruction}\n\n{parts.separator.join(body)}"
        out.append(Conversation(i, document, questions, prefixes, tuple(values), depths))
    return out

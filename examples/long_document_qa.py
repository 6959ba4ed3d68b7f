"""Answer a question about a long document with pruned prefill (mlx-lazy's Python API).

    python examples/long_document_qa.py                      # default model, built-in document
    python examples/long_document_qa.py --document report.txt --question "Who signed it?"
    python examples/long_document_qa.py --entries 120       # a 4.5K-token logbook

The built-in document is a generated logbook of fictional stations (so it is free to use
and of any length) with one fact to find; the default question asks for that fact.
"""

from __future__ import annotations

import argparse
import random

from mlx_lazy import PruningConfig, UserInputError, load, stream_generate
from mlx_lazy.cli import METHOD_HELP, method_arg

SECRET_STATION = "Station Juniper"
SECRET_CODE = "BLUE HERON"
DEFAULT_QUESTION = f"What is the password of {SECRET_STATION}? Answer with the password only."


def build_document(n_entries: int = 20, seed: int = 0) -> str:
    """A logbook of ``n_entries`` routine entries with the password of
    ``SECRET_STATION`` stated once, about two thirds of the way in."""
    rng = random.Random(seed)
    places = ["Alder", "Birch", "Cedar", "Dogwood", "Elm", "Fir", "Hazel", "Larch", "Maple",
              "Oak", "Pine", "Rowan", "Spruce", "Walnut", "Willow", "Yew"]
    weather = ["clear skies", "light rain", "a strong westerly wind", "fog until noon",
               "heavy snow", "a thunderstorm in the evening"]
    tasks = ["replaced the anemometer", "cleared the access road", "logged river levels",
             "repaired the radio mast", "counted migrating geese", "restocked the stores"]
    entries = []
    for day in range(1, n_entries + 1):
        entries.append(
            f"Day {day}. Station {rng.choice(places)} reported {rng.choice(weather)}; the crew "
            f"{rng.choice(tasks)} and {rng.choice(tasks)}. Temperature {rng.randint(-12, 24)} "
            f"degrees, visibility {rng.randint(1, 30)} km."
        )
    entries.insert(2 * n_entries // 3,
                   f"Note: the password of {SECRET_STATION} is {SECRET_CODE}. Keep it safe.")
    return "\n".join(entries)


def ask(model, tokenizer, document: str, question: str, config: PruningConfig,
        max_tokens: int) -> tuple[str, object]:
    """Answer ``question`` about ``document``; return the answer text and its GenerationStats."""
    messages = [{"role": "user", "content": f"{document}\n\n{question}"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    pieces, resp = [], None
    for resp in stream_generate(model, tokenizer, tokens, max_tokens=max_tokens, config=config):
        pieces.append(resp.text)
    return "".join(pieces).strip(), resp.stats


class Parser(argparse.ArgumentParser):
    """Bad arguments in one ``error:`` line, as the library's own tools say them."""

    def error(self, message: str) -> None:
        self.exit(2, f"error: {message}\n")


def main() -> None:
    """Parse arguments, answer the question and print the answer with pruning statistics."""
    ap = Parser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--document", default=None, help="UTF-8 text file (default: built-in logbook)")
    ap.add_argument("--question", default=DEFAULT_QUESTION)
    ap.add_argument("--method", type=method_arg, default="lazy", help=METHOD_HELP)
    ap.add_argument("--entries", type=int, default=20, help="length of the built-in document")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--compare", action=argparse.BooleanOptionalAction, default=True,
                    help="also answer without pruning (default: on)")
    args = ap.parse_args()

    # Bad input (a missing file, an unknown model) is one line, as the library's own tools say it.
    try:
        if args.document:
            with open(args.document, encoding="utf-8") as f:
                document = f.read()
        else:
            document = build_document(args.entries)
        model, tokenizer = load(args.model)
    except OSError as e:
        ap.error(f"cannot read {args.document}: {e.strerror or e}")
    except (UnicodeDecodeError, UserInputError) as e:
        ap.error(str(e))

    methods = ["full", args.method] if args.compare else [args.method]
    for method in methods:
        answer, stats = ask(model, tokenizer, document, args.question,
                            PruningConfig.preset(method), args.max_tokens)
        print(f"[{method}] {answer!r}")
        print(f"    {stats.prompt_tokens} prompt tokens, time to first token {stats.ttft_s:.2f} s, "
              f"{stats.prompt_token_layers_computed_pct:.0f}% of the prompt's token-layers "
              "computed")
    if not args.document:
        print(f"(expected: {SECRET_CODE})")


if __name__ == "__main__":
    main()

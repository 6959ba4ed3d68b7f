"""``mlx-lazy-convert``, ``python -m mlx_lazy.convert``, ``python convert/convert.py``: convert
a GGUF file, a Hugging Face/MLX folder or a hub id to an MLX model folder, or build one of the
named models (:mod:`mlx_lazy.models`) in the cache.

The conversion itself is :mod:`mlx_lazy.conversion`; its API is importable from here too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

from ._args import EXIT_BAD_INPUT, EXIT_INTERRUPTED, OneLineParser
from .conversion import (ARCHITECTURES, DEFAULT_GGUF_DTYPE, DTYPES, Q_GROUP_SIZES, convert,
                         convert_gguf, is_hub_id, read_gguf)
from .gguf_config import GEMMA2_WINDOW
from .models import DEFAULT_MODEL, MODELS, model_path
from .errors import UserInputError, one_line

__all__ = ["DEFAULT_GGUF_DTYPE", "DTYPES", "convert", "convert_gguf", "is_hub_id", "main",
           "read_gguf"]


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (``mlx-lazy-convert``, ``python convert/convert.py``): 0 on
    success, 2 on bad input (one ``error:`` line; a usage error exits with it), 130 after
    Ctrl-C (one ``interrupted`` line, nothing left behind)."""
    p = OneLineParser(
        prog="mlx-lazy-convert",
        description="Convert a GGUF file (architectures " + ", ".join(ARCHITECTURES)
                    + "), a Hugging Face/MLX folder or a hub id to an MLX model folder.")
    p.add_argument("source", nargs="?", help="GGUF file, model folder or hub id")
    p.add_argument("output", nargs="?", help="output folder (must not exist)")
    p.add_argument("--q-bits", type=int, choices=(4, 8), help="quantize to 4 or 8 bits")
    p.add_argument("--q-group-size", type=int,
                   help=f"quantization group size: {', '.join(map(str, Q_GROUP_SIZES))} "
                        "(default 64)")
    p.add_argument("--dtype", choices=DTYPES,
                   help="dtype of float weights; for GGUF, every tensor dequantized to it "
                        f"(default: Q4_0/Q4_1/Q8_0/MXFP4 kept quantized, the rest "
                        f"{DEFAULT_GGUF_DTYPE}; with --q-bits, the dtype before quantizing)")
    p.add_argument("--dequantize", action="store_true", help="dequantize a quantized model")
    named = p.add_mutually_exclusive_group()
    named.add_argument("--model", choices=sorted(MODELS),
                       help="build (or find) this named model in the cache and print its "
                            "folder")
    named.add_argument("--default", action="store_const", const=DEFAULT_MODEL, dest="model",
                       help=f"same as --model {DEFAULT_MODEL}")
    p.add_argument("--default-quantized", "--quantized", action="store_true",
                   dest="quantized", help="with --model/--default: the quantized copy (for "
                                          "Metal) instead of float32")
    args = p.parse_args(argv)
    converting = {"source": args.source, "output": args.output, "--q-bits": args.q_bits,
                  "--q-group-size": args.q_group_size, "--dtype": args.dtype,
                  "--dequantize": args.dequantize or None}
    given = [name for name, value in converting.items() if value is not None]
    if args.model and given:
        p.error(f"{', '.join(given)} cannot go with --model/--default (they build a named "
                "model as listed; convert its folder for another dtype or quantization)")
    if args.quantized and not args.model:
        p.error("--quantized goes with --model/--default")
    if not args.model and not (args.source and args.output):
        p.error("source and output are required (or use --model NAME)")
    try:
        if args.model:
            print(model_path(args.model, quantized=args.quantized))
            return 0
        out = convert(args.source, args.output, q_bits=args.q_bits,
                      q_group_size=args.q_group_size, dtype=args.dtype,
                      dequantize=args.dequantize)
    except UserInputError as e:
        print(f"error: {one_line(e, limit=1000)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # the temporary folder is already gone (atomic_dir)
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"wrote {out}")
    config = json.loads((Path(out) / "config.json").read_text())
    if "quantization" in config and not mx.metal.is_available():
        print("note: quantized weights run far slower than float32 on MLX's CPU backend (no "
              "BLAS: about 30x, SmolLM2's first token); for this machine convert with "
              "--dtype float32", file=sys.stderr)
    if config.get("model_type") == "gemma2":
        window = config.get("sliding_window", GEMMA2_WINDOW)
        print(f"note: mlx-lm's gemma2 attends over every token in every layer, Gemma 2's every "
              f"other layer (llama.cpp's too) over the last {window}: the same outputs for "
              f"contexts up to {window} tokens, not beyond", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

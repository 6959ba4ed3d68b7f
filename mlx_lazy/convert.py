"""``mlx-lazy-convert``, ``python -m mlx_lazy.convert``, ``python convert/convert.py``: convert
a GGUF file, a Hugging Face/MLX folder or a hub id to an MLX model folder, or build one of the
named models (:mod:`mlx_lazy.models`) in the cache.

The conversion itself is :mod:`mlx_lazy.conversion`; its API is importable from here too.
"""

from __future__ import annotations

import argparse
import signal
import sys

from .conversion import (DEFAULT_GGUF_DTYPE, DTYPES, convert, convert_gguf, is_hub_id,
                         read_gguf)
from .models import DEFAULT_MODEL, MODELS, model_path
from .errors import UserInputError, one_line

__all__ = ["DEFAULT_GGUF_DTYPE", "DTYPES", "convert", "convert_gguf", "is_hub_id", "main",
           "read_gguf"]


def main(argv: list[str] | None = None) -> int:
    """Command line entry point (``mlx-lazy-convert``, ``python convert/convert.py``): 0 on
    success, 2 on bad input (one ``error:`` line), 130 after Ctrl-C (one ``interrupted`` line,
    nothing left behind)."""
    p = argparse.ArgumentParser(
        prog="mlx-lazy-convert",
        description="Convert a GGUF file (llama, qwen2, qwen3), a Hugging Face/MLX folder or "
                    "a hub id to an MLX model folder.")
    p.add_argument("source", nargs="?", help="GGUF file, model folder or hub id")
    p.add_argument("output", nargs="?", help="output folder (must not exist)")
    p.add_argument("--q-bits", type=int, choices=(4, 8), help="quantize to 4 or 8 bits")
    p.add_argument("--q-group-size", type=int, help="quantization group size")
    p.add_argument("--dtype", choices=DTYPES,
                   help="dtype of float weights (for GGUF: dequantize everything to it)")
    p.add_argument("--dequantize", action="store_true", help="dequantize a quantized model")
    p.add_argument("--model", choices=sorted(MODELS),
                   help="build (or find) this named model in the cache and print its folder")
    p.add_argument("--default", action="store_const", const=DEFAULT_MODEL, dest="model",
                   help=f"same as --model {DEFAULT_MODEL}")
    p.add_argument("--default-quantized", "--quantized", action="store_true",
                   dest="quantized", help="with --model/--default: the quantized copy (for "
                                          "Metal) instead of float32")
    args = p.parse_args(argv)
    try:
        if args.model:
            print(model_path(args.model, quantized=args.quantized))
            return 0
        if not args.source or not args.output:
            p.print_usage(sys.stderr)
            print("error: source and output are required (or use --model NAME)",
                  file=sys.stderr)
            return 2
        out = convert(args.source, args.output, q_bits=args.q_bits,
                      q_group_size=args.q_group_size, dtype=args.dtype,
                      dequantize=args.dequantize)
    except UserInputError as e:
        print(f"error: {one_line(e, limit=1000)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the temporary folder is already gone (atomic_dir)
        print("interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

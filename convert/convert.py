"""Convert a GGUF (llama), Hugging Face/MLX folder or hub id to an MLX model folder.

    python convert/convert.py model.gguf out_folder [--dtype float32]
    python convert/convert.py HuggingFaceTB/SmolLM2-135M-Instruct out_folder --q-bits 4
    python convert/convert.py --default            # build/find the default SmolLM2 model

Same as the installed ``mlx-lazy-convert`` command (mlx_lazy.convert); the conversion itself is
mlx_lazy.conversion.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from mlx_lazy.convert import main  # noqa: E402  (mlx_lazy loads OpenBLAS before mlx)

if __name__ == "__main__":
    sys.exit(main())

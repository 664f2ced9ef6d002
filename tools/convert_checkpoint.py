"""Convert checkpoints between HF safetensors and megatron-core torch_dist, or verify a conversion:
`python -m tools.convert_checkpoint hf-to-megatron | megatron-to-hf | verify ...`, the same as
`megarl convert ...` (megarl/convert/cli.py has the options)."""

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.convert_checkpoint`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not tools/
    __import__("tools").run_as_module(__file__)

import sys

from megarl.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())

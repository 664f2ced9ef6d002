"""Convert checkpoints between HF safetensors and megatron-core torch_dist, or verify a conversion:
`python -m tools.convert_checkpoint hf-to-megatron | megatron-to-hf | verify ...`, the same as
`megarl convert ...` (megarl/convert/cli.py has the options)."""

import sys

from megarl.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""The checks of tools/gpu_smoke.py that live in modules of their own."""

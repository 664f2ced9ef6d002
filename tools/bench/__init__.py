"""Benchmarks and the lent-GPU session: `python -m tools.bench.<name>`, `bash tools/bench/gpu_session.sh`."""

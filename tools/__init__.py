"""megarl's tools, run as modules from the repository root (`python -m tools.<name>`): the user
tools at this level, benchmarks in `tools.bench`, research probes in `tools.research`, and
gpu_smoke's checks in `tools.smoke`."""

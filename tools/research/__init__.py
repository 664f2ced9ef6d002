"""Research probes, ablations and simulators behind the studies in docs/results.md and docs/tppo.md: `python -m tools.research.<name>`."""

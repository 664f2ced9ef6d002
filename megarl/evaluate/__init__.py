"""megarl.evaluate: `megarl eval`, a model on eval sets outside training (cli), and the set
statistics it prints (scores: avg@n, pass@k, maj@n)."""

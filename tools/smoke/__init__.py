"""The checks of tools/gpu_smoke.py that live in modules of their own."""


def randomize_(model, seed: int) -> None:
    """Gives a freshly built model weights far from its init (norms in [0.5, 1.5), the rest N(0, 0.1^2),
    biases N(0, 0.05^2)), so a wrong weight mapping or kernel shows in the logits."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() > 1 else 0.05))

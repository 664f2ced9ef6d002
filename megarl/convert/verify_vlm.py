"""`tools/convert_checkpoint.py verify` for vision-language models: random images + random text
through HF transformers and the Megatron model, max |logit difference|.

The batch (`random_vlm_batch`): `batch` rows, each holding 1-2 images of random grids t = 1,
h, w in {m, 2m, ..., 2 W m} patches (m = spatial merge size, W = merged tokens a window side, so
windows are cut at the edges; W = 2 for towers without windows), framed by vision start / end
tokens, between random text tokens, rows of `seq` text tokens plus the images' placeholders, topped
up with text to one length.
pixel_values are standard-normal patch rows of HF's processor layout ([N, C*tp*p*p], what its
normalisation produces), so no image processor config is needed.
"""

from __future__ import annotations

import torch


def random_vlm_batch(hf_config, spec, batch: int, seq: int, seed: int):
    """(input_ids [b, s], pixel_values [N, patch_dim], image_grid_thw [n, 3], mm_token_type_ids)."""
    v = spec.vision
    gen = torch.Generator().manual_seed(seed)
    m = v.spatial_merge_size
    win = max(1, getattr(v, "window_size", 2 * m * v.patch_size) // m // v.patch_size)
    specials = {v.image_token_id, v.video_token_id, getattr(hf_config, "vision_start_token_id", -1),
                getattr(hf_config, "vision_end_token_id", -1)}
    allowed = torch.tensor([i for i in range(spec.vocab_size) if i not in specials])

    def text(n: int) -> list[int]:
        return allowed[torch.randint(0, len(allowed), (n,), generator=gen)].tolist()

    rows, grids = [], []
    for _ in range(batch):
        row = text(max(1, seq // 3))
        for _ in range(int(torch.randint(1, 3, (1,), generator=gen))):
            h, w = (int(x) * m for x in torch.randint(1, 2 * win + 1, (2,), generator=gen))
            grids.append((1, h, w))
            row += [getattr(hf_config, "vision_start_token_id", allowed[0].item())]
            row += [v.image_token_id] * (h * w // m**2)
            row += [getattr(hf_config, "vision_end_token_id", allowed[0].item())] + text(max(1, seq // 3))
        rows.append(row)
    length = max(len(r) for r in rows) + 1
    ids = torch.tensor([r + text(length - len(r)) for r in rows])
    grid = torch.tensor(grids)
    pixel_values = torch.randn(int(grid.prod(-1).sum()), v.patch_dim, generator=gen)
    return ids, pixel_values, grid, (ids == v.image_token_id).int()


def verify_vlm(args, hf_config, dtype, rank: int) -> int:
    """Runs the comparison at the current layout; prints `max_abs_logit_diff=<float>` on rank 0;
    returns 1 above args.tol (every rank), else 0."""
    import torch.distributed as dist
    import transformers

    from megarl.models import build_model
    from megarl.models.families import arch_spec
    from megarl.models.vision.forward import vlm_forward_logits
    from megarl.parallel.distributed import device
    from megarl.weights import load_hf_weights

    spec = arch_spec(hf_config)
    ids, pv, grid, mm = random_vlm_batch(hf_config, spec, args.batch, args.seq, args.seed)
    model = build_model(hf_config, dtype=dtype, impl=args.impl)
    load_hf_weights(model, args.hf)
    out = vlm_forward_logits(model, ids, pv.to(dtype), grid)
    stats = torch.zeros(1, device=device())
    if rank == 0:
        hf = transformers.AutoModelForImageTextToText.from_pretrained(args.hf, dtype=dtype).eval()
        with torch.no_grad():
            ref = hf(input_ids=ids, pixel_values=pv.to(dtype), image_grid_thw=grid, mm_token_type_ids=mm).logits
        stats[0] = float((out - ref.float()).abs().max())
    if dist.get_world_size() > 1:
        dist.broadcast(stats, src=0)
    if rank == 0:
        print(f"images={grid.tolist()} tokens={list(ids.shape)}", flush=True)
        print(f"max_abs_logit_diff={stats[0].item():.6e}", flush=True)
    return 1 if float(stats[0]) > args.tol else 0

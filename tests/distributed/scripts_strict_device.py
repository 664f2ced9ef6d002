"""Worker for tests/distributed/test_strict_device.py: one process under strict device mode, the
tiny model at --root/model.

Each case runs a piece of code the way a GPU run would see it and records the error (or None).
"""

import random

import torch
import torch.distributed as dist

from megarl.parallel import cpu_runtime, strict_device
from megarl.parallel.distributed import ParallelSizes, device, init_distributed
from tests.distributed.harness import finish, parse_args, train_model


def error_of(fn) -> str | None:
    try:
        fn()
    except strict_device.DeviceMismatchError as e:
        return str(e)
    return None


def entropy_and_whitening(cfg, batch, dp) -> dict:
    """The entropy metric follows algorithm.loss_agg; GAE whitening takes its moments over the
    policy-loss tokens only (overlong-filtered samples left out)."""
    import dataclasses

    from megarl.trainer import rl
    from megarl.trainer.batch import build_microbatch

    seq_cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, loss_agg="seq-mean-token-mean"))
    mb = build_microbatch(batch, list(range(len(batch)))).to(device())
    # 128 columns: every token id of the batch (< 100) is a class of the vocabulary
    logits = torch.randn(*mb.input_ids.shape, 128, generator=torch.Generator().manual_seed(2)).to(device())
    counts = rl.global_counts(batch, list(range(len(batch))), dp, batch.loss_mask)
    _, logs = rl.actor_loss_fn(seq_cfg, counts, 1.0)(mb, logits)
    ent = torch.distributions.Categorical(logits=logits.cpu().reshape(-1, 128)).entropy()
    per_tok = ent.reshape(-1)[mb.resp_index.cpu()] * batch.response_mask
    m = batch.loss_mask
    expected_seq_mean = float(((per_tok * m).sum(-1) / m.sum(-1)).mean())

    gae_cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(
        cfg.algorithm, advantage="gae", whiten_advantages=True, overlong_filter=True))
    batch.finish_reason[0] = "length"  # overlong-filtered
    rl.set_masks(batch, gae_cfg)
    batch.values = torch.zeros_like(batch.response_mask)
    batch.score = torch.tensor([100.0, 1.0, -1.0, 0.5])  # the filtered sample's huge reward must not skew the moments
    rows = list(range(len(batch)))
    local = batch.select(rows)
    rl.compute_advantages(batch, local, rows, gae_cfg, dp, 0.0)
    a, lm = local.advantages, local.loss_mask
    mean = float((a * lm).sum() / lm.sum())
    var = float((((a - mean) * lm) ** 2).sum() / (lm.sum() - 1))
    return {"entropy_seq_mean": float(logs["actor/entropy"]), "entropy_seq_mean_expected": expected_seq_mean,
            "whitened_mean": mean, "whitened_var": var}


def main(root, out: str) -> None:
    from megatron.core import parallel_state as ps

    from megarl.config import load_config
    from megarl.trainer import rl
    from megarl.trainer.batch import StepBatch, Trajectory, build_microbatch
    from megarl.trainer.build import load_hf_config_and_tokenizer
    from megarl.models.attention import thd_params
    from megarl.trainer.train_model import TrainModel
    from megarl.weights import stream_hf_weights

    model_dir = str(root / "model")
    cpu_runtime.activate(strict=True)
    init_distributed(ParallelSizes(), seed=0)
    cfg = load_config("configs/algorithms/ppo.yaml", [
        f"model.hf_path={model_dir}", "model.dtype=fp32", "actor.max_tokens_per_microbatch=64",
        "rollout.max_new_tokens=12", "data.max_prompt_len=32"])
    hf_config, _ = load_hf_config_and_tokenizer(model_dir)
    model = train_model(hf_config, cfg.actor, model_dir)
    rng = random.Random(0)
    trajs = []
    for i in range(4):
        r = [rng.randrange(3, 100) for _ in range(rng.randint(2, 6))]
        trajs.append(Trajectory(str(i // 2), [rng.randrange(3, 100) for _ in range(4)], r, [0.0] * len(r), "stop"))
    batch = StepBatch.from_trajectories(trajs)
    rl.set_masks(batch, cfg)
    mb = build_microbatch(batch, [0, 1, 2, 3])
    thd = thd_params(mb.cu_seqlens.to(device()))
    gpt = model.modules[0]
    dp = ps.get_data_parallel_group()
    res = {
        "params_on_device": all(strict_device.on_device(p) for p in gpt.parameters()),
        # defect 1 as it was: host micro-batch tensors into the model on the GPU
        "host_microbatch_into_model": error_of(lambda: gpt(mb.input_ids, mb.position_ids, None, packed_seq_params=thd)),
        "device_microbatch_into_model": error_of(
            lambda: gpt(*(t.to(device()) for t in (mb.input_ids, mb.position_ids)), None, packed_seq_params=thd)),
        # defect 2 as it was: host tensors in collectives of NCCL groups (metric / count reductions)
        "host_tensor_dp_all_reduce": error_of(lambda: dist.all_reduce(torch.zeros(2, dtype=torch.float64), group=dp)),
        "device_tensor_dp_all_reduce": error_of(lambda: dist.all_reduce(torch.zeros(2, device=device()), group=dp)),
        "host_tensor_gloo_group": error_of(lambda: dist.all_reduce(torch.zeros(2), group=dist.new_group([0], backend="gloo"))),
        "numpy_of_device_tensor": error_of(lambda: torch.ones(2, device=device()).numpy()),
        "loss_with_host_mask": error_of(lambda: (torch.ones(2, 3, device=device()) * torch.ones(2, 3)).sum()),
    }
    # the real code path: prepare, one train step, one weight stream, all on the device
    batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)
    batch.advantages = torch.linspace(-1, 1, batch.response_mask.numel()).reshape(batch.response_mask.shape)
    counts = rl.global_counts(batch, [0, 1, 2, 3], dp, batch.loss_mask)
    metrics = model.train_step(batch, rl.actor_loss_fn(cfg, counts, 1.0))
    res["train_step_grad_norm"] = metrics["grad_norm"]
    streamed = [t for bucket in stream_hf_weights(model.modules, hf_config, 1 << 20) for _, t in bucket]
    res["streamed_tensors"] = len(streamed)
    res["streamed_on_device"] = all(strict_device.on_device(t) for t in streamed)
    res["logprobs_on_host"] = not strict_device.on_device(batch.old_logprobs)
    res.update(entropy_and_whitening(cfg, batch, dp))
    # fp16: the schedules must scale the loss by the optimizer's dynamic loss scale before backward
    fp16 = TrainModel(hf_config, cfg.actor, dtype="fp16")
    res["fp16_scales_loss"] = fp16.config.grad_scale_func == fp16.optimizer.scale_loss
    res["fp16_loss_scale"] = float(fp16.optimizer.get_loss_scale())
    finish(out, res)


if __name__ == "__main__":
    args = parse_args()
    main(args.root, args.out)

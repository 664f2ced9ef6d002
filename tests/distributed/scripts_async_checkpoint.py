"""Worker for tests/distributed/test_async_checkpoint.py (2 gloo ranks, DP=2, distributed
optimizer): megatron dist_checkpointing's async save through megarl.trainer.checkpoint on CPU.

1. sync save of step 1 -> `latest` = step_1.
2. async save of step 2, then a training step before finalising: `latest` still names step_1
   and step_2 has no torch_dist metadata until `finalize_async_saves`; afterwards `latest` =
   step_2, which is complete and loads into a fresh model with the parameters and optimizer
   state of save time (not those of the later step).
3. async save of step 3 whose writer processes are SIGKILLed on every rank right after they
   start: finalising either raises (the writes died; `latest` stays step_2) or, when the
   writers had already finished, succeeds with a complete step_3. Which of the two happened is
   reported; both keep `latest` on a complete checkpoint.
"""

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megarl.parallel.distributed import ParallelSizes, init_distributed
from megarl.trainer import checkpoint, rl
from megarl.trainer.build import load_hf_config_and_tokenizer
from megarl.trainer.train_model import TrainModel
from tests.distributed.harness import finish, gather, parse_args, train_model
from tests.distributed.scripts_trainer import fixed_batch, train_two_steps


def snapshot(model: TrainModel) -> dict:
    params = {n: p.detach().clone() for n, p in model.modules[0].named_parameters()}
    inner = [o.optimizer for o in getattr(model.optimizer, "chained_optimizers", [model.optimizer])]
    opt = [{k: t.detach().clone() for k, t in o.state.get(p, {}).items() if torch.is_tensor(t)}
           for o in inner for g in o.param_groups for p in g["params"]]
    return {"params": params, "optim": opt}


def same(a: dict, b: dict) -> bool:
    return (a["params"].keys() == b["params"].keys() and all(torch.equal(a["params"][k], b["params"][k])
                                                             for k in a["params"])
            and len(a["optim"]) == len(b["optim"])
            and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                    for x, y in zip(a["optim"], b["optim"])))


def main():
    a = parse_args(config=True)
    run, cfg = a.root / "run", a.cfg
    init_distributed(ParallelSizes(tp=1), seed=0)
    hf_config, _ = load_hf_config_and_tokenizer(cfg.model.hf_path)

    def fresh() -> TrainModel:
        m = train_model(hf_config, cfg.actor, cfg.model.hf_path)
        m.hf_source_dir = cfg.model.hf_path
        return m

    model = fresh()
    batch = fixed_batch(hf_config.vocab_size, cfg)
    batch.old_logprobs = rl.compute_log_probs(model, batch, 1.0)
    state = {"step": 0}
    res = {}

    train_two_steps(model, cfg, batch)
    checkpoint.save_checkpoint(run, 1, {"actor": model}, state, keep_last=None)
    res["latest_after_sync"] = checkpoint.read_latest(run).name
    train_two_steps(model, cfg, batch)
    at_save = snapshot(model)
    checkpoint.save_checkpoint(run, 2, {"actor": model}, state, keep_last=None, async_save=True)
    res["latest_before_finalize"] = checkpoint.read_latest(run).name
    res["metadata_before_finalize"] = (checkpoint.step_dir(run, 2) / "actor" / "model" / "metadata.json").exists()
    train_two_steps(model, cfg, batch)  # training goes on while the writers run
    res["changed_after_save"] = not same(at_save, snapshot(model))
    checkpoint.finalize_async_saves(blocking=True)
    res["latest_after_finalize"] = checkpoint.read_latest(run).name
    res["step2_problems"] = checkpoint.checkpoint_problems(checkpoint.step_dir(run, 2))
    loaded = fresh()
    loaded.load(str(checkpoint.step_dir(run, 2) / "actor"))
    res["loaded_equals_save_time"] = same(at_save, snapshot(loaded))

    checkpoint.save_checkpoint(run, 3, {"actor": model}, state, keep_last=None, async_save=True)
    writers = [c.async_caller.process for c in checkpoint._ASYNC_QUEUE.async_calls]
    for w in writers:
        if w is not None:  # None: nothing of this request to write on this rank
            w.kill()
    try:
        checkpoint.finalize_async_saves(blocking=True)
        res["kill_outcome"] = "finished before the kill"
    except CheckpointException as e:  # a BaseException: the writers' results are missing
        res["kill_outcome"], res["kill_error"] = f"finalize raised {type(e).__name__}", str(e)[:300]
    latest = checkpoint.read_latest(run)
    res["latest_after_kill"] = latest.name
    res["latest_problems_after_kill"] = checkpoint.checkpoint_problems(latest)
    res["step3_problems"] = checkpoint.checkpoint_problems(checkpoint.step_dir(run, 3))
    res["kill_outcomes"] = gather(res["kill_outcome"])
    finish(a.out, res)


if __name__ == "__main__":
    main()

"""Code PRM in the trainer (docs/algorithms.md §10; the formulas in megarl.algorithms.prm): labelling by
binary search with the policy's own completions, PRM training, and the PRM's dense line rewards
during RL.

    ensure_prm(cfg, run_dir)     # label + train + save a PRM at prm.path unless one is there
    PrmScorer(cfg, hf_config, tokenizer).dense_rewards(batch)   # [B, T] line rewards (RL prepare)

Labelling (every rank, collectively; the ranks split the prompts and gather the labelled rows):
the policy (model.load, the SFT actor in the quickstart) samples prm.label_samples responses for
each of the first prm.label_prompts training prompts; the reward manager scores them (the code
reward runs the program in the sandbox). Every failing response runs a binary search
(megarl.algorithms.prm.binary_search_steps); the searches advance in lockstep, so each round is
one engine call with prm.label_k completions per open prefix (prompt + response through line j)
and one reward call over the distinct completed programs. A prefix passes when any completion
passes.

PRM model and loss: a PRM is a critic trained on line-end targets: the critic architecture (the
policy's backbone copied, a fresh scalar head: build.build_critic), trained with the critic's
optimizer settings (critic.lr, ...) for prm.train_steps steps of prm.batch_size labelled
responses on MSE at the line-end states (view index e_j + 1) against the 0/1 line labels. 20% of
the labelled responses are held out for the fit statistics written to <prm.path>/prm_stats.json.
The checkpoint is a critic checkpoint: the RL critic loads it as its initial weights with
prm.init_critic (the [NS→C] weight copy of the PRM's backbone + head into the critic).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.config import MegaRLConfig
from megarl.algorithms import prm as P
from megarl.data.sampler import shard_for_rank
from megarl.rollout import SamplingParams
from megarl.trainer import build, rl
from megarl.trainer.batch import MicroBatch, StepBatch, Trajectory
from megarl.parallel import exchange

log = logging.getLogger(__name__)

PRM_DONE = "prm_done.json"  # written last: the PRM checkpoint at prm.path is complete
HOLDOUT_FRAC = 0.2


def newline_token_ids(tokenizer) -> frozenset[int]:
    """Vocabulary ids whose text contains a newline (the line-end tokens)."""
    return frozenset(i for i in range(len(tokenizer)) if "\n" in tokenizer.decode([i]))


# ---- labelling --------------------------------------------------------------------------------
def _reward_inputs(item, texts: list[str]):
    from megarl.rewards import RewardInput

    return [RewardInput(data_source=item.data_source, prompt=item.prompt, response=t, gold=item.answer,
                        reference=item.reference, extra=item.extra) for t in texts]


def _passes(rewards, jobs: list[tuple[object, str]], cache: dict) -> list[bool]:
    """acc of each (item, response text), scoring each distinct pair once."""
    todo = list({(item.uid, text): (item, text) for item, text in jobs if (item.uid, text) not in cache}.items())
    if todo:
        inputs = [x for _, (item, text) in todo for x in _reward_inputs(item, [text])]
        outputs, _ = rewards.score(inputs)
        for (key, _), out in zip(todo, outputs):
            cache[key] = bool(out.acc)
    return [cache[(item.uid, text)] for item, text in jobs]


def label_local(engine, tokenizer, rewards, items, prompt_ids, cfg: MegaRLConfig, seed: int) -> tuple[list[dict], dict]:
    """Samples, scores and labels this rank's responses (see the module doc). Returns rows
    {prompt_ids, response_ids, line_ends, labels, passed, first_bad} and counts."""
    p, ro = cfg.prm, cfg.rollout
    sampling = SamplingParams(n=p.label_samples, temperature=ro.temperature, top_p=ro.top_p,
                              max_new_tokens=ro.max_new_tokens, seed=seed)
    samples = engine.generate(prompt_ids, sampling) if items else []
    cache: dict = {}
    texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
    passed = _passes(rewards, [(items[s.index], t) for s, t in zip(samples, texts)], cache)
    rows, searches = [], {}
    for k, (s, ok) in enumerate(zip(samples, passed)):
        ends = P.line_end_indices([tokenizer.decode([t]) for t in s.response_ids])
        rows.append({"prompt_ids": list(s.prompt_ids), "response_ids": list(s.response_ids), "line_ends": ends,
                     "passed": ok, "first_bad": None, "item": s.index})
        if not ok and ends:
            searches[k] = P.binary_search_steps(len(ends))
    stats = {"responses": len(rows), "passed": sum(passed), "oracle_calls": 0, "completions": 0, "rounds": 0,
             "searched": len(searches), "max_oracle_calls": sum(math.ceil(math.log2(len(rows[k]["line_ends"])))
                                                                for k in searches)}
    open_queries = {}
    for k, search in list(searches.items()):
        _advance(rows[k], search, None, open_queries, k, searches)
    while open_queries:
        stats["rounds"] += 1
        keys = sorted(open_queries)
        prefixes = [rows[k]["prompt_ids"] + rows[k]["response_ids"][: rows[k]["line_ends"][open_queries[k] - 1] + 1]
                    for k in keys]
        comp = engine.generate(prefixes, SamplingParams(**{**sampling.__dict__, "n": p.label_k,
                                                           "seed": seed + 7919 * stats["rounds"]}))
        stats["oracle_calls"] += len(keys)
        stats["completions"] += len(comp)
        jobs = []
        for c in comp:
            row = rows[keys[c.index]]
            head = row["response_ids"][: row["line_ends"][open_queries[keys[c.index]] - 1] + 1]
            jobs.append((items[row["item"]], tokenizer.decode(head + list(c.response_ids), skip_special_tokens=True)))
        ok = _passes(rewards, jobs, cache)
        answers = {k: any(ok[i * p.label_k:(i + 1) * p.label_k]) for i, k in enumerate(keys)}
        open_queries = {}
        for k in keys:
            _advance(rows[k], searches[k], answers[k], open_queries, k, searches)
    for row in rows:
        row["labels"] = P.line_labels(len(row["line_ends"]), row["first_bad"]) if row["line_ends"] else []
        del row["item"]
    return rows, stats


def _advance(row, search, answer, open_queries, k, searches) -> None:
    try:
        open_queries[k] = next(search) if answer is None else search.send(answer)
    except StopIteration as done:
        row["first_bad"] = done.value
        del searches[k]


def label_with_policy(cfg: MegaRLConfig, actor, hf_config, tokenizer) -> tuple[list[dict], dict]:
    """Every rank: the engine gets the actor's weights, the ranks label their share of the first
    prm.label_prompts training prompts, and all rows and counts are gathered (rank order)."""
    from megarl.data.dataset import load_prompt_dataset, tokenize_dataset
    from megarl.weights import stream_hf_weights

    d = cfg.data
    ds = load_prompt_dataset(d.train_path, prompt_key=d.prompt_key, answer_key=d.answer_key, source_key=d.source_key,
                             default_source=d.default_data_source, reference_key=d.reference_key)
    ds = tokenize_dataset(ds, tokenizer, template=d.prompt_template, max_prompt_len=d.max_prompt_len,
                          apply_chat_template=d.apply_chat_template)
    items = list(ds.items)[: cfg.prm.label_prompts]
    engine = build.build_engine(cfg, hf_config, tokenizer)
    engine.update_weights(stream_hf_weights(actor.modules, hf_config, cfg.rollout.weight_bucket_mb << 20))
    rewards = build.build_rewards(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = shard_for_rank(items, rank, world)
    rows, stats = label_local(engine, tokenizer, rewards, mine, [list(it.prompt_ids) for it in mine], cfg,
                              seed=cfg.trainer.seed * 1009 + rank)
    rewards.close()
    del engine
    all_rows = [r for part in exchange.all_gather_objects(rows, "prm_labels") for r in part]
    totals: dict = {}
    for s in exchange.all_gather_objects(stats, "prm_labels"):
        for key, v in s.items():
            totals[key] = totals.get(key, 0) + v
    return all_rows, totals


# ---- training -------------------------------------------------------------------------------
def rows_batch(rows: list[dict]) -> StepBatch:
    """A StepBatch of labelled rows with returns = PRM targets and value_mask = their positions."""
    batch = StepBatch.from_trajectories([Trajectory(str(i), r["prompt_ids"], r["response_ids"], [], "stop")
                                         for i, r in enumerate(rows)])
    tm = [P.prm_targets(r["line_ends"], r["labels"], len(r["response_ids"]), batch.width) for r in rows]
    batch.returns = torch.stack([t for t, _ in tm])
    batch.value_mask = torch.stack([m for _, m in tm])
    return batch


def mse_loss_fn(counts: dict[str, float]):
    """Token-mean squared error at the line-end states over the global mini-batch."""
    def loss_fn(mb: MicroBatch, values):
        d = mb.data
        sq = (mb.values(values) - d.returns) ** 2 * d.value_mask
        loss = sq.sum() / counts["tokens"]
        return loss, {"prm/mse": loss.detach()}
    return loss_fn


def fit_stats(model, rows: list[dict]) -> dict[str, float]:
    """MSE and accuracy (prediction > 0.5 vs label) at the labelled line ends; collective."""
    if not rows:
        return {"lines": 0}
    batch = rows_batch(rows)
    v = rl.compute_values(model, batch)
    m = batch.value_mask.bool()
    pred, y = v[m], batch.returns[m]
    return {"lines": int(m.sum()), "mse": float(((pred - y) ** 2).mean()),
            "accuracy": float(((pred > 0.5).float() == y).float().mean()), "label_mean": float(y.mean()),
            "mse_of_constant": float(((y.mean() - y) ** 2).mean())}


def train_prm(cfg: MegaRLConfig, hf_config, actor, rows: list[dict], save_to: Path) -> dict:
    """Trains a PRM from the actor's backbone on labelled rows, saves it (model only) at
    `save_to`; returns fit statistics. Every rank, same rows."""
    from megatron.core import parallel_state as ps

    p = cfg.prm
    pcfg = copy.deepcopy(cfg)
    pcfg.model.critic_load, pcfg.critic.init_from, pcfg.prm.init_critic = None, "actor", False
    pcfg.trainer.total_steps = p.train_steps
    model = build.build_critic(pcfg, hf_config, actor)
    usable = [r for r in rows if r["line_ends"]]
    order = list(range(len(usable)))
    random.Random(cfg.trainer.seed).shuffle(order)
    n_hold = int(len(order) * HOLDOUT_FRAC)
    held, train = [usable[i] for i in order[:n_hold]], [usable[i] for i in order[n_hold:]]
    if not train:
        raise ValueError("prm: no labelled response with a complete line to train on; raise prm.label_prompts")
    dp_group, dp_rank, dp_size = ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    rng, queue, mse = random.Random(cfg.trainer.seed + 1), [], []
    stats = {"before": {"train": fit_stats(model, train), "heldout": fit_stats(model, held)}}
    for step in range(p.train_steps):
        if len(queue) < p.batch_size:
            fresh = list(range(len(train)))
            rng.shuffle(fresh)
            queue += fresh
        batch = rows_batch([train[i] for i in queue[: p.batch_size]])
        del queue[: p.batch_size]
        local = rl.split_minibatches(batch.lengths, len(batch), step, dp_rank, dp_size)[0]
        counts = rl.global_counts(batch, local, dp_group, batch.value_mask)
        model.set_lr(step)
        mse.append(model.train_step(batch, mse_loss_fn(counts), local)["prm/mse"])
    stats["after"] = {"train": fit_stats(model, train), "heldout": fit_stats(model, held)}
    stats.update(train_rows=len(train), heldout_rows=len(held), steps=p.train_steps,
                 first_step_mse=mse[0] if mse else None, last_step_mse=mse[-1] if mse else None)
    model.optimizer = None
    model.save(str(save_to))
    return stats


def ensure_prm(cfg: MegaRLConfig, run_dir: Path | None = None) -> dict | None:
    """With prm.dense_reward or prm.init_critic: labels and trains a PRM from the policy at
    model.load and saves it at prm.path, unless a complete one is there. Every rank. Returns the
    statistics (labels, fit, wall time, the policy's path), also in <prm.path>/prm_stats.json. A
    complete PRM labelled from another policy (another run's SFT) is refused with a clear error
    rather than reused."""
    p = cfg.prm
    if not (p.dense_reward or p.init_critic):
        return None
    out = build.prm_dir(cfg)
    policy = str(Path(cfg.model.load).resolve()) if cfg.model.load else None
    if (out / PRM_DONE).exists():
        done = json.loads((out / PRM_DONE).read_text())
        if done.get("policy", policy) != policy:  # a PRM labelled from another policy's samples
            raise ValueError(f"prm.path: {out} holds a PRM labelled from the policy at {done['policy']}, not this "
                             f"run's model.load {policy}; set prm.path to a new dir (or delete that one)")
        return done
    t0 = time.perf_counter()
    rank0 = dist.get_rank() == 0
    partial = out.with_name(out.name + ".partial")
    if rank0:
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    hf_config, tokenizer = build.load_hf_config_and_tokenizer(cfg.model.hf_path)
    actor = build.build_actor(cfg, hf_config, optim=False)
    rows, label_stats = label_with_policy(cfg, actor, hf_config, tokenizer)
    label_stats["lines"] = sum(len(r["labels"]) for r in rows)
    label_stats["positive_lines"] = sum(sum(r["labels"]) for r in rows)
    label_stats["time_s"] = time.perf_counter() - t0
    fit = train_prm(cfg, hf_config, actor, rows, partial)
    stats = {"labels": label_stats, "fit": fit, "wall_s": time.perf_counter() - t0, "policy": policy}
    if rank0:
        (partial / "prm_stats.json").write_text(json.dumps(stats, indent=1))
        (partial / PRM_DONE).write_text(json.dumps(stats))
        shutil.rmtree(out, ignore_errors=True)
        os.replace(partial, out)
        log.info("prm: %s", json.dumps(stats))
    dist.barrier()
    return stats


# ---- RL ---------------------------------------------------------------------------------------
class PrmScorer:
    """The PRM during RL: a forward-only critic-architecture model loaded from prm.path whose
    line-end scores become dense rewards (megarl.algorithms.prm.dense_line_rewards)."""

    def __init__(self, cfg: MegaRLConfig, hf_config, tokenizer):
        self.model = build.build_prm(cfg, hf_config)
        self.newline_ids = newline_token_ids(tokenizer)
        self.lambda_fail, self.lambda_pass = cfg.prm.lambda_fail, cfg.prm.lambda_pass

    def dense_rewards(self, batch: StepBatch) -> torch.Tensor:
        values = rl.compute_values(self.model, batch)
        mask = P.line_end_mask(batch.response_ids, self.newline_ids, batch.width)
        return P.dense_line_rewards(values, mask, batch.acc, self.lambda_fail, self.lambda_pass)

"""First-GPU-node smoke test: does this machine run megarl's GPU paths correctly?

    python -m tools.gpu_smoke                               # one process (one GPU, or CPU)
    torchrun --nproc-per-node 8 -m tools.gpu_smoke          # 1..8 GPUs of one node
        [--only a,b] [--skip a,b] [--json results.json] [--require te,sglang] [--keep]

Checks, in order (names for --only / --skip):

  imports       torch (+ CUDA), megatron-core, transformers, megarl must import; Transformer Engine,
                SGLang, flash-attn, apex, flashinfer, torch_memory_saver are reported (and required
                with --require te,sglang,...). Detail: versions.
  logits_local  a tiny random Qwen2 model (megarl.tasks.tiny_model) is written as HF safetensors,
  logits_te     built with megarl.models.build_model (local spec / TE spec), loaded with
                megarl.weights.load_hf_weights; max |Megatron logits - HF logits| (fp32, HF on CPU)
                must stay under --tol-local / --tol-te (TE runs fp32 GEMMs in TF32).
  train_local   TrainModel (megarl/trainer/train_model.py) on the packed path, local spec / TE spec
  train_te      (THD): one forward_only (log-probs vs HF, masked positions 0) and one train_step
                (finite loss and grad norm, weights change, the batch's log-likelihood goes up).
  attn_kernels  the local attention's fast kernel (varlen on CUDA in bf16, sdpa on CPU) against its
                blockwise path: kernel outputs / gradients and the tiny model's logits / weight
                gradients, each vs the float32 blockwise model (tools/smoke/attention.py); the time of
                a forward + backward of both kernels (16k tokens on CUDA).
  attn_cp2      CP=2 emulated on one GPU: each rank's query chunks through varlen over their prefix
                keys equal those rows of the whole row's attention, gradients included. CUDA only.
  offload       TrainModel.offload() -> onload(): every parameter and optimizer tensor (main params,
                Adam moments) is bit-identical, offload freed GPU memory, and the next train_step
                still changes the weights and matches a twin model that never offloaded. The same
                for offload_optimizer=true (HybridDeviceOptimizer): after each offload -> onload ->
                train_step the next forward reads updated weights. CUDA only.
  offload_plain the same without the distributed optimizer (tools/smoke/offload.py): after a full and
                a two-stage round trip (gradients + optimizer state, then the weights) every parameter
                keeps the gradient accumulator DDP hooked, the next step's main_grad is non-zero and
                matches a twin's, each stage freed GPU memory. CUDA only.
  nccl          all_reduce, all_gather_into_tensor, broadcast and a send/recv ring on device tensors
                over the default (nccl) group, values checked; all_reduce bus bandwidth. CUDA only.
  sglang        make_engine("sglang", load_format="dummy").start() -> update_weights(
                stream_hf_weights(...)) -> greedy generate -> release_memory() -> resume_memory(
                ["weights"]) -> update_weights -> resume_memory() -> greedy again (identical) ->
                sampled generate (T=1): mean |engine logprob - trainer logprob| (bf16 trainer,
                megatron_forward_logits) under --tol-logprob. --sglang-tp N: one engine per N ranks.
                MoE (routing replay): an engine started with routed-experts return on a tiny random
                Qwen3-MoE (and on the check's model, were it MoE) reads back every sample's experts:
                [prompt + response, num_hidden_layers, num_experts_per_tok] as the config says, and
                HF's fp32 top-k on >= 80% of (token, layer) pairs (tools/smoke/sglang_routing.py).
                Skipped when sglang is not importable or there is no CUDA.
  fp8           TrainModel with model_options fp8="hybrid" (delayed recipe), TE THD path, bf16
                params: forward_only vs HF and a train_step, as train_te. Needs TE, CUDA, sm >= 89.
  cp2           context parallelism 2 (bf16, NCCL) through the trainer's packed path, megarl's local
                attention and TE's CP when importable: packed_forward of variable-length sequences
                at CP=2 equals CP=1; a TrainModel step at CP=2 is finite. Needs an even world size.

Tolerances (--tol-*) are for this tiny random model, whose logits have std ~1.7: bf16 alone
moves its log-probs by ~0.03 on average; a real bug (wrong weights, RoPE, masking) by ~1 or more.

Prints a table and one line per check, `check <name>: PASS|FAIL|SKIP <detail>`; exits 1 if any
check FAILs (on any rank), else 0. On a machine without CUDA the CPU-runnable checks (imports,
logits_local, train_local) run for real through megarl's CPU runtime (gloo) and the rest SKIP.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # run as a file: the same as `python -m tools.gpu_smoke`
    import sys
    from pathlib import Path
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository root, not tools/
    __import__("tools").run_as_module(__file__)

import argparse
import gc
import importlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable


PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


class Skip(Exception):
    """Raised by a check that cannot run here (missing CUDA / TE / SGLang / ranks)."""


class CheckFailed(Exception):
    """Raised by a check whose measurement is out of bounds."""


@dataclass
class Result:
    name: str
    status: str
    detail: str
    seconds: float = 0.0


@dataclass
class Ctx:
    """What the checks share: arguments, environment facts, the tiny model, distributed state."""

    args: argparse.Namespace
    work: Path
    cuda: bool = False
    te: bool = False  # transformer_engine.pytorch imports AND CUDA is present
    te_error: str = ""
    sglang: bool = False
    sglang_error: str = ""
    dist_ok: bool = False
    dist_error: str = ""
    rank: int = 0
    world: int = 1
    result_group: Any = None  # gloo group for exchanging results (never matches a check's collective)
    cache: dict = field(default_factory=dict)

    def need_dist(self) -> None:
        if not self.dist_ok:
            raise CheckFailed(f"distributed init failed: {self.dist_error}")

    def need_cuda(self) -> None:
        if not self.cuda:
            raise Skip("no CUDA device")

    def need_te(self) -> None:
        self.need_cuda()
        if not self.te:
            raise Skip(f"Transformer Engine not importable ({self.te_error})")


# ================================================================================ helpers

def _device():
    from megarl.parallel.distributed import device

    return device()


def _version(module: str) -> str:
    mod = importlib.import_module(module)
    for attr in ("__version__", "version"):
        v = getattr(mod, attr, None)
        if isinstance(v, str):
            return v
    try:
        from importlib.metadata import version

        return version(module.replace("_", "-"))
    except Exception:  # noqa: BLE001
        return "?"


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _error(err: BaseException, limit: int = 200) -> str:
    """'Type: first line of the message' (one line, for a table cell)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:limit] if text else ''}"


def _free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tiny_model_dir(ctx: Ctx) -> Path:
    """A tiny random Qwen2 (2 layers, hidden 256, 4 heads / 2 KV heads of dim 64, byte tokenizer,
    vocab 320) saved as HF safetensors + tokenizer. Weights are redrawn with std 0.1 (HF's 0.02
    makes every logit ~0 and the comparisons toothless); every rank builds the same one."""
    if "hf_dir" in ctx.cache:
        return ctx.cache["hf_dir"]
    from megarl.tasks.tiny_model import TinyModelSpec, build_byte_tokenizer, build_tiny_qwen2, save_tiny_model
    from tools.smoke import randomize_

    spec = TinyModelSpec(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512,
                         max_position_embeddings=512, seed=0)
    tok = build_byte_tokenizer()
    model = build_tiny_qwen2(tok, spec)
    randomize_(model, seed=0)
    out = save_tiny_model(ctx.work / f"tiny-qwen2-rank{ctx.rank}", spec, model=model, tokenizer=tok)
    ctx.cache["hf_dir"] = out
    return out


def hf_config(ctx: Ctx):
    from transformers import AutoConfig

    if "hf_config" not in ctx.cache:
        ctx.cache["hf_config"] = AutoConfig.from_pretrained(tiny_model_dir(ctx))
    return ctx.cache["hf_config"]


def hf_model(ctx: Ctx):
    """The tiny HF model in fp32 on CPU (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    if "hf_model" not in ctx.cache:
        ctx.cache["hf_model"] = AutoModelForCausalLM.from_pretrained(
            tiny_model_dir(ctx), dtype=torch.float32).eval()
    return ctx.cache["hf_model"]


def probe_ids(batch: int = 2, seq: int = 48, seed: int = 0):
    import torch

    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def trajectories(n: int = 6, seed: int = 0):
    """Fixed trajectories of byte tokens: prompts of 4-12 tokens, responses of 3-12."""
    from megarl.trainer.batch import Trajectory

    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(0, 256) for _ in range(rng.randint(4, 12))]
        r = [rng.randrange(0, 256) for _ in range(rng.randint(3, 12))]
        out.append(Trajectory(uid=f"p{i // 2}", prompt_ids=p, response_ids=r,
                              rollout_logprobs=[0.0] * len(r), finish_reason="stop",
                              score=float(i % 2), acc=bool(i % 2)))
    return out


def hf_response_logprobs(ctx: Ctx, trajs) -> Any:
    """[B, T] log p(response token) under the HF model (fp32, CPU), 0 past each response."""
    import torch

    model = hf_model(ctx)
    T = max(len(t.response_ids) for t in trajs)
    out = torch.zeros(len(trajs), T)
    with torch.no_grad():
        for i, t in enumerate(trajs):
            ids = torch.tensor([t.prompt_ids + t.response_ids])
            logp = model(ids).logits.float().log_softmax(-1)[0]
            P, R = len(t.prompt_ids), len(t.response_ids)
            out[i, :R] = logp[P - 1 : P - 1 + R].gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
    return out


def megatron_model(ctx: Ctx, impl: str, dtype: str = "fp32", overrides: dict | None = None):
    """build_model + load_hf_weights of the tiny model at the current parallel layout."""
    from megarl.models import build_model
    from megarl.weights import load_hf_weights

    chunks = build_model(hf_config(ctx), dtype=dtype, impl=impl, config_overrides=overrides)
    load_hf_weights(chunks, tiny_model_dir(ctx))
    return chunks


# ================================================================================ trainer API
# Items 3-4 (and fp8 / cp2) go through TrainModel's step-batch API (megarl/trainer/batch.py,
# megarl/trainer/train_model.py):
#   batch = StepBatch.from_trajectories(trajs)
#   logp = model.forward_only(batch, fn)       # fn(mb, output) -> [n, T_mb]; returns [B, T] fp32 CPU
#   metrics = model.train_step(batch, loss_fn) # loss_fn(mb, output) -> (scalar, {name: 0-dim})
# where mb is a MicroBatch: mb.data (its rows of the batch, on the device), mb.targets (next
# token at every packed position) and mb.log_probs(logits) -> [n, T_mb] (chunked, CP-summed).

def make_batch(trajs):
    from megarl.trainer.batch import StepBatch

    return StepBatch.from_trajectories(trajs)


def token_logprobs(mb, output):
    """[n, T_mb] log-probs of the micro-batch's response tokens (vocab-parallel, fp32)."""
    return mb.log_probs(output)


def forward_logprobs(model, batch):
    """[B, T] response log-probs through TrainModel.forward_only (float32, CPU)."""
    return model.forward_only(batch, token_logprobs).float().cpu()


def nll_loss_fn(n_tokens: float):
    """Token-mean negative log-likelihood of the response tokens. Every DP rank trains the same
    batch here, so the global denominator (TrainModel's loss convention) is n_tokens * dp."""
    from megatron.core import parallel_state as ps

    denominator = n_tokens * ps.get_data_parallel_world_size()

    def loss_fn(mb, output):
        logp = token_logprobs(mb, output)
        loss = -(logp * mb.data.response_mask).sum() / denominator
        return loss, {"nll": loss.detach()}

    return loss_fn


def optim_config(lr: float = 1e-3, max_tokens: int = 48, distributed: bool = True):
    """A small token budget, so the batch spans several micro-batches (gradient accumulation)."""
    from megarl.config.schema import OptimConfig

    return OptimConfig(lr=lr, weight_decay=0.0, clip_grad=1.0, max_tokens_per_microbatch=max_tokens,
                       use_distributed_optimizer=distributed)


def train_model(ctx: Ctx, impl: str, dtype: str, lr: float = 1e-3, model_options: dict | None = None,
                distributed: bool = True):
    """TrainModel of the tiny model with its HF weights loaded (and copied into the optimizer)."""
    from megarl.trainer.train_model import TrainModel
    from megarl.weights import load_hf_weights

    model = TrainModel(hf_config(ctx), optim_config(lr, distributed=distributed), dtype=dtype, impl=impl,
                       total_steps=10, seed=0, model_options=model_options)
    load_hf_weights(model.chunks, tiny_model_dir(ctx))
    model.optimizer.reload_model_params()  # fp32 main params from the loaded weights
    return model


def param_snapshot(model) -> dict:
    return {n: p.detach().cpu().clone() for m in model.modules for n, p in m.named_parameters()}


def optimizer_snapshot(optimizer) -> dict:
    """Every tensor the optimizer holds: its (main) params and per-param state (Adam moments)."""
    import torch

    out = {}
    for i, sub in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for g, group in enumerate(inner.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"opt{i}.group{g}.param{j}"] = p.detach().cpu().clone()
                for k, v in inner.state.get(p, {}).items():
                    if torch.is_tensor(v):
                        out[f"opt{i}.group{g}.param{j}.{k}"] = v.detach().cpu().clone()
    return out


def max_change(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def run_train_check(ctx: Ctx, impl: str, dtype: str, tol: float, model_options: dict | None = None,
                    label: str = "") -> str:
    """Item 3: one forward_only (log-probs vs HF) and one train_step on the packed path."""
    import torch

    model = train_model(ctx, impl, dtype, model_options=model_options)
    trajs = trajectories()
    batch = make_batch(trajs)
    mask = batch.response_mask
    n_tokens = float(mask.sum())
    ref = hf_response_logprobs(ctx, trajs)

    logp = forward_logprobs(model, batch)
    if tuple(logp.shape) != tuple(ref.shape):
        raise CheckFailed(f"forward_only returned shape {tuple(logp.shape)}, expected {tuple(ref.shape)}")
    if not torch.isfinite(logp).all():
        raise CheckFailed("forward_only returned non-finite log-probs")
    if float((logp * (1 - mask)).abs().max()) != 0.0:
        raise CheckFailed("forward_only: positions past a response are not 0")
    diff = (logp - ref).abs() * mask
    mean_diff, max_diff = float(diff.sum() / n_tokens), float(diff.max())
    if not mean_diff < tol:
        raise CheckFailed(f"{label}forward_only log-probs vs HF: mean |diff| {_fmt(mean_diff)} >= {tol} "
                          f"(max {_fmt(max_diff)})")

    before = param_snapshot(model)
    metrics = model.train_step(make_batch(trajs), nll_loss_fn(n_tokens))
    nll, gnorm = metrics.get("nll", float("nan")), metrics.get("grad_norm", float("nan"))
    if not (math.isfinite(nll) and math.isfinite(gnorm) and gnorm > 0):
        raise CheckFailed(f"train_step metrics not finite / zero grad norm: {metrics}")
    # the loss the step saw is the pre-step NLL, i.e. -mean(forward_only log-probs)
    own_nll = float(-(logp * mask).sum() / n_tokens)
    if abs(nll - own_nll) > max(10 * tol, 1e-4):
        raise CheckFailed(f"train_step nll {_fmt(nll)} != -mean(forward_only logp) {_fmt(own_nll)}")
    changed = max_change(param_snapshot(model), before)
    if changed == 0.0:
        raise CheckFailed("train_step left every weight unchanged")
    after = forward_logprobs(model, make_batch(trajs))
    gain = float(((after - logp) * mask).sum() / n_tokens)
    if not gain > 0:
        raise CheckFailed(f"the batch's mean log-prob did not go up after the step ({_fmt(gain)})")
    return (f"{label}{impl} {dtype}, {len(trajs)} seqs / {int(n_tokens)} response tokens in "
            f"{len(model.microbatches(batch))} micro-batches; forward_only vs HF mean|d| {_fmt(mean_diff)} "
            f"max|d| {_fmt(max_diff)} (tol {tol}); train_step nll {_fmt(nll)} grad_norm {_fmt(gnorm)} "
            f"max|dW| {_fmt(changed)}; mean logp after the step +{_fmt(gain)}")


def run_offload_check(ctx: Ctx) -> str:
    """Item 4: offload -> onload bit-identical; the next train_step still works (vs a twin). Then
    offload_optimizer=true (megatron's HybridDeviceOptimizer: Adam on the CPU, updating views of
    DDP's parameter buffer): after each offload -> onload -> train_step the next forward must read
    the updated weights, which must match a twin that never offloaded."""
    import torch

    impl = "transformer_engine" if ctx.te else "local"
    batch = make_batch(trajectories())
    loss = nll_loss_fn(float(batch.response_mask.sum()))
    a, b = train_model(ctx, impl, "bf16", lr=1e-2), train_model(ctx, impl, "bf16", lr=1e-2)
    start = param_snapshot(b)
    for m in (a, b):  # Adam state exists after one step
        m.train_step(batch, loss)
    params0, optim0 = param_snapshot(a), optimizer_snapshot(a.optimizer)
    torch.cuda.synchronize()
    mem_before = torch.cuda.memory_allocated()
    a.offload()
    mem_offloaded = torch.cuda.memory_allocated()
    a.onload()
    params1, optim1 = param_snapshot(a), optimizer_snapshot(a.optimizer)
    if set(params1) != set(params0) or set(optim1) != set(optim0):
        raise CheckFailed("offload/onload changed the set of parameters / optimizer tensors")
    bad = [k for k in params0 if not torch.equal(params0[k], params1[k])]
    bad += [k for k in optim0 if not torch.equal(optim0[k], optim1[k])]
    if bad:
        raise CheckFailed(f"not bit-identical after offload/onload: {bad[:4]} ({len(bad)} tensors)")
    freed = mem_before - mem_offloaded
    if freed <= 0:
        raise CheckFailed(f"offload freed no GPU memory ({mem_before} -> {mem_offloaded} bytes)")
    a.train_step(batch, loss)
    b.train_step(batch, loss)
    params2, twin = param_snapshot(a), param_snapshot(b)
    moved = max_change(params2, params1)
    if moved == 0.0:
        raise CheckFailed("the train_step after onload left every weight unchanged")
    num = sum(float((params2[k].float() - twin[k].float()).norm()) ** 2 for k in twin) ** 0.5
    den = sum(float((twin[k].float() - start[k].float()).norm()) ** 2 for k in twin) ** 0.5
    rel = num / max(den, 1e-30)
    if rel > ctx.args.tol_offload_rel:
        raise CheckFailed(f"after onload + step the weights differ from a never-offloaded twin: "
                          f"|dW| / |update| = {_fmt(rel)} > {ctx.args.tol_offload_rel}")
    detail = (f"{impl}, bf16: {len(params0)} params + {len(optim0)} optimizer tensors bit-identical; "
              f"offload freed {freed / 2**20:.1f} MiB; next step max|dW| {_fmt(moved)}, "
              f"vs twin |dW|/|update| {_fmt(rel)}")
    import dataclasses

    from megarl.trainer.train_model import TrainModel
    from megarl.weights import load_hf_weights

    del a, b
    _free_memory()
    hybrid = []
    for _ in range(2):
        m = TrainModel(hf_config(ctx), dataclasses.replace(optim_config(1e-2), offload_optimizer=True), dtype="bf16",
                       impl=impl, total_steps=10, seed=0)
        load_hf_weights(m.chunks, tiny_model_dir(ctx))
        m.optimizer.reload_model_params()
        hybrid.append(m)
    h, h_twin = hybrid
    h_start = param_snapshot(h_twin)
    for m in hybrid:  # Adam state exists (on the CPU)
        m.train_step(batch, loss)
    mask = batch.response_mask
    gains = []
    for _ in range(2):  # two rollouts: the second round trip also carries Adam state
        h.offload()
        h.onload()
        logp0 = forward_logprobs(h, make_batch(trajectories()))
        h.train_step(batch, loss)
        h_twin.train_step(batch, loss)
        logp1 = forward_logprobs(h, make_batch(trajectories()))
        gains.append(float(((logp1 - logp0) * mask).abs().max()))
        if gains[-1] == 0.0:
            raise CheckFailed("offload_optimizer=true: after offload -> onload -> train_step the next forward "
                              "reads the old weights (the update never reached DDP's parameter buffer)")
    h_params, h_twin_params = param_snapshot(h), param_snapshot(h_twin)
    num = sum(float((h_params[k].float() - h_twin_params[k].float()).norm()) ** 2 for k in h_twin_params) ** 0.5
    den = sum(float((h_twin_params[k].float() - h_start[k].float()).norm()) ** 2 for k in h_twin_params) ** 0.5
    h_rel = num / max(den, 1e-30)
    if h_rel > ctx.args.tol_offload_rel:
        raise CheckFailed(f"offload_optimizer=true: after offload/onload + steps the weights differ from a "
                          f"never-offloaded twin: |dW| / |update| = {_fmt(h_rel)} > {ctx.args.tol_offload_rel}")
    return (detail + f"; offload_optimizer=true: forward after each round trip + step moved max|dlogp| "
            f"{', '.join(_fmt(g) for g in gains)}, vs twin |dW|/|update| {_fmt(h_rel)}")


# ================================================================================ checks

def check_imports(ctx: Ctx) -> str:
    """Item 1: required packages import; optional GPU packages are reported."""
    parts, missing = [], []
    import torch

    cuda = "cuda " + (torch.version.cuda or "n/a")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        cap = torch.cuda.get_device_capability(0)
        cuda += f", {n} x {torch.cuda.get_device_name(0)} (sm{cap[0]}{cap[1]})"
    else:
        cuda += ", no device"
    parts.append(f"torch {torch.__version__} ({cuda})")
    for label, module in (("megatron-core", "megatron.core"), ("transformers", "transformers"),
                          ("megarl", "megarl")):
        try:
            if module == "megatron.core":
                from megatron.core import package_info

                parts.append(f"{label} {package_info.__version__}")
            else:
                parts.append(f"{label} {_version(module)}")
        except Exception as err:  # noqa: BLE001
            missing.append(f"{label} ({type(err).__name__}: {err})")
    optional = {"te": ("transformer-engine", "transformer_engine.pytorch"), "sglang": ("sglang", "sglang"),
                "flash-attn": ("flash-attn", "flash_attn"), "apex": ("apex", "apex.normalization"),
                "flashinfer": ("flashinfer", "flashinfer"),
                "torch_memory_saver": ("torch_memory_saver", "torch_memory_saver")}
    required = {r.strip() for r in (ctx.args.require or "").split(",") if r.strip()}
    unknown = required - set(optional)
    if unknown:
        raise CheckFailed(f"--require: unknown names {sorted(unknown)} (choose from {sorted(optional)})")
    for key, (label, module) in optional.items():
        try:
            importlib.import_module(module)
            version = _version(module.split(".")[0])
            parts.append(f"{label} {version}")
            ok, err = True, ""
        except Exception as e:  # noqa: BLE001 (TE raises OSError/RuntimeError without CUDA libs)
            ok, err = False, _error(e, 120)
            parts.append(f"{label} -")
            if key in required:
                missing.append(f"{label} ({err})")
        if key == "te":
            ctx.te, ctx.te_error = ok and torch.cuda.is_available(), err or ("no CUDA" if ok else "")
        if key == "sglang":
            ctx.sglang, ctx.sglang_error = ok and torch.cuda.is_available(), err or ("no CUDA" if ok else "")
    if missing:
        raise CheckFailed("missing: " + "; ".join(missing) + " | " + ", ".join(parts))
    return ", ".join(parts)


def _logits_check(ctx: Ctx, impl: str, tol: float) -> str:
    import torch

    from megarl.models import megatron_forward_logits

    ids = probe_ids()
    with torch.no_grad():
        ref = hf_model(ctx)(ids).logits.float()
    chunks = megatron_model(ctx, impl, "fp32")
    out = megatron_forward_logits(chunks, ids.to(_device())).cpu()
    if tuple(out.shape) != tuple(ref.shape):
        raise CheckFailed(f"logits shape {tuple(out.shape)} != HF {tuple(ref.shape)}")
    diff = float((out - ref).abs().max())
    detail = (f"fp32, ids {tuple(ids.shape)}: max|megatron - HF| {_fmt(diff)} (tol {tol}), "
              f"HF logit std {_fmt(float(ref.std()))}")
    if not diff < tol:
        raise CheckFailed(detail)
    return detail


def check_logits_local(ctx: Ctx) -> str:
    """Item 2, local spec."""
    ctx.need_dist()
    return _logits_check(ctx, "local", ctx.args.tol_local)


def check_logits_te(ctx: Ctx) -> str:
    """Item 2, Transformer Engine spec."""
    ctx.need_dist()
    ctx.need_te()
    return _logits_check(ctx, "transformer_engine", ctx.args.tol_te)


def check_train_local(ctx: Ctx) -> str:
    """Item 3, local spec (packed rows with block-causal masks); bf16 on GPU, fp32 on CPU."""
    ctx.need_dist()
    if ctx.cuda:
        return run_train_check(ctx, "local", "bf16", ctx.args.tol_train_bf16)
    return run_train_check(ctx, "local", "fp32", ctx.args.tol_train_fp32)


def check_train_te(ctx: Ctx) -> str:
    """Item 3, TE spec (THD packed sequences), bf16."""
    ctx.need_dist()
    ctx.need_te()
    return run_train_check(ctx, "transformer_engine", "bf16", ctx.args.tol_train_bf16)


def check_offload(ctx: Ctx) -> str:
    """Item 4."""
    ctx.need_dist()
    ctx.need_cuda()
    return run_offload_check(ctx)


def check_offload_plain(ctx: Ctx) -> str:
    """Item 4b: offload without the distributed optimizer (tools/smoke/offload.py): DDP's
    gradient accumulators survive a round trip (full and two-stage), main_grad is non-zero after
    it, the weights follow a twin that never offloaded."""
    ctx.need_dist()
    ctx.need_cuda()
    from tools.smoke.offload import round_trip_check

    impl = "transformer_engine" if ctx.te else "local"
    batch = make_batch(trajectories())
    loss = nll_loss_fn(float(batch.response_mask.sum()))
    try:
        return f"{impl} bf16: " + round_trip_check(
            lambda: train_model(ctx, impl, "bf16", lr=1e-2, distributed=False), batch, loss, ctx.args.tol_offload_rel)
    except ValueError as err:
        raise CheckFailed(str(err)) from err


def check_nccl(ctx: Ctx) -> str:
    """Item 5: collectives on device tensors over the default group, values checked."""
    ctx.need_dist()
    ctx.need_cuda()
    import torch
    import torch.distributed as dist

    backend = dist.get_backend()
    if backend != "nccl":
        raise CheckFailed(f"default process group backend is {backend!r}, expected 'nccl'")
    dev, rank, world = _device(), dist.get_rank(), dist.get_world_size()
    n = 1 << 20
    x = torch.full((n,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    if not torch.all(x == world * (world + 1) / 2):
        raise CheckFailed("all_reduce: wrong sum")
    piece = torch.arange(n, device=dev, dtype=torch.float32) + rank * n
    gathered = torch.empty(world * n, device=dev)
    dist.all_gather_into_tensor(gathered, piece)
    if not torch.equal(gathered, torch.arange(world * n, device=dev, dtype=torch.float32)):
        raise CheckFailed("all_gather_into_tensor: wrong values")
    src = world - 1
    y = torch.full((n,), float(rank), device=dev, dtype=torch.bfloat16)
    dist.broadcast(y, src=src)
    if not torch.all(y == float(src)):
        raise CheckFailed("broadcast: wrong values")
    ring = "ring n/a (world 1)"
    if world > 1:
        send = torch.full((n,), float(rank), device=dev)
        recv = torch.empty(n, device=dev)
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world),
               dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        if not torch.all(recv == float((rank - 1) % world)):
            raise CheckFailed("send/recv ring: wrong values")
        ring = "send/recv ring ok"
    big = torch.ones(64 << 20, device=dev, dtype=torch.bfloat16)  # 128 MiB
    dist.all_reduce(big)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    iters = 5
    for _ in range(iters):
        dist.all_reduce(big)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    busbw = big.numel() * big.element_size() * 2 * (world - 1) / world / dt / 1e9 if world > 1 else 0.0
    version = torch.cuda.nccl.version()
    version = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return (f"nccl {version}, world {world}: all_reduce, "
            f"all_gather_into_tensor, broadcast ok, {ring}; all_reduce 128 MiB bf16 "
            f"{dt * 1e3:.2f} ms, busbw {busbw:.1f} GB/s")


def check_sglang(ctx: Ctx) -> str:
    """Item 6: the SGLang engine against the trainer's weights and log-probs."""
    ctx.need_dist()
    ctx.need_cuda()
    if not ctx.sglang:
        raise Skip(f"sglang not importable ({ctx.sglang_error})")
    import torch
    import torch.distributed as dist

    from megarl.models import megatron_forward_logits
    from megarl.rollout.registry import make_engine
    from megarl.rollout.types import SamplingParams
    from megarl.weights import stream_hf_weights

    args = ctx.args
    cfg = hf_config(ctx)
    impl = "transformer_engine" if ctx.te else "local"
    chunks = megatron_model(ctx, impl, "bf16")
    tp, world, rank = args.sglang_tp, dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise Skip(f"--sglang-tp {tp} does not divide the world size {world}")
    from megarl.trainer.build import engine_group

    group = engine_group(tp)  # gloo group of the tp ranks sharing this rank's engine (None: tp 1)
    kwargs = dict(model_path=str(tiny_model_dir(ctx)), group=group, tp_size=tp, dtype="bfloat16",
                  load_format="dummy", mem_fraction_static=args.sglang_mem_fraction, random_seed=0)
    if world > tp:  # several engines on the node: keep their ports apart
        kwargs["port"] = 30000 + 100 * (rank // tp)
    for item in args.sglang_arg or []:
        key, _, value = item.partition("=")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    routing = _sglang_routing_module()
    moe = routing.moe_shape(cfg)  # an MoE model: the engine returns routed experts (routing replay)
    engine = make_engine("sglang", **kwargs, return_routed_experts=moe is not None)
    t0 = time.perf_counter()
    engine.start()
    t_start = time.perf_counter() - t0

    def push() -> float:
        t = time.perf_counter()
        engine.update_weights(stream_hf_weights(chunks, cfg, dtype=torch.bfloat16))
        return time.perf_counter() - t

    try:
        t_update = push()
        prompts = [t.prompt_ids for t in trajectories(4, seed=1)]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
        first = engine.generate(prompts, greedy)
        # the colocated cycle (megarl/rollout/sglang/engine.py): release everything for training,
        # weights back + update from the trainer's weights, then the rest for generation
        engine.release_memory()
        engine.resume_memory(["weights"])
        push()
        engine.resume_memory()
        second = engine.generate(prompts, greedy)
        if [s.response_ids for s in first] != [s.response_ids for s in second]:
            raise CheckFailed("greedy output changed after release/resume/update_weights")
        if not all(s.response_ids for s in first):
            raise CheckFailed("greedy generate returned an empty response")
        sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=32, seed=1))
    finally:
        engine.shutdown()
    diffs, agree, total = [], 0, 0
    for s in sampled:
        if not s.response_ids:
            continue
        ids = torch.tensor([s.prompt_ids + s.response_ids], device=_device())
        logits = megatron_forward_logits(chunks, ids)[0].float()
        P, R = len(s.prompt_ids), len(s.response_ids)
        lp = logits.log_softmax(-1)[P - 1 : P - 1 + R]
        mine = lp.gather(-1, torch.tensor(s.response_ids, device=lp.device)[:, None])[:, 0].cpu()
        diffs.append((mine - torch.tensor(s.logprobs)).abs())
    for s in first:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device=_device())
        logits = megatron_forward_logits(chunks, ids)[0]
        P, R = len(s.prompt_ids), len(s.response_ids)
        pred = logits[P - 1 : P - 1 + R].argmax(-1).cpu().tolist()
        agree += sum(int(a == b) for a, b in zip(pred, s.response_ids))
        total += R
    if not diffs:
        raise CheckFailed("sampled generate returned only empty responses")
    d = torch.cat(diffs)
    mean_diff, max_diff = float(d.mean()), float(d.max())
    detail = (f"sglang {_version('sglang')}, tp {tp}, {impl} bf16 trainer: start {t_start:.1f}s, "
              f"update_weights {t_update:.2f}s; greedy identical after release/resume; trainer argmax "
              f"agrees on {agree}/{total} greedy tokens; |engine - trainer logprob| mean "
              f"{_fmt(mean_diff)} max {_fmt(max_diff)} over {d.numel()} tokens (tol {args.tol_logprob})")
    if not mean_diff < args.tol_logprob:
        raise CheckFailed(detail)
    try:
        if moe is not None:
            detail += "; " + routing.verdict(first + second + sampled, moe, tiny_model_dir(ctx))
        detail += "; tiny Qwen3-MoE: " + _sglang_moe_routing(ctx, kwargs)
    except ValueError as err:
        raise CheckFailed(f"{detail}; {err}") from err
    return detail


def _sglang_routing_module():
    from tools.smoke import sglang_routing

    return sglang_routing


def _sglang_moe_routing(ctx: Ctx, kwargs: dict) -> str:
    """The sglang check's MoE part (tools/smoke/sglang_routing.py): an engine with routed-experts
    return on a tiny random Qwen3-MoE (its own weights, load_format auto) generates greedy and
    sampled FIRE samples (two calls each); their routed_experts must have the model config's
    shape and agree with HF's fp32 top-k. ValueError when they do not."""
    from megarl.weights.hf_reader import read_config
    from megarl.rollout.registry import make_engine
    from megarl.rollout.types import SamplingParams

    routing = _sglang_routing_module()
    path = routing.tiny_moe_dir(ctx.work / f"tiny-qwen3-moe-rank{ctx.rank}")
    shape = routing.moe_shape(read_config(path))
    engine = make_engine("sglang", **dict(kwargs, model_path=str(path), load_format="auto"),
                         return_routed_experts=True)
    engine.start()
    try:
        prompts = [t.prompt_ids for t in trajectories(4, seed=2)]
        samples = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=16))
        samples += engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=24, seed=2,
                                                           fire=True))
    finally:
        engine.shutdown()
    return routing.verdict(samples, shape, path)


def check_fp8(ctx: Ctx) -> str:
    """Item 7a: FP8 through the trainer: TrainModel with model_options fp8="hybrid" (delayed
    scaling) on the TE THD path (sequences padded to multiples of 16), bf16 parameters."""
    ctx.need_dist()
    ctx.need_te()
    import torch

    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        raise Skip(f"FP8 needs compute capability >= 8.9 (this GPU: sm{cap[0]}{cap[1]})")
    return run_train_check(ctx, "transformer_engine", "bf16", ctx.args.tol_fp8,
                           model_options={"fp8": "hybrid", "fp8_recipe": "delayed"},
                           label="fp8 hybrid/delayed: ")


def check_cp2(ctx: Ctx) -> str:
    """Item 7b: context parallelism 2 through the trainer's packed path (NCCL, bf16): for megarl's
    local attention and, when importable, TE's CP, `packed_forward` at CP=2 of variable-length
    sequences (lengths not multiples of 4) gives the CP=1 logits; a TrainModel step is finite."""
    ctx.need_dist()
    if ctx.world % 2:
        raise Skip(f"CP=2 needs an even world size (world {ctx.world})")
    import torch

    from megarl.models.builder import te_available
    from megarl.models.forward import packed_forward
    from megarl.parallel.distributed import ParallelSizes, init_distributed

    tol = ctx.args.tol_cp
    seqs = [probe_ids(batch=1, seq=n, seed=n)[0] for n in (37, 128, 5)]
    details, ok = [], True
    for impl in ["local"] + (["transformer_engine"] if te_available() else []):
        try:
            with torch.no_grad():
                ref = [o.float().cpu() for o in packed_forward(megatron_model(ctx, impl, "bf16"), seqs)]
            _free_memory()
            init_distributed(ParallelSizes(cp=2), seed=1234, timeout_s=ctx.args.timeout_minutes * 60)
            with torch.no_grad():
                out = [o.float().cpu() for o in packed_forward(megatron_model(ctx, impl, "bf16"), seqs)]
            d = torch.cat([(o - r).abs().reshape(-1) for o, r in zip(out, ref)])
            model = train_model(ctx, impl, "bf16")
            batch = make_batch(trajectories())
            metrics = model.train_step(batch, nll_loss_fn(float(batch.response_mask.sum())))
            finite = all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
            del model
            _free_memory()
        finally:
            init_distributed(ParallelSizes(), seed=1234, timeout_s=ctx.args.timeout_minutes * 60)
        ok = ok and float(d.mean()) < tol and finite
        details.append(f"{impl}: |CP=2 - CP=1 logits| mean {_fmt(float(d.mean()))} max {_fmt(float(d.max()))}, "
                       f"train step finite {finite}")
    detail = "; ".join(details) + f" (tol mean {tol})"
    if not ok:
        raise CheckFailed(detail)
    return detail


def _attention_model_outputs(ctx: Ctx, kernel: str, dtype: str):
    """Logits of three packed sequences and the gradient of sum(logits * w) over every weight, for
    the tiny model with the local attention forced to `kernel`."""
    import torch

    from megarl.models.attention_kernels import forced_kernel
    from megarl.models.forward import packed_forward

    seqs = [probe_ids(batch=1, seq=n, seed=n)[0] for n in (37, 128, 5)]
    with forced_kernel(kernel):
        chunks = megatron_model(ctx, "local", dtype)
        logits = packed_forward(chunks, seqs, grad=True)
        gen = torch.Generator().manual_seed(0)
        loss = sum((out * torch.randn(out.shape, generator=gen).to(out.device)).sum() for out in logits)
        loss.backward()
        grads = torch.cat([p.grad.float().reshape(-1) for c in chunks for p in c.parameters() if p.grad is not None])
    out = torch.cat([o.detach().float().reshape(-1) for o in logits])
    del chunks
    _free_memory()
    return out, grads


def check_attn_kernels(ctx: Ctx) -> str:
    """The local attention's fast kernel (varlen on CUDA in bf16, sdpa on CPU in fp32) against its
    blockwise path: kernel outputs and gradients (tools/smoke/attention.kernel_check), then the tiny
    model's logits and weight gradients, each against the float32 blockwise model. On CUDA the fast
    kernel must be no less exact than blockwise in bf16 (error <= 2x blockwise's + 1e-3); on CPU
    sdpa must equal blockwise (relative < --tol-attn-fp32)."""
    ctx.need_dist()
    from megarl.models.attention_kernels import varlen_function
    from tools.smoke.attention import kernel_check

    if ctx.cuda and varlen_function() is None:
        raise Skip("this torch has no torch.nn.attention.varlen")
    k = kernel_check("cuda" if ctx.cuda else "cpu")
    fast = k["fast"]
    ref_logits, ref_grads = _attention_model_outputs(ctx, "blockwise", "fp32")
    errs = {f"kernel_{key}": val for key, val in k.items() if key.endswith(("_out", "_dq", "_dk", "_dv"))}
    dtype = "bf16" if ctx.cuda else "fp32"
    for kernel in (fast, "blockwise"):
        logits, grads = _attention_model_outputs(ctx, kernel, dtype)
        errs[f"model_{kernel}_logits"] = float((logits - ref_logits).norm() / ref_logits.norm())
        errs[f"model_{kernel}_grads"] = float((grads - ref_grads).norm() / ref_grads.norm())
    detail = (", ".join(f"{key} {_fmt(v)}" for key, v in errs.items()) +
              f"; {k['row_tokens']}-token fwd+bwd {fast} {k[fast + '_ms']:.1f} ms, blockwise {k['blockwise_ms']:.1f} ms")
    bad = []
    for key, val in errs.items():
        if fast not in key:
            continue
        twin = errs[key.replace(fast, "blockwise")]
        limit = 2 * twin + 1e-3 if ctx.cuda else ctx.args.tol_attn_fp32
        if not math.isfinite(val) or val > limit:
            bad.append(f"{key} {_fmt(val)} > {_fmt(limit)}")
    if bad:
        raise CheckFailed("; ".join(bad) + " | " + detail)
    return detail


def check_gdn_kernels(ctx: Ctx) -> str:
    """The gated delta-net kernels on the device against the CPU float32 torch kernel
    (tools/smoke/gdn.py): the torch kernel in float32 within 1e-4; on CUDA with
    flash-linear-attention, its bf16 kernels within 3e-2 and restarting at sequence boundaries."""
    from tools.smoke.gdn import gdn_check, problems

    errs = gdn_check("cuda" if ctx.cuda else "cpu")
    detail = ", ".join(f"{k} {_fmt(v)}" for k, v in errs.items() if k != "fla")
    if errs["fla"] is None:
        detail += "; flash-linear-attention: " + ("not installed" if ctx.cuda else "CUDA only")
    bad = problems(errs)
    if bad:
        raise CheckFailed("; ".join(bad) + " | " + detail)
    return detail


def check_fp8_weights(ctx: Ctx) -> str:
    """FP8 rollout weights (rollout.weights_dtype=fp8) quantized and dequantized on the device
    (tools/smoke/fp8_weights.py): float8_e4m3fn + float32 scales on the device, within block-FP8
    rounding of bf16, the device's values equal to the CPU's; gate and norm unquantized."""
    from tools.smoke.fp8_weights import fp8_weights_check

    out, bad = fp8_weights_check("cuda" if ctx.cuda else "cpu")
    detail = ", ".join(f"{k} {_fmt(v)}" for k, v in out.items())
    if bad:
        raise CheckFailed("; ".join(bad) + " | " + detail)
    return detail


def check_attn_cp2(ctx: Ctx) -> str:
    """Context parallelism 2 emulated on one GPU: each CP rank's query chunks through the varlen
    kernel over their prefixes' keys equal those rows of the whole row's attention
    (tools/smoke/attention.cp_check; relative error, gradients included, < --tol-attn-bf16)."""
    ctx.need_cuda()
    from megarl.models.attention_kernels import varlen_function
    from tools.smoke.attention import cp_check

    if varlen_function() is None:
        raise Skip("this torch has no torch.nn.attention.varlen")
    errs = cp_check()
    detail = ", ".join(f"{key} {_fmt(v)}" for key, v in errs.items()) + f" (tol {ctx.args.tol_attn_bf16})"
    if not all(math.isfinite(v) and v < ctx.args.tol_attn_bf16 for v in errs.values()):
        raise CheckFailed(detail)
    return detail


@dataclass(frozen=True)
class Check:
    name: str
    fn: Callable[[Ctx], str]
    gpu_only: bool  # SKIPs on a machine without CUDA


CHECKS: list[Check] = [
    Check("imports", check_imports, False),
    Check("logits_local", check_logits_local, False),
    Check("logits_te", check_logits_te, True),
    Check("train_local", check_train_local, False),
    Check("attn_kernels", check_attn_kernels, False),
    Check("attn_cp2", check_attn_cp2, True),
    Check("gdn_kernels", check_gdn_kernels, False),
    Check("fp8_weights", check_fp8_weights, False),
    Check("train_te", check_train_te, True),
    Check("offload", check_offload, True),
    Check("offload_plain", check_offload_plain, True),
    Check("nccl", check_nccl, True),
    Check("sglang", check_sglang, True),
    Check("fp8", check_fp8, True),
    Check("cp2", check_cp2, True),
]


# ================================================================================ driver

def run_one(check: Check, ctx: Ctx) -> Result:
    t0 = time.perf_counter()
    try:
        status, detail = PASS, check.fn(ctx)
    except Skip as s:
        status, detail = SKIP, str(s)
    except CheckFailed as f:
        status, detail = FAIL, str(f)
    except Exception as err:  # noqa: BLE001 - a crash is a FAIL with its cause
        status = FAIL
        detail = _error(err, 400)
        if ctx.args.verbose or ctx.rank == 0:
            traceback.print_exc(file=sys.stderr)
    _free_memory()
    return Result(check.name, status, " ".join(detail.split()), time.perf_counter() - t0)


def combine(results: list[Result]) -> Result:
    """One rank's results of a check -> one result: FAIL if any rank failed, SKIP if all skipped."""
    first = results[0]
    failed = [(r, res) for r, res in enumerate(results) if res.status == FAIL]
    if failed:
        r, res = failed[0]
        more = f" (+{len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        detail = res.detail if len(results) == 1 else f"rank {r}: {res.detail}{more}"
        return Result(first.name, FAIL, detail, max(x.seconds for x in results))
    if all(res.status == SKIP for res in results):
        return first
    passed = next(res for res in results if res.status == PASS)
    return Result(first.name, PASS, passed.detail, max(x.seconds for x in results))


def gather_result(ctx: Ctx, res: Result) -> Result:
    if not ctx.dist_ok or ctx.world == 1:
        return res
    import torch.distributed as dist

    everyone: list = [None] * ctx.world
    dist.all_gather_object(everyone, asdict(res), group=ctx.result_group)
    return combine([Result(**r) for r in everyone])


def setup_distributed(ctx: Ctx) -> None:
    try:
        import torch.distributed as dist

        from megarl.parallel.distributed import ParallelSizes, init_distributed

        init_distributed(ParallelSizes(), seed=1234, timeout_s=ctx.args.timeout_minutes * 60)
        ctx.dist_ok, ctx.rank, ctx.world = True, dist.get_rank(), dist.get_world_size()
        ctx.result_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=ctx.args.timeout_minutes))
    except Exception as err:  # noqa: BLE001
        ctx.dist_error = f"{type(err).__name__}: {err}"


def selected(args) -> list[Check]:
    names = [c.name for c in CHECKS]
    only = [n.strip() for n in (args.only or "").split(",") if n.strip()]
    skip = [n.strip() for n in (args.skip or "").split(",") if n.strip()]
    unknown = sorted(set(only + skip) - set(names))
    if unknown:
        raise SystemExit(f"gpu_smoke: unknown check names {unknown} (choose from {names})")
    return [c for c in CHECKS if (not only or c.name in only) and c.name not in skip]


def report(results: list[Result], ctx: Ctx) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        colour = {PASS: "green", FAIL: "bold red", SKIP: "yellow"}
        table = Table(title=f"megarl GPU smoke test (world size {ctx.world})", show_lines=False)
        for col in ("check", "status", "s", "detail"):
            table.add_column(col, overflow="fold")
        for r in results:
            table.add_row(r.name, f"[{colour[r.status]}]{r.status}[/]", f"{r.seconds:.1f}", r.detail)
        Console(width=max(120, shutil.get_terminal_size().columns)).print(table)
    except ImportError:
        pass
    for r in results:
        print(f"check {r.name}: {r.status} {r.detail}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma-separated check names to run")
    p.add_argument("--skip", default="", help="comma-separated check names to leave out")
    p.add_argument("--json", default=None, help="write the results (and environment) to this file")
    p.add_argument("--require", default="", help="optional packages that must import: te,sglang,flash-attn,apex,"
                   "flashinfer,torch_memory_saver")
    p.add_argument("--keep", action="store_true", help="keep the work directory (tiny model)")
    p.add_argument("--work-dir", default=None, help="where the tiny model is written (default: a temp dir)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing checks on every rank")
    p.add_argument("--timeout-minutes", type=int, default=10, help="collective timeout")
    p.add_argument("--tol-local", type=float, default=1e-3, help="max |logit diff|, local spec, fp32")
    p.add_argument("--tol-te", type=float, default=5e-2, help="max |logit diff|, TE spec, fp32 (TF32 GEMMs)")
    p.add_argument("--tol-train-fp32", type=float, default=1e-4, help="mean |logprob diff| forward_only vs HF, fp32")
    p.add_argument("--tol-train-bf16", type=float, default=0.1, help="mean |logprob diff| forward_only vs HF, bf16")
    p.add_argument("--tol-offload-rel", type=float, default=0.1,
                   help="|W(offloaded) - W(twin)| / |W(twin) - W(start)| after the next step")
    p.add_argument("--tol-logprob", type=float, default=0.1, help="mean |engine - trainer logprob| (bf16)")
    p.add_argument("--tol-cp", type=float, default=0.1, help="mean |CP=2 - CP=1| logits / log-probs (bf16)")
    p.add_argument("--tol-attn-fp32", type=float, default=1e-5,
                   help="relative |sdpa - blockwise| (CPU, fp32): kernel outputs, gradients, model logits and grads")
    p.add_argument("--tol-attn-bf16", type=float, default=2e-2,
                   help="relative |varlen CP chunks - float32 rows| (CUDA, bf16)")
    p.add_argument("--tol-fp8", type=float, default=0.5, help="mean |logprob diff| fp8 forward_only vs HF fp32")
    p.add_argument("--sglang-tp", type=int, default=1, help="SGLang engine TP size (ranks per engine)")
    p.add_argument("--sglang-mem-fraction", type=float, default=0.3, help="SGLang mem_fraction_static")
    p.add_argument("--sglang-arg", action="append", help="extra sglang.Engine keyword, KEY=JSON_VALUE (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine|TE) .*")
    args = parse_args(argv)
    checks = selected(args)
    # SGLang sets NCCL_CUMEM_ENABLE=0 in its processes; the trainer's communicators must match
    # (megarl's launchers export it; a bare torchrun does not)
    os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="megarl-gpu-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(args=args, work=work)
    ctx.rank = int(os.environ.get("RANK", "0"))
    results: list[Result] = []
    try:
        import torch

        ctx.cuda = torch.cuda.is_available()
        first = [c for c in checks if c.name == "imports"]
        rest = [c for c in checks if c.name != "imports"]
        if not first:  # the other checks need its environment facts
            check_imports_quiet(ctx)
        local_first = [run_one(c, ctx) for c in first]
        if any(c.name != "nccl" for c in rest):
            try:  # before torch.distributed starts: transformers' save_pretrained writes only on
                tiny_model_dir(ctx)  # rank 0 then, and every rank needs its own copy
            except Exception:  # noqa: BLE001 - the checks that need it report the error
                traceback.print_exc(file=sys.stderr)
        setup_distributed(ctx)
        results += [gather_result(ctx, r) for r in local_first]
        for check in rest:
            results.append(gather_result(ctx, run_one(check, ctx)))
    finally:
        if not args.keep and not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    code = 1 if any(r.status == FAIL for r in results) else 0
    if ctx.rank == 0:
        report(results, ctx)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"world_size": ctx.world, "cuda": ctx.cuda, "exit_code": code,
                 "results": [asdict(r) for r in results]}, indent=2))
        if args.keep:
            print(f"gpu_smoke: work directory kept: {work}")
        n = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
        print(f"gpu_smoke: {n[PASS]} passed, {n[FAIL]} failed, {n[SKIP]} skipped", flush=True)
    if ctx.dist_ok:
        from megarl.parallel.distributed import destroy_distributed

        destroy_distributed()
    return code


def check_imports_quiet(ctx: Ctx) -> None:
    try:
        check_imports(ctx)
    except Exception:  # noqa: BLE001 - only the environment facts are wanted here
        pass


if __name__ == "__main__":
    sys.exit(main())

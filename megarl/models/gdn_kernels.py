"""The math of gated delta-net layers (Qwen3-Next, Qwen3.5) on packed rows: the short causal
convolution, the gates and the gated delta rule, in plain torch, and flash-linear-attention's
kernels on CUDA.

Per value head, with the recurrent state S [d_k, d_v] zero at every sequence start
(Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks", eq. 10; transformers 5.19
`torch_recurrent_gated_delta_rule`):

    q_t, k_t <- q_t / sqrt(|q_t|^2 + 1e-6), k_t / sqrt(|k_t|^2 + 1e-6)      (L2 norm)
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = S_t^T q_t / sqrt(d_k)

with the gates of every token (`gdn_gates`): g = -exp(A_log) * softplus(a + dt_bias) (the log decay,
<= 0) and beta = sigmoid(b). Before the rule, q, k and v pass through a depthwise causal
convolution of kernel K over the sequence (`causal_conv1d_packed`), also started afresh at every
sequence boundary (zero history), then SiLU.

Two ways to compute the rule, equal up to rounding:
- `chunk_gated_delta_rule` (training, prefill): chunks of C tokens (64); within a chunk the
  updates are condensed by the UT transform (the WY representation of DeltaNet): with
  G_i = sum_{j<=i} g_j inside the chunk, D_ij = exp(G_i - G_j) for j <= i (0 above),
  A = strict_lower((beta k) k^T * D), T = (I + A)^-1,
      u = T (beta v),   w = T (beta k * exp(G)),
  and per chunk, in order (S the state entering it):
      v' = u - w S,   o = (q exp(G)) S + ((q k^T) * D) v',
      S <- exp(G_C) S + (k * exp(G_C - G))^T v'.
  Sequences of similar length are padded into batches (zeros after each sequence: a zero key
  neither reads nor writes the state, and a zero log decay keeps it) so every chunk of every
  sequence is computed at once, then one scan over the chunks.
- `recurrent_step` (decode): one token per sequence against its carried state.

On CUDA in bf16 / fp16 with flash-linear-attention installed, `select_gdn_kernel` picks "fla":
`fla.ops.gated_delta_rule.chunk_gated_delta_rule` and `fla.modules.convolution.causal_conv1d`
with `cu_seqlens` (one packed row, batch 1), both taking the same per-sequence resets. Written
against flash-linear-attention's source; verified only on GPU (`check_fla_inputs` asserts the
argument contract on CPU). Everything else runs the torch functions here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megarl.models.attention_kernels import length_groups
from megarl.models.kernel_choice import KernelChoice

GDN_KERNELS = ("auto", "torch", "fla")
CHUNK_SIZE = 64
L2NORM_EPS = 1e-6
FLA_DTYPES = (torch.bfloat16, torch.float16)
_choice = KernelChoice("gated delta-net kernel", GDN_KERNELS)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2, last dim) + eps), as flash-linear-attention and transformers compute it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta): the log decay g = -exp(A_log) * softplus(a + dt_bias) in float32 and the write
    strength beta = sigmoid(b) in b's dtype; a, b [..., heads], A_log, dt_bias [heads]."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


# ---- the short convolution -------------------------------------------------------------------

def sequence_positions(cu_seqlens: list[int], device=None) -> torch.Tensor:
    """Position of every token of a packed row within its own sequence."""
    lengths = torch.tensor([e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])], dtype=torch.long)
    starts = torch.tensor(cu_seqlens[:-1], dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return (torch.arange(int(cu_seqlens[-1])) - starts[seq]).to(device)


def causal_conv1d_packed(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: list[int],
                         positions: torch.Tensor | None = None) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of a packed row, restarted at every sequence:

        y[t, c] = silu( sum_{j=0}^{K-1} weight[c, K-1-j] * x[t-j, c] ),  x[t-j] = 0 before t's sequence

    x [T, C], weight [C, K]; computed in weight's dtype (as transformers' `causal_conv1d_fn`),
    returned in x's."""
    positions = sequence_positions(cu_seqlens, x.device) if positions is None else positions
    xw = x.to(weight.dtype)
    width = weight.shape[-1]
    y = xw * weight[:, width - 1]
    for j in range(1, width):
        shifted = F.pad(xw, (0, 0, j, 0))[: xw.shape[0]]
        y = y + shifted.masked_fill((positions < j)[:, None], 0) * weight[:, width - 1 - j]
    return F.silu(y).to(x.dtype)


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of the convolution: x [B, C] with the previous K-1 inputs state [B, C, K-1]
    -> (silu(sum(window * weight)) [B, C], the new state = the window's last K-1 inputs)."""
    window = torch.cat([state, x.to(state.dtype)[:, :, None]], dim=-1)
    y = (window.to(weight.dtype) * weight).sum(-1)
    return F.silu(y).to(x.dtype), window[:, :, 1:]


def last_inputs(x: torch.Tensor, width: int) -> torch.Tensor:
    """The convolution state after a row: its last width-1 inputs [B, C, width-1] of x [B, T, C]
    (zeros in front of a row shorter than that)."""
    tail = x[:, -(width - 1):].transpose(1, 2)
    return F.pad(tail, (width - 1 - tail.shape[-1], 0))


# ---- the gated delta rule ----------------------------------------------------------------------

def _chunked(q, k, v, g, beta, chunk: int, state):
    """The chunked rule (module doc) on padded batches: q, k [N, H, L, d_k], v [N, H, L, d_v],
    g, beta [N, H, L] in float32, L a multiple of `chunk`; q already L2-normalised and scaled.
    Returns (o [N, H, L, d_v], final state [N, H, d_k, d_v])."""
    n, h, length, dk = k.shape
    dv = v.shape[-1]
    chunks = length // chunk
    kb, vb = k * beta[..., None], v * beta[..., None]
    q, k, kb, vb = (x.reshape(n, h, chunks, chunk, x.shape[-1]) for x in (q, k, kb, vb))
    cum = g.reshape(n, h, chunks, chunk).cumsum(-1)
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(above, float("-inf")).exp()
    system = (kb @ k.transpose(-1, -2)) * decay  # its strictly lower part is A; the solve takes I + A
    u = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    if state is None:
        state = q.new_zeros(n, h, dk, dv)
    outs = []
    for i in range(chunks):
        v_new = u[:, :, i] - w[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + inner[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=2).reshape(n, h, length, dv), state


def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens: list[int], chunk_size: int = CHUNK_SIZE,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """The gated delta rule over the sequences of a packed row (module doc), chunked.

    q, k [T, H, d_k] (not yet L2-normalised; heads already repeated to the value heads), v [T, H,
    d_v], g, beta [T, H]; `cu_seqlens` the host boundaries; initial_state [N, H, d_k, d_v] per
    sequence (None: zeros). Computed in float32; returns (o [T, H, d_v] in q's dtype, the final
    states [N, H, d_k, d_v] in float32 or None)."""
    dtype, dk = q.dtype, q.shape[-1]
    q = l2norm(q.float()) * dk ** -0.5
    k, v, g, beta = l2norm(k.float()), v.float(), g.float(), beta.float()
    lengths = [e - s for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    n_seq = len(lengths)
    finals = [None] * n_seq
    outs, order = [], []
    for members in length_groups(lengths):
        padded = -(-lengths[members[0]] // chunk_size) * chunk_size
        rows = torch.cat([torch.arange(cu_seqlens[i], cu_seqlens[i + 1]) for i in members]).to(q.device)
        slots = torch.cat([j * padded + torch.arange(lengths[i]) for j, i in enumerate(members)]).to(q.device)

        def batch(x):
            flat = x.new_zeros(len(members) * padded, *x.shape[1:]).index_copy(0, slots, x[rows])
            return flat.view(len(members), padded, *x.shape[1:]).transpose(1, 2)

        s0 = None if initial_state is None else initial_state[torch.tensor(members, device=q.device)].float()
        o, s = _chunked(batch(q), batch(k), batch(v), batch(g), batch(beta), chunk_size, s0)
        outs.append(o.transpose(1, 2).reshape(len(members) * padded, *o.shape[1:2], o.shape[-1])[slots])
        order.append(rows)
        for j, i in enumerate(members):
            finals[i] = s[j]
    if outs:
        inverse = torch.empty(int(cu_seqlens[-1]), dtype=torch.long, device=q.device)
        inverse[torch.cat(order)] = torch.arange(inverse.numel(), device=q.device)
        out = torch.cat(outs)[inverse]
    else:
        out = v.new_zeros(0, *v.shape[1:])
    if not output_final_state:
        return out.to(dtype), None
    empty = q.new_zeros(q.shape[1], dk, v.shape[-1])
    finals = [f if f is not None else (empty if initial_state is None else initial_state[i].float())
              for i, f in enumerate(finals)]
    return out.to(dtype), torch.stack(finals) if finals else None


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of every sequence: q, k [B, H, d_k], v [B, H, d_v], g, beta [B, H], state
    [B, H, d_k, d_v] (float32) -> (o [B, H, d_v] in q's dtype, the new state)."""
    dtype, dk = q.dtype, q.shape[-1]
    q = l2norm(q.float()) / dk ** 0.5  # as transformers' recurrent kernel (its chunked one multiplies)
    k = l2norm(k.float())
    state = state * g.float().exp()[..., None, None]
    read = (state * k[..., None]).sum(-2)
    delta = (v.float() - read) * beta.float()[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2).to(dtype), state


# ---- kernel selection and flash-linear-attention -----------------------------------------------

def fla_functions():
    """(chunk_gated_delta_rule, causal_conv1d) of flash-linear-attention, or None where not installed."""
    try:
        from fla.modules.convolution import causal_conv1d
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        return None
    return fla_chunk, causal_conv1d


def use_gdn_kernel(name: str) -> None:
    """From now on every gated delta-net layer of this process uses `name` ("auto": `select_gdn_kernel`)."""
    _choice.use(name)


def forced_gdn_kernel(name: str):
    """Within the block, every gated delta-net layer uses `name`."""
    return _choice.forced(name)


def select_gdn_kernel(device_type: str, dtype: torch.dtype, forced: str | None = None,
                      has_fla: bool | None = None, cuda_runtime: bool | None = None) -> str:
    """"fla" on a real GPU in bf16 / fp16 with flash-linear-attention installed (its chunk kernel
    refuses float32), else "torch"; a forced "fla" that cannot run here is an error naming why."""
    forced = _choice.name if forced is None else forced
    has_fla = fla_functions() is not None if has_fla is None else has_fla
    cuda_runtime = torch.cuda.is_available() if cuda_runtime is None else cuda_runtime
    fla_ok = device_type == "cuda" and cuda_runtime and dtype in FLA_DTYPES and has_fla
    if forced == "fla" and not fla_ok:
        raise ValueError(f"gated delta-net kernel 'fla' needs CUDA, bf16/fp16 and flash-linear-attention "
                         f"(here: {device_type}, {dtype}, fla {'installed' if has_fla else 'not installed'})")
    if forced != "auto":
        return forced
    return "fla" if fla_ok else "torch"


def check_fla_inputs(q, k, v, g, beta, cu: torch.Tensor, total: int) -> None:
    """flash-linear-attention's varlen contract, asserted before the call: [1, T, H, d] q / k / v of
    one half-precision dtype, g and beta [1, T, H], int64 boundaries on q's device rising from 0 to T."""
    if q.dtype not in FLA_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"fla's gated delta rule takes bf16/fp16 q, k, v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, x, dims in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        if x.dim() != dims or x.shape[0] != 1 or x.shape[1] != total or x.shape[2] != v.shape[2]:
            raise ValueError(f"fla varlen input {name} must be [1, {total}, {v.shape[2]}, ...], got {tuple(x.shape)}")
    if cu.dtype != torch.long or cu.device != q.device or int(cu[0]) != 0 or int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens must be int64 on {q.device} from 0 to {total}, got {cu.dtype} on {cu.device}")


def fla_gated_delta_rule(q, k, v, g, beta, cu: torch.Tensor, fn=None) -> torch.Tensor:
    """The rule through flash-linear-attention's chunk kernel: packed q, k [T, H, d_k], v [T, H, d_v],
    g, beta [T, H] as one batch-1 row with `cu` (int64 on q's device); L2 norm in the kernel."""
    fn = fn or fla_functions()[0]
    args = [x.unsqueeze(0).contiguous() for x in (q, k, v, g, beta)]
    check_fla_inputs(*args, cu, q.shape[0])
    o, _ = fn(*args, scale=q.shape[-1] ** -0.5, initial_state=None, output_final_state=False,
              cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    return o[0]


def fla_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, cu: torch.Tensor, fn=None) -> torch.Tensor:
    """`causal_conv1d_packed` through flash-linear-attention: x [T, C] as one batch-1 row with `cu`."""
    fn = fn or fla_functions()[1]
    if cu.dtype != torch.long or int(cu[-1]) != x.shape[0] or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"fla causal_conv1d takes x [T, C], weight [C, K] and int64 cu_seqlens ending at T: "
                         f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, cu {cu.dtype} ending {int(cu[-1])}")
    y, _ = fn(x=x.unsqueeze(0), weight=weight, bias=None, activation="silu", cu_seqlens=cu)
    return y[0]

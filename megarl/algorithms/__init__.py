"""megarl.algorithms: the mathematics of every method in docs/algorithms.md as pure tensor functions.

No torch.distributed, no megatron. Shapes: B sequences x T response tokens, `mask` [B, T] is 1 on
tokens that count. Normalisation that must be global takes explicit `global_tokens`/`global_seqs`.
Registries map config names to functions: ADVANTAGES, POLICY_LOSSES, LOSS_AGGS, KL_PENALTIES
(`objectives.py`: GSPO, CISPO, SAPO, Clip-/KL-Cov, GMPO, GPG losses; ReMax, OPO, GPG estimators).
`offpolicy.py`: rollout importance sampling (TIS / MIS); `tppo.py`: T-PPO token filtering.
"""

from . import objectives  # registers gspo, cispo, sapo, ... and remax, opo, gpg
from .estimators import AdvantageInputs, AdvantageParams, compute_advantages
from .gae import (
    compute_egae,
    compute_gae,
    decoupled_gae,
    discounted_returns,
    egae_bootstrap,
    length_adaptive_lambda,
)
from .kl import AdaptiveKLController, FixedKLController, apply_kl_in_reward, kl_penalty
from .losses import agg_loss, entropy_from_logits, policy_loss, positive_example_nll, value_loss, vanilla_pg_loss
from .masked import (
    explained_variance,
    last_valid_index,
    masked_mean,
    masked_moments,
    masked_sum,
    masked_var,
    masked_whiten,
    masked_whiten_by_role,
    stats_from_moments,
)
from .objectives import gpg_advantages, opo_advantages, token_covariance
from .offpolicy import rollout_is_metrics, rollout_is_weights, rollout_ratio
from .outcome import (
    broadcast_to_tokens,
    group_ids,
    grpo_advantages,
    place_outcome_reward,
    reinforce_pp_advantages,
    rloo_advantages,
)
from .pairwise_pag import pag_turn_layout, pag_turn_rewards, pairwise_advantages, pairwise_reward
from .registry import ADVANTAGES, KL_PENALTIES, LOSS_AGGS, POLICY_LOSSES, Registry
from .scan import reverse_linear_scan
from .shaping import dynamic_sampling_keep, dynamic_sampling_sample_mask, overlong_filter_mask, overlong_penalty
from .tppo import staleness, staleness_histogram, tppo_masks, window_mask

__all__ = [
    "ADVANTAGES",
    "KL_PENALTIES",
    "LOSS_AGGS",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "AdvantageParams",
    "FixedKLController",
    "Registry",
    "agg_loss",
    "apply_kl_in_reward",
    "broadcast_to_tokens",
    "compute_advantages",
    "compute_egae",
    "compute_gae",
    "decoupled_gae",
    "discounted_returns",
    "dynamic_sampling_keep",
    "dynamic_sampling_sample_mask",
    "egae_bootstrap",
    "entropy_from_logits",
    "explained_variance",
    "group_ids",
    "gpg_advantages",
    "grpo_advantages",
    "kl_penalty",
    "last_valid_index",
    "length_adaptive_lambda",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "masked_whiten_by_role",
    "objectives",
    "opo_advantages",
    "overlong_filter_mask",
    "overlong_penalty",
    "pag_turn_layout",
    "pag_turn_rewards",
    "pairwise_advantages",
    "pairwise_reward",
    "place_outcome_reward",
    "policy_loss",
    "positive_example_nll",
    "reinforce_pp_advantages",
    "reverse_linear_scan",
    "rloo_advantages",
    "rollout_is_metrics",
    "rollout_is_weights",
    "rollout_ratio",
    "staleness",
    "staleness_histogram",
    "stats_from_moments",
    "token_covariance",
    "tppo_masks",
    "value_loss",
    "vanilla_pg_loss",
    "window_mask",
]

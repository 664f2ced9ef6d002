"""Critic: a GPTModel whose output layer is a scalar value head (hidden -> 1).

The head's weight is replicated on every TP rank (it is not TP-sharded: an output of width 1
cannot be split). Every TP rank sees the full hidden states (with sequence parallelism they are
gathered first), so the replicas receive identical gradients and stay equal without extra
communication. In checkpoints the weight is stored under the key `value_head.weight`, never
under the LM head's `output_layer.weight`, so an actor checkpoint cannot be loaded into it
silently; HF exports name it `score.weight` (as HF `*ForTokenClassification` does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule

VALUE_HEAD_KEY = "value_head.weight"


class ValueHead(MegatronModule):
    """Replicated linear hidden -> 1 with the call signature of megatron's output layer."""

    def __init__(self, config, seed: int | None = None):
        super().__init__(config=config)
        self.sequence_parallel = config.sequence_parallel
        gen = torch.Generator().manual_seed(0 if seed is None else seed)  # same on every TP rank
        weight = torch.randn(1, config.hidden_size, generator=gen) * config.init_method_std
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            # backward only splits the (identical) full-sequence grad back to this rank's part
            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight), None


class ValueHeadMixin:
    """Replaces a GPTModel subclass's `output_layer` by ValueHead (forward returns values [b, s, 1])
    and stores its weight under VALUE_HEAD_KEY."""

    def __init__(self, *, seed: int | None = None, **kwargs):
        if kwargs.get("share_embeddings_and_output_weights"):
            raise ValueError("a value model cannot tie its output layer to the embeddings")
        super().__init__(**kwargs)
        if self.post_process:
            self.output_layer = ValueHead(self.config, seed=seed)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        key = f"{prefix}output_layer.weight"
        if key in sd:
            sd[key].key = f"{prefix}{VALUE_HEAD_KEY}"
            sd[key].allow_shape_mismatch = False
        return sd


class ValueModel(ValueHeadMixin, GPTModel):
    """GPTModel with `output_layer` replaced by ValueHead; forward returns values [b, s, 1]."""


_VALUE_CLASSES: dict[type, type] = {}


def value_model_class(base: type) -> type:
    """`base` (a GPTModel subclass, e.g. a vision-language model class) with the value head."""
    if base not in _VALUE_CLASSES:
        _VALUE_CLASSES[base] = type(f"{base.__name__}Value", (ValueHeadMixin, base), {"__doc__": ValueHeadMixin.__doc__})
    return _VALUE_CLASSES[base]

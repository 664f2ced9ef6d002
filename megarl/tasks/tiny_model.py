"""A byte-level tokenizer and a tiny random Qwen2 model, built offline (quickstart, tests).

Tokenizer: BPE with no merges over the 256 GPT-2 byte symbols, so every byte (every ASCII
character) is one token and any UTF-8 text round-trips exactly (`decode(encode(s)) == s`).
Reloaded from a saved directory with `AutoTokenizer` (as megarl and SGLang load it), transformers
5.x builds a `Qwen2Tokenizer` (forced for model_type "qwen2"), which NFC-normalises the text
first: the ids are the same on NFC text (all ASCII, so every quickstart text), but a non-NFC
string (e + U+0301 combining acute) comes back composed (é).
Ids 0..255 are the bytes, followed by the special tokens ``<|endoftext|>`` (EOS and pad),
``<|im_start|>`` and ``<|im_end|>``. A Qwen-style chat template is attached.

Model: `transformers.Qwen2Config` from scratch; `vocab_size` is the tokenizer size rounded up
to `vocab_multiple` (like real Qwen checkpoints, whose embedding has spare rows), which keeps
vocab-parallel splits even.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_byte_tokenizer() -> Any:
    """A `PreTrainedTokenizerFast` with one token per byte plus the special tokens above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {sym: i for i, sym in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        additional_special_tokens=list(SPECIAL_TOKENS[1:]), clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _byte_of(symbol: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode: printable bytes map to themselves, others to 256+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    code = ord(symbol)
    if code in printable:
        return code
    rest = [b for b in range(256) if b not in printable]
    return rest[code - 256]


@dataclass
class TinyModelSpec:
    layers: int = 3
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 384
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    vocab_multiple: int = 64
    initializer_range: float = 0.02
    seed: int = 0


def build_tiny_qwen2(tokenizer: Any, spec: TinyModelSpec) -> Any:
    """A randomly initialised `Qwen2ForCausalLM` (fp32) sized for `tokenizer`."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError(f"tiny model: hidden {spec.hidden} must divide by heads {spec.heads}, "
                         f"and heads by kv_heads {spec.kv_heads}")
    vocab = math.ceil(len(tokenizer) / spec.vocab_multiple) * spec.vocab_multiple
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta, tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range, rms_norm_eps=1e-6, use_sliding_window=False,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )
    torch.manual_seed(spec.seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny_model(out_dir: str | Path, spec: TinyModelSpec, model: Any = None, tokenizer: Any = None) -> Path:
    """Build (unless given) and save tokenizer + model (safetensors) + generation_config."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer if tokenizer is not None else build_byte_tokenizer()
    model = model if model is not None else build_tiny_qwen2(tokenizer, spec)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out

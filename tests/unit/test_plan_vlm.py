"""megarl.planner for vision-language models: the vision tower's parameters (by hand, against HF's
models and megarl's TP layouts), the first stage carrying it, its activations and FLOPs, the image
assumptions, and the shipped VLM recipes + layouts."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

import pytest

from megarl.config import load_config
from tests.unit.test_plan import CONFIGS, hf_json, plan, plan_cli

QWEN25_VL_7B = plan.Arch.from_hf(hf_json("qwen2.5-vl-7b"))
QWEN25_VL_32B = plan.Arch.from_hf(hf_json("qwen2.5-vl-32b"))
QWEN3_VL_30B = plan.Arch.from_hf(hf_json("qwen3-vl-30b-a3b"))
VLM_MODELS = ("qwen2.5-vl-7b", "qwen2.5-vl-32b", "qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b")


# ----------------------------------------------------------------------------- tiny configs

TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
                   temporal_patch_size=2, in_channels=3, out_hidden_size=64)
TINY_TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def tiny_hf(family: str) -> dict:
    """A config.json dict of a tiny model of `family` (qwen2_5_vl: flat, as the hub files;
    qwen3_vl_moe: text_config, as Qwen3-VL's)."""
    if family == "qwen2_5_vl":
        vision = dict(TINY_VISION, window_size=16, fullatt_block_indexes=[1])
        return dict(TINY_TEXT, model_type=family, tie_word_embeddings=False, vision_config=vision,
                    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
    vision = dict(TINY_VISION, num_position_embeddings=16, deepstack_visual_indexes=[1])
    text = dict(TINY_TEXT, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True})
    return dict(model_type=family, tie_word_embeddings=False, text_config=text, vision_config=vision)


# Tiny towers by hand (c = 32, f = 48, depth 2, patch 4 x 4, temporal patch 2, m = 2, u = 4c = 128, out = 64):
#   patch embedding  c * 3*2*4*4 = 3072 (+ c bias = 3104 for Qwen3-VL), position table 16 * c = 512
#   block            qkv 3c^2 + 3c = 3168, proj c^2 + c = 1056,
#                    Qwen2.5-VL: RMSNorms 2c = 64, gate + up 2(fc + f) = 3168, down cf + c = 1568 -> 9024
#                    Qwen3-VL:   LayerNorms 4c = 128, fc1 fc + f = 1584, fc2 cf + c = 1568     -> 7504
#   merger           fc1 u^2 + u = 16512, fc2 out*u + out = 8256, norm: RMSNorm c = 32 -> 24800;
#                    LayerNorm 2c = 64 -> 24832; DeepStack LayerNorm 2u = 256 -> 25024
TINY_TOWER = {"qwen2_5_vl": 3072 + 2 * 9024 + 24800, "qwen3_vl_moe": 3104 + 512 + 2 * 7504 + 24832 + 25024}


def test_tiny_tower_counts_by_hand():
    assert TINY_TOWER == {"qwen2_5_vl": 45_920, "qwen3_vl_moe": 68_480}
    for family, expected in TINY_TOWER.items():
        assert plan.VisionTower.from_hf(tiny_hf(family)).total_params() == expected


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_tiny_vlm_param_count_matches_hf_model(family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = tiny_hf(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(
        transformers.AutoConfig.for_model(**json.loads(json.dumps(hf))))  # random weights on the CPU
    visual = sum(p.numel() for n, p in model.named_parameters() if ".visual." in n)
    arch = plan.Arch.from_hf(hf)
    assert visual == arch.vision.total_params() == TINY_TOWER[family]
    assert sum(p.numel() for p in model.parameters()) == arch.total_params()
    assert arch.total_params() - arch.lm_params() == visual


def test_vision_defaults_are_transformers_defaults():
    transformers = pytest.importorskip("transformers")
    classes = {"qwen2_5_vl": transformers.Qwen2_5_VLVisionConfig, "qwen3_vl": transformers.Qwen3VLVisionConfig,
               "qwen3_vl_moe": transformers.Qwen3VLMoeVisionConfig}
    for model_type, cls in classes.items():
        hf_default = cls()
        for key, value in plan.VISION_DEFAULTS[model_type].items():
            got = getattr(hf_default, key)
            assert (list(got) if isinstance(got, (list, tuple)) else got) == value, (model_type, key)


# ----------------------------------------------------------------------------- shipped models


# Qwen2.5-VL-7B tower by hand (c = 1280, f = 3420, 32 blocks, u = 5120, out = 3584, patch row 3*2*14*14 = 1176):
#   TP-sharded per block   qkv 3c^2 + 3c + proj c^2 + gate/up 2(fc + f) + down cf        = 19,697,080
#   replicated per block   2 RMSNorms 2c + proj and down biases 2c                           =      5,120
#   merger                 sharded u^2 + u + out*u = 44,569,600; replicated out + c        =      4,864
#   patch embedding        replicated c * 1176                                               =  1,505,280
VL7_SHARDED = 32 * 19_697_080 + 44_569_600
VL7_REPLICATED = 1_505_280 + 32 * 5_120 + 4_864


def test_qwen25_vl_7b_tower_by_hand():
    v = QWEN25_VL_7B.vision
    assert v.split_params() == (VL7_SHARDED, VL7_REPLICATED) == (674_876_160, 1_673_984)
    assert QWEN25_VL_7B.stage_vision_params(4) == VL7_SHARDED // 4 + VL7_REPLICATED == 170_393_024
    assert QWEN25_VL_7B.lm_params() == 7_615_616_512  # Qwen2.5-7B's LM, untied


def test_shipped_vlm_sizes():
    # HF's models built from these config.json files (meta device) have exactly these counts; the
    # Qwen3-VL-30B-A3B one is also the sum of the released safetensors (31,070,754,032)
    assert QWEN25_VL_7B.total_params() == 8_292_166_656
    assert QWEN25_VL_32B.total_params() == 33_452_718_336
    assert QWEN3_VL_30B.total_params() == 31_070_754_032
    assert QWEN3_VL_30B.lm_params() == 30_532_122_624  # = Qwen3-30B-A3B
    assert QWEN3_VL_30B.active_params() == 3_353_032_704  # active per LM token: the tower works per patch
    # Qwen3-VL-235B-A22B: Qwen3-235B-A22B's LM (untied) + the same 27-block tower, merging into 4096
    vl235 = plan.Arch.from_hf(hf_json("qwen3-vl-235b-a22b"))
    assert vl235.total_params() == 235_670_022_896 and vl235.lm_params() == 235_093_634_560
    # Qwen2.5-VL-32B's config.json lists 8 vision fields; depth, heads, windows come from HF's defaults
    assert (QWEN25_VL_32B.vision.depth, QWEN25_VL_32B.vision.ffn, QWEN25_VL_32B.vision.full_blocks) == (32, 3456, 4)


@pytest.mark.parametrize("name", VLM_MODELS)
def test_shipped_configs_load_in_transformers_and_match_the_planner(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = hf_json(name)
    config = transformers.AutoConfig.for_model(**json.loads(json.dumps(raw)))
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    arch = plan.Arch.from_hf(raw)
    assert sum(p.numel() for p in model.parameters()) == arch.total_params()
    assert sum(p.numel() for n, p in model.named_parameters() if ".visual." in n) == arch.vision.total_params()
    text = config.text_config
    assert (arch.layers, arch.heads, arch.kv_heads, arch.vocab) == (
        text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, text.vocab_size)


BLOCK = ("input_layernorm.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
         "self_attention.linear_proj.weight", "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight",
         "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
MERGER_MLP = ("mlp.encoder.linear_fc1.weight", "mlp.encoder.linear_fc1.bias", "mlp.encoder.linear_fc2.weight",
              "mlp.encoder.linear_fc2.bias")


def megatron_vision_names(family: str, depth: int, deepstack: int) -> list[str]:
    """Megatron names of the tower's parameters in megarl (megarl.models.vision.tower / qwen3_vl_tower)."""
    if family == "qwen2_5_vl":
        return ([f"vision_model.blocks.{i}.{s}" for i in range(depth) for s in BLOCK]
                + ["vision_model.patch_embed.proj.weight", "vision_model.merger.ln_q.weight"]
                + [f"vision_model.merger.{s}" for s in MERGER_MLP])
    block = BLOCK + ("input_layernorm.bias", "pre_mlp_layernorm.bias")
    mergers = ["merger"] + [f"deepstack_merger_list.{j}" for j in range(deepstack)]
    return ([f"vision_model.blocks.{i}.{s}" for i in range(depth) for s in block]
            + ["vision_model.patch_embed.proj.weight", "vision_model.patch_embed.proj.bias",
               "vision_model.pos_embed.weight"]
            + [f"vision_model.{m}.{s}" for m in mergers for s in ("norm.weight", "norm.bias", *MERGER_MLP)])


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl_moe"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tower_tp_shards_are_megarls(family, tp):
    """Per-GPU tower parameters = megarl's bridge layouts: `replicated` tensors whole, every other
    layout (fused_qkv, row, fc1, col) one TP-th of the HF tensor."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("megatron.core")
    if family == "qwen3_vl_moe":
        pytest.importorskip("megarl.models.vision.qwen3_vl_bridge")  # Qwen3-VL in megarl (being added)
    from megarl.models.bridge import expected_hf_shapes, map_param
    from megarl.models.families import arch_spec

    hf = tiny_hf(family)
    spec = arch_spec(transformers.AutoConfig.for_model(**json.loads(json.dumps(hf))))
    shapes = expected_hf_shapes(spec)
    tower = plan.VisionTower.from_hf(hf)
    per_gpu, hf_names = 0, set()
    for name in megatron_vision_names(family, tower.depth, tower.deepstack):
        pm = map_param(name, None, spec)
        numel = sum(math.prod(shapes[n]) for n in pm.hf_names)
        per_gpu += numel if pm.layout == "replicated" else numel // tp
        hf_names.update(pm.hf_names)
    assert hf_names == {n for n in shapes if "visual." in n}  # every tower tensor counted once
    assert tower.stage_params(tp) == per_gpu


def test_first_stage_carries_the_tower():
    a, tp = QWEN25_VL_7B, 4
    text = dataclasses.replace(a, vision=None)
    tower = a.stage_vision_params(tp)
    assert a.stage_params(tp, 1) == text.stage_params(tp, 1) + tower  # one stage holds everything
    # PP 2: the first stage = embedding + 14 layers + tower, the last = 14 layers + final norm + LM head
    h, v = a.hidden, a.vocab
    per_layer = (a.layer_params() - 2 * h) / tp + 2 * h
    first = v * h / tp + 14 * per_layer + tower
    last = 14 * per_layer + h + v * h / tp
    assert first > last and a.stage_params(tp, 2) == math.ceil(first)
    assert text.stage_params(tp, 2) == math.ceil(last)  # without the tower the last stage is the larger
    # the critic keeps the tower; its value head (h + 1) replaces the LM head on the last stage
    assert a.stage_params(tp, 2, value_head=True) == a.stage_params(tp, 2)
    assert a.stage_params(tp, 1, value_head=True) == a.stage_params(tp, 1) - v * h // tp + h + 1


def test_tower_counts_in_every_model_state():
    cfg = load_config(None, ["model.name=qwen2.5-vl-7b", "parallel.tp=4", "parallel.nodes=1", "parallel.gpus_per_node=8",
                             "algorithm.kl_coef=0.001", "critic.enable=true"])
    states = {s.role: s for s in plan.model_states(QWEN25_VL_7B, cfg, world=8)}
    text = plan.model_states(dataclasses.replace(QWEN25_VL_7B, vision=None), cfg, world=8)
    tower = 170_393_024
    for s in text:
        assert states[s.role].params_gpu == s.params_gpu + tower
        assert states[s.role].weights == 2 * (s.params_gpu + tower)
    assert states["actor"].grads == 4 * (text[0].params_gpu + tower)  # float32 gradients
    assert states["actor"].optimizer == pytest.approx(12 * (text[0].params_gpu + tower) / 2)  # DP 2
    assert states["reference"].grads == 0


def test_frozen_tower_has_no_grads_or_optimizer_state():
    from megarl.config.schema import ModelConfig

    if "freeze_vision" not in {f.name for f in dataclasses.fields(ModelConfig)}:
        pytest.skip("this schema has no model.freeze_vision")
    base = ["model.name=qwen2.5-vl-7b", "parallel.tp=4", "parallel.nodes=1", "parallel.gpus_per_node=8"]
    (trained,) = plan.model_states(QWEN25_VL_7B, load_config(None, base), world=8)
    (frozen,) = plan.model_states(QWEN25_VL_7B, load_config(None, base + ["model.freeze_vision=true"]), world=8)
    tower = QWEN25_VL_7B.stage_vision_params(4)
    assert frozen.weights == trained.weights
    assert frozen.grads == trained.grads - 4 * tower
    assert frozen.optimizer == pytest.approx(trained.optimizer - 12 * tower / 2)
    # PP 2 with a tied embedding: the last stage (LM head) is the largest once the frozen tower is
    # left out of the first stage's trained parameters
    tied = dataclasses.replace(QWEN25_VL_7B, tie_embeddings=True)
    pp2 = base + ["parallel.pp=2", "model.freeze_vision=true"]
    (state,) = plan.model_states(tied, load_config(None, pp2), world=8)
    assert state.weights == 2 * tied.stage_params(4, 2)
    assert state.grads == 4 * max(tied.stage_params(4, 2) - tower, dataclasses.replace(tied, vision=None).stage_params(4, 2))


# ----------------------------------------------------------------------------- images, activations, FLOPs


def test_image_tokens_and_patches():
    # a 512 x 512 image: sides rounded to multiples of p * m (28 -> 504 = 18 x 28; 32 -> 512 = 16 x 32)
    assert QWEN25_VL_7B.vision.image_tokens(512 * 512) == 18 * 18
    assert QWEN3_VL_30B.vision.image_tokens(512 * 512) == 16 * 16
    im = plan.image_load(QWEN25_VL_7B)
    assert (im.per_sample, im.tokens, im.patches) == (1, 324, 1296)
    assert plan.image_load(QWEN25_VL_7B, per_sample=2, tokens=100).sample_tokens == 200
    assert plan.image_load(dataclasses.replace(QWEN25_VL_7B, vision=None)) is None
    # samples of a micro-batch at the mean sample length, x images per sample; or as told
    assert im.in_microbatch(8192, 2628) == 3
    assert plan.image_load(QWEN25_VL_7B, per_sample=2).in_microbatch(8192, 2628) == 6
    assert plan.image_load(QWEN25_VL_7B, per_microbatch=10).in_microbatch(8192, 2628) == 10


# per patch, Qwen2.5-VL-7B at TP 4: 32 x (8c + (8c + 6f + 4a) / 4) + (4c + 4c/4) + 2 * 1176
#   = 32 x (10240 + (10240 + 20520 + 64) / 4) + 6400 + 2352
VL7_TP4_BYTES_PER_PATCH = 32 * (10_240 + 30_824 / 4) + 6_400 + 2_352
# per patch, Qwen3-VL-30B-A3B at TP 2: 27 x (8c + (8c + 4f + 4a) / 2) + 4 mergers x (4c + 4c/2) + 2 * 1536
VL30_TP2_BYTES_PER_PATCH = 27 * (9_216 + (9_216 + 17_216 + 64) / 2) + 4 * (4_608 + 2_304) + 3_072


def test_vision_activation_bytes_by_hand():
    assert VL7_TP4_BYTES_PER_PATCH == 583_024 and VL30_TP2_BYTES_PER_PATCH == 637_248
    cfg = load_config(None, ["model.name=qwen2.5-vl-7b", "parallel.tp=4", "model.sequence_parallel=true",
                             "model.transformer_impl=transformer_engine"])
    assert plan.vision_bytes_per_patch(QWEN25_VL_7B, cfg) == VL7_TP4_BYTES_PER_PATCH
    acts = plan.activation_bytes(QWEN25_VL_7B, cfg, "actor", patches=3888)
    text = plan.activation_bytes(dataclasses.replace(QWEN25_VL_7B, vision=None), cfg, "actor", patches=3888)
    assert acts["vision"] == 3888 * 583_024 and text["vision"] == 0
    assert acts["total"] == text["total"] + acts["vision"]
    # PP 2: the first stage holds 2 micro-batches in flight, the tower's activations too
    pp2 = load_config(None, ["model.name=qwen2.5-vl-7b", "parallel.tp=4", "parallel.pp=2", "parallel.nodes=1",
                             "model.sequence_parallel=true", "model.transformer_impl=transformer_engine"])
    assert plan.activation_bytes(QWEN25_VL_7B, pp2, "actor", patches=3888)["vision"] == 2 * 3888 * 583_024
    cfg30 = load_config(None, ["model.name=qwen3-vl-30b-a3b", "parallel.tp=2", "parallel.ep=8", "parallel.nodes=2",
                               "model.sequence_parallel=true", "model.transformer_impl=transformer_engine"])
    assert plan.vision_bytes_per_patch(QWEN3_VL_30B, cfg30) == VL30_TP2_BYTES_PER_PATCH


def recipe(model: str, algo: str = "dapo", layout: str | None = None, *overrides: str):
    paths = [os.path.join(CONFIGS, "recipes", model, f"{algo}.yaml")]
    if layout:
        paths.append(os.path.join(CONFIGS, "layouts", model, f"{layout}.yaml"))
    return load_config(paths, list(overrides))


def test_plan_counts_the_images_of_a_microbatch():
    cfg = recipe("qwen2.5-vl-7b", "dapo", "1node")
    pl = plan.plan(cfg, QWEN25_VL_7B, hf_json("qwen2.5-vl-7b"), plan.GPUS["h100"])
    # mean sample: 256 text + 324 image tokens + 2048 response = 2628 -> 8192 // 2628 = 3 samples, 3 images
    assert pl.time["avg_prompt_len"] == 580 and pl.time["avg_response_len"] == 2048
    assert pl.activations["actor"]["patches"] == 3 * 1296
    assert pl.activations["actor"]["vision"] == 3 * 1296 * VL7_TP4_BYTES_PER_PATCH
    told = plan.plan(cfg, QWEN25_VL_7B, hf_json("qwen2.5-vl-7b"), plan.GPUS["h100"],
                     images=plan.image_load(QWEN25_VL_7B, tokens=1024, per_microbatch=4))
    assert told.activations["actor"]["patches"] == 4 * 4096
    assert told.train_peak - pl.train_peak == pytest.approx((4 * 4096 - 3 * 1296) * VL7_TP4_BYTES_PER_PATCH)
    # image tokens count in data.max_prompt_len: a prompt without room for them is reported
    small = plan.plan(recipe("qwen2.5-vl-7b", "dapo", "1node", "data.max_prompt_len=300"), QWEN25_VL_7B,
                      hf_json("qwen2.5-vl-7b"), plan.GPUS["h100"])
    assert any("leaves no room for 1 x 324 image tokens" in p for p in small.problems)


def test_tower_flops_by_hand():
    v = QWEN25_VL_7B.vision
    c, f, u, out, patches = 1280, 3420, 5120, 3584, 1296
    linear = c * 1176 + 32 * (4 * c * c + 3 * f * c)  # patch embedding + 32 blocks (SwiGLU: 3 f x c matrices)
    mergers = (u * u + out * u) * patches / 4  # per merged token
    attention = 4 * patches * (4 * patches + 28 * 64) * c  # 4 full-attention blocks, 28 of 8 x 8-patch windows
    assert v.forward_flops(patches) == pytest.approx(2 * linear * patches + 2 * mergers + attention)
    cfg = recipe("qwen2.5-vl-7b", "dapo", "1node")
    images = plan.image_load(QWEN25_VL_7B)
    t = plan.step_time(cfg, QWEN25_VL_7B, plan.GPUS["h100"], 8, kv_tokens=1e6, avg_prompt_len=176,
                       avg_response_len=1500, mfu=0.5, decode_eff=0.6, gen_rounds=1, images=images)
    text = plan.step_time(cfg, dataclasses.replace(QWEN25_VL_7B, vision=None), plan.GPUS["h100"], 8, kv_tokens=1e6,
                          avg_prompt_len=176 + 324, avg_response_len=1500, mfu=0.5, decode_eff=0.6, gen_rounds=1)
    samples = 128 * 16
    assert t["train_tokens"] == text["train_tokens"] == samples * 2000  # the prompt carries the image tokens
    # the tower runs once for the old log-probs and 3 passes per epoch (never recomputed)
    assert t["train_flops"] == pytest.approx(text["train_flops"] + v.forward_flops(patches) * samples * 4)


# ----------------------------------------------------------------------------- layouts and CLI


def test_vlm_layout_set():
    names = {os.path.relpath(p, os.path.join(CONFIGS, "layouts"))
             for p in glob.glob(os.path.join(CONFIGS, "layouts", "*", "*node.yaml"))}
    assert {"qwen2.5-vl-7b/1node.yaml", "qwen2.5-vl-7b/2node.yaml", "qwen2.5-vl-32b/4node.yaml",
            "qwen2.5-vl-32b/8node.yaml", "qwen3-vl-30b-a3b/2node.yaml", "qwen3-vl-30b-a3b/4node.yaml",
            "qwen3-vl-235b-a22b/16node.yaml", "qwen3-vl-235b-a22b/32node.yaml"} <= names


@pytest.mark.parametrize("model", VLM_MODELS)
def test_vlm_layouts_fit_with_short_responses(model):
    """The peak image load: micro-batches of 100-token responses pack the most images."""
    for layout in sorted(glob.glob(os.path.join(CONFIGS, "layouts", model, "*node.yaml"))):
        for path in sorted(glob.glob(os.path.join(CONFIGS, "recipes", model, "*.yaml"))):
            cfg = load_config([path, layout])
            arch, hf, _ = plan.load_arch(cfg)
            pl = plan.plan(cfg, arch, hf, plan.GPUS["h100"], avg_response_len=100)
            assert pl.fits, f"{path} + {layout}: {pl.problems}"
            assert pl.activations["actor"]["vision"] > 0


def test_tower_tp_must_divide_heads_and_mlp():
    cfg = recipe("qwen2.5-vl-7b", "dapo", "1node", "parallel.tp=8")
    pl = plan.plan(cfg, QWEN25_VL_7B, hf_json("qwen2.5-vl-7b"), plan.GPUS["h100"])
    assert any("vision tower's num_heads=16 and intermediate_size=3420" in p for p in pl.problems)


def test_vlm_cli(capsys):
    rc, out = plan_cli(capsys, "qwen3-vl-30b-a3b", "dapo", "2node")
    assert rc == 0 and "FITS" in out and "30.53B LM + 0.54B vision tower, 3.35B active" in out
    assert "1 per sample x 256 tokens (1024 tower patches)" in out and "for 3 images = 3,072 patches" in out
    rc, out = plan_cli(capsys, "qwen2.5-vl-7b", "grpo", None, "--image-tokens", "1000", "--images-per-sample", "2",
                       "--images-per-microbatch", "4")
    assert rc == 0 and "2 per sample x 1000 tokens (4000 tower patches)" in out and "16,000 patches" in out


def test_unmodelled_vlm_is_refused():
    with pytest.raises(plan.ConfigError, match="not modelled"):
        plan.Arch.from_hf({"model_type": "llava", "vision_config": {"hidden_size": 1024}, "hidden_size": 4096,
                           "num_hidden_layers": 32, "num_attention_heads": 32, "intermediate_size": 11008,
                           "vocab_size": 32000})


def test_too_many_images_are_reported_naming_the_tower():
    # 200 images of 1296 patches in a micro-batch: 259,200 patches x 583,024 bytes = 140.7 GiB on H100
    cfg = recipe("qwen2.5-vl-7b", "dapo", "1node")
    pl = plan.plan(cfg, QWEN25_VL_7B, hf_json("qwen2.5-vl-7b"), plan.GPUS["h100"],
                   images=plan.image_load(QWEN25_VL_7B, per_microbatch=200))
    (msg,) = [p for p in pl.problems if p.startswith("train phase needs")]
    assert "vision tower 140.7 (259,200 patches)" in msg
    assert "the largest term is vision tower (140.7 GiB)" in msg and "data.max_image_tokens" in msg

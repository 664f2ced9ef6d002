"""Packing, block-causal masks, the response shift convention, DP balancing, micro-batches."""

import random

import pytest
import torch

from megarl.data import (balance_across_dp, block_causal_mask, gather_response_values, pack_prompt_response,
                         pack_sequences, response_logit_mask, scatter_response_values,
                         token_budget_microbatches, unpack)


def test_block_causal_mask_hand_written():
    T, F = True, False
    expected = torch.tensor([  # True = masked; sequences [0,2) and [2,5)
        [F, T, T, T, T],
        [F, F, T, T, T],
        [T, T, F, T, T],
        [T, T, F, F, T],
        [T, T, F, F, F],
    ])
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32))
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


def test_pack_sequences_layout():
    pb = pack_sequences([[11, 12], [21, 22, 23], [31]])
    assert pb.input_ids.tolist() == [[11, 12, 21, 22, 23, 31]]
    assert pb.position_ids.tolist() == [[0, 1, 0, 1, 2, 0]]
    assert pb.cu_seqlens.dtype == torch.int32 and pb.cu_seqlens.tolist() == [0, 2, 5, 6]
    assert pb.seq_lens == [2, 3, 1] and pb.max_seqlen == 3 and pb.total_tokens == 6
    assert pb.labels.tolist() == [[12, 0, 22, 23, 0, 0]]
    vals = torch.arange(12.0).view(6, 2)
    parts = unpack(vals, pb.cu_seqlens)
    assert [p.tolist() for p in parts] == [[[0, 1], [2, 3]], [[4, 5], [6, 7], [8, 9]], [[10, 11]]]
    with pytest.raises(ValueError, match="cu_seqlens ends at 6"):
        unpack(torch.zeros(5), pb.cu_seqlens)
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack_sequences([[1], []])


def test_response_shift_convention_hand_written():
    # seq 0: p1 p2 | r1 r2 r3  (packed 0..4); seq 1: p1 p2 p3 | r1 (packed 5..8)
    # the logits predicting r_j sit at local position P+j-2: seq0 -> 1,2,3; seq1 -> 2 (+5 = 7)
    mask = response_logit_mask([2, 3], [3, 1])
    assert mask.tolist() == [False, True, True, True, False, False, False, True, False]
    pb = pack_prompt_response([[1, 2], [5, 6, 7]], [[3, 4, 9], [8]])
    assert pb.input_ids.tolist() == [[1, 2, 3, 4, 9, 5, 6, 7, 8]]
    assert pb.response_mask.tolist() == [mask.tolist()]
    # at masked positions, the label is exactly the response token being predicted
    assert pb.labels[pb.response_mask].tolist() == [3, 4, 9, 8]
    per = gather_response_values(torch.arange(9.0), [2, 3], [3, 1])
    assert [p.tolist() for p in per] == [[1.0, 2.0, 3.0], [7.0]]
    back = scatter_response_values(per, [2, 3], [3, 1], fill=-1.0)
    assert back.tolist() == [-1, 1, 2, 3, -1, -1, -1, 7, -1]
    empty = response_logit_mask([3], [0])
    assert empty.tolist() == [False, False, False]
    with pytest.raises(ValueError):
        response_logit_mask([0], [2])


def test_packed_forward_matches_separate_forwards():
    """Packed HF forward (block mask + restarted positions) gives the same response log-probs as
    separate forwards indexed by hand: log p(r_j) = log_softmax(logits[P+j-2])[r_j]."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 1, 5)]
    responses = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (4, 2, 3)]
    pb = pack_prompt_response(prompts, responses)
    mask = block_causal_mask(pb.cu_seqlens)
    additive = torch.zeros(mask.shape).masked_fill(mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = model(input_ids=pb.input_ids, position_ids=pb.position_ids, attention_mask=additive).logits[0]
        token_lp = torch.log_softmax(logits, -1).gather(-1, pb.labels[0, :, None])[:, 0]
        packed = gather_response_values(token_lp, pb.prompt_lens, pb.response_lens)
        for p, r, got in zip(prompts, responses, packed):
            ref_logits = model(input_ids=torch.tensor([p + r])).logits[0]
            P = len(p)
            ref = torch.stack([torch.log_softmax(ref_logits[P + j - 2], -1)[r[j - 1]] for j in range(1, len(r) + 1)])
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_balance_across_dp_hand_example():
    # LPT: 10->r0, 9->r1, 8->r1 (17), 7->r0 (17), 1->r0 (tie on load and count: lower rank), 1->r1
    assert balance_across_dp([10, 9, 8, 7, 1, 1], 2) == [[0, 3, 4], [1, 2, 5]]
    assert balance_across_dp([0, 0, 0], 3) == [[0], [1], [2]]
    assert balance_across_dp([5], 2) == [[0], []]
    with pytest.raises(ValueError):
        balance_across_dp([1, -2], 2)


def test_balance_across_dp_properties():
    rng = random.Random(0)
    for _ in range(20):
        n, dp = rng.randint(1, 40), rng.randint(1, 8)
        lengths = [rng.randint(0, 100) for _ in range(n)]
        groups = balance_across_dp(lengths, dp)
        assert sorted(i for g in groups for i in g) == list(range(n))
        if n >= dp:
            assert all(groups)
        loads = [sum(lengths[i] for i in g) for g in groups]
        assert max(loads) - min(loads) <= max(lengths)  # LPT bound
        assert groups == balance_across_dp(lengths, dp)


def test_token_budget_microbatches_ffd_hand_example():
    # sorted: 9(i5) 6(i4) 5(i0) 4(i2) 3(i1) 2(i3); bins: {9}, {6,4}, {5,3,2}
    mb = token_budget_microbatches([5, 3, 4, 2, 6, 9], 10)
    assert mb == [[5], [2, 4], [0, 1, 3]] and mb.oversized == []
    mb = token_budget_microbatches([12, 3, 4], 10)
    assert mb == [[0], [1, 2]] and mb.oversized == [0]


def test_token_budget_microbatches_respects_budget():
    rng = random.Random(1)
    lengths = [rng.randint(1, 50) for _ in range(60)]
    mb = token_budget_microbatches(lengths, 64)
    assert sorted(i for b in mb for i in b) == list(range(60))
    assert all(sum(lengths[i] for i in b) <= 64 for b in mb)
    assert len(mb) <= 2 * -(-sum(lengths) // 64)  # FFD never needs more than twice the lower bound

"""Beyond data parallelism, proven (lesson 15): ring attention equals attention, and a mixture-of-experts layer
split one expert per rank -- its tokens carried by the package's all-to-all -- equals the layer in one process."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from minizero.course.harness.context_parallel import blocks, ring_attention, ring_bytes
from minizero.course.harness.expert_parallel import capacity_of, moe_in_one_process, moe_on_rank
from tests.equivalence import examples


@settings(max_examples=examples(40))
@given(ranks=st.integers(1, 5), length=st.integers(1, 13), causal=st.booleans(), batch=st.integers(1, 2),
       heads=st.integers(1, 2), dim=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_ring_attention_is_attention_and_each_rank_receives_every_other_block_once(ranks, length, causal, batch,
                                                                                    heads, dim, seed):
    """Any number of ranks, blocks uneven or empty (more ranks than tokens), causal or not: outputs and the
    gradients of q, k and v equal unsplit attention's in float64; each rank received every other rank's K and V."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    weights = torch.randn(batch, heads, length, dim, generator=g, dtype=torch.float64)
    passed = []
    got = ring_attention(q, k, v, ranks, causal, passed)
    mine = torch.autograd.grad((got * weights).sum(), (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    theirs = torch.autograd.grad((want * weights).sum(), (q, k, v))
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got - want).abs().max()
    for a, b in zip(mine, theirs, strict=True):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), (a - b).abs().max()
    received = [sum(nbytes for rank, _, nbytes in passed if rank == i) for i in range(ranks)]
    assert received == ring_bytes(batch, heads, length, dim, ranks, 8)
    sizes = [s.stop - s.start for s in blocks(length, ranks)]
    assert sum(sizes) == length and max(sizes) - min(sizes) <= 1
    assert received == [2 * batch * heads * (length - size) * dim * 8 for size in sizes]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_a_mixture_of_experts_split_one_expert_a_rank_is_the_layer_in_one_process(pools, n, factor):
    """Outputs, the tokens' gradients, each expert's (whole on its rank), the gate's (summed over ranks, as DDP would), and the
    all-to-all's bytes: 4 exchanges a step -- dispatch and combine, forward and backward -- of (N-1) chunks of
    capacity x d_model each; tokens past an expert's capacity dropped in token order, as Switch drops them."""
    tokens, d_model, hidden = 7, 3, 5
    got = pools.run(n, moe_on_rank, tokens, d_model, hidden, factor)
    want = moe_in_one_process(n, tokens, d_model, hidden, factor)
    capacity = capacity_of(tokens, n, factor)
    for r, rank in enumerate(got):
        assert torch.allclose(rank["y"], want["y"][r], rtol=1e-12, atol=1e-14), r
        assert torch.allclose(rank["x_grad"], want["x_grad"][r], rtol=1e-12, atol=1e-14), r
        assert torch.allclose(rank["w1_grad"], want["w1_grad"][r], rtol=1e-12, atol=1e-14), r
        assert torch.allclose(rank["w2_grad"], want["w2_grad"][r], rtol=1e-12, atol=1e-14), r
        assert rank["capacity"] == capacity and rank["sent"].get("all_to_all", 0) == 4 * (n - 1) * capacity * d_model * 8
    assert torch.allclose(sum(rank["gate_grad"] for rank in got), want["gate_grad"], rtol=1e-12, atol=1e-14)
    if factor == 1.0 and n > 1:  # too little room for 7 tokens an expert would be a test of nothing dropped
        assert sum(rank["dropped"] for rank in got) > 0


def test_routing_keeps_the_first_tokens_up_to_the_capacity_and_drops_the_rest():
    """Every token prefers expert 1 (the gate's column 1 dominates): the first ``capacity`` get its slots 0, 1, ...
    in token order; the rest are dropped (slot -1) -- Switch's order."""
    from minizero.course.harness.expert_parallel import route
    x = torch.ones(5, 2, dtype=torch.float64)
    gate = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]], dtype=torch.float64)
    choice, prob, slot = route(x, gate, capacity=2)
    assert choice.tolist() == [1] * 5 and slot.tolist() == [0, 1, -1, -1, -1]
    assert torch.allclose(prob, torch.softmax(torch.tensor([0.0, 6.0, 2.0], dtype=torch.float64), 0)[1].expand(5))

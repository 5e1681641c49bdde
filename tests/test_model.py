"""The course's model: shapes, causality, seed-only initialisation, parameter count."""

import math

import pytest
import torch

from utils.model import (
    GPU_EXAMPLE,
    TINY,
    ModelConfig,
    TransformerLM,
    build_model,
    count_parameters,
    flops_per_token,
    loss_fn,
    parameter_breakdown,
)


def test_logits_shape():
    model = build_model(TINY, seed=0)
    tokens = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    assert model(tokens).shape == (3, TINY.seq_len, TINY.vocab_size)
    assert model(tokens[:, :10]).shape == (3, 10, TINY.vocab_size)  # shorter sequences work too


def test_causal_a_future_token_does_not_change_earlier_logits():
    model = build_model(TINY, seed=0)
    tokens = torch.randint(0, TINY.vocab_size, (2, 32))
    changed = tokens.clone()
    changed[:, 20] = (changed[:, 20] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :20], after[:, :20], rtol=0, atol=0)
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_build_model_depends_on_its_seed_only():
    torch.manual_seed(1)
    a = build_model(TINY, seed=0)
    torch.manual_seed(12345)  # another rank: another global seed
    b = build_model(TINY, seed=0)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(a.head.weight, build_model(TINY, seed=1).head.weight)


def test_build_model_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    build_model(TINY, seed=0)
    assert torch.equal(torch.rand(3), expected), "build_model drew from the global RNG"


@pytest.mark.parametrize("config", [TINY, GPU_EXAMPLE, ModelConfig(dim=32, n_heads=2, n_layers=3, mlp_ratio=2)])
def test_parameter_count_formula(config):
    with torch.device("meta"):  # shapes only: no memory, even for the GPU-sized example
        model = TransformerLM(config)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(config)


def test_layout_the_parallel_lessons_rely_on():
    model = build_model(TINY, seed=0)
    assert len(model.blocks) == TINY.n_layers
    block = model.blocks[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert type(getattr(block.attention, name)) is torch.nn.Linear
    assert type(block.mlp.up_proj) is torch.nn.Linear and type(block.mlp.down_proj) is torch.nn.Linear
    assert model.head.weight.data_ptr() != model.token_embedding.weight.data_ptr()  # untied


def test_loss_starts_near_uniform():
    model = build_model(TINY, seed=0)
    tokens = torch.randint(0, TINY.vocab_size, (4, TINY.seq_len))
    loss = loss_fn(model(tokens), tokens)
    assert abs(loss.item() - math.log(TINY.vocab_size)) < 0.1


@pytest.mark.parametrize("config", [TINY, GPU_EXAMPLE, ModelConfig(dim=48, n_heads=3, n_layers=5, mlp_ratio=2)])
def test_parameter_breakdown_adds_up_to_the_built_model(config):
    parts = parameter_breakdown(config)
    assert sum(parts.values()) == count_parameters(config)
    if config is not GPU_EXAMPLE:  # building the large one takes a while; the formula covers it
        model = build_model(config)
        assert parts["blocks"] == sum(p.numel() for p in model.blocks.parameters())
        assert parts["final norm"] == sum(p.numel() for p in model.norm.parameters())
        assert parts["head"] == sum(p.numel() for p in model.head.parameters())


def test_flops_per_token_is_six_per_matmul_parameter_plus_attention():
    config = ModelConfig(vocab_size=10, seq_len=4, dim=8, n_heads=2, n_layers=1, mlp_ratio=4)
    matmul = 4 * 8 * 8 + 2 * 8 * 32 + 8 * 10  # q, k, v, o; up and down; the head
    assert flops_per_token(config) == 6 * matmul + 12 * 4 * 8

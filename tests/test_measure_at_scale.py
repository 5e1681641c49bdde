"""utils/measure_at_scale.py: the planner's memory against what FSDP2, DTensor and autograd allocate for the course's
model at a 70B-like size, every rank of a 64-rank job in this process (torch's fake process group, meta and fake
tensors: nothing allocated).

Model state: exact, padding included, for five layouts of 64 ranks and the first, a middle and the last stage. The
padding shows with GPT-2's vocabulary (50257 rows, which no power of two divides): FSDP2 keeps ceil(50257 / dp) rows
of the embedding and of the head on every rank. Activations: one block at width 8192 and 4096 tokens, each
recomputation mode, with and without sequence parallelism at tp = 8, counted tensor by tensor from what PyTorch's
own kernels save (the expectations below), then set beside the planner's formula.
"""

import math

import pytest

from utils import measure_at_scale as scale
from utils import planner
from utils.memory import model_state_bytes

ODD = scale.ModelShape(vocab=50257)  # the 70B-like model with GPT-2's vocabulary: FSDP2 must pad it
LAYOUTS = {  # name: (shape, dp, tp, pp, global ranks = pp x dp x tp + dp x tp + tp coordinates)
    "dp8 tp8 pp1": (scale.SEVENTY_B, 8, 8, 1, [63]),  # the last replica, the last TP shard
    "dp4 tp8 pp2": (ODD, 4, 8, 2, [0, 56]),  # stage 0 replica 0, stage 1 replica 3
    "dp16 tp4 pp1": (ODD, 16, 4, 1, [63]),
    "dp64 tp1 pp1": (ODD, 64, 1, 1, [0, 63]),  # the first and the last replica
    "dp2 tp8 pp4": (ODD, 2, 8, 4, [0, 40, 56]),  # the first stage (replica 0), a middle one and the last (replica 1)
}


@pytest.fixture(scope="module")
def state_rows():
    """Every layout's rows with AdamW (its state is the one that shows where the padding is kept and where not)."""
    return {
        name: scale.measure_model_state(shape, dp, tp, pp, ranks, optimizer="adamw")
        for name, (shape, dp, tp, pp, ranks) in LAYOUTS.items()
    }


def missing_rows(shape: scale.ModelShape, dp: int) -> int:
    """Rows of the vocabulary the last DP rank lacks against the padded shard (torch.chunk's last chunk is short)."""
    return math.ceil(shape.vocab / dp) * dp - shape.vocab


def test_parameters_and_gradients_equal_the_planners_padding_included(state_rows):
    """Every measured rank holds the planner's bytes of parameters and gradients, to the byte: FSDP2 keeps every
    shard padded to ceil(rows / dp) rows (the parameter is a view of its first rows), and its reduce-scatter writes the
    gradients into a buffer of the padded shards. The last DP rank, whose vocabulary rows are fewer, holds as much."""
    assert [row.stage for row in state_rows["dp2 tp8 pp4"]] == [0, 2, 3]
    for name, rows in state_rows.items():
        for row in rows:
            for kind in ("params", "grads"):
                assert row.measured[kind] == row.predicted[kind], f"{name} rank {row.rank} {kind}: {row.differences()}"
    first, last = state_rows["dp64 tp1 pp1"]
    assert (
        first.measured["params"] == last.measured["params"] and first.measured["optimizer"] > last.measured["optimizer"]
    )


def test_optimizer_state_is_the_unpadded_shard(state_rows):
    """AdamW's two moments are zeros_like(parameter): the local shard without FSDP2's padding. On the first replica it
    is the padded size, the planner's; on the last replica of a stage holding the embedding or the head it is smaller
    by exactly the missing vocabulary rows (2 moments x 4 bytes x rows x width, and the head's bias), which the
    comparison reports."""
    for name, rows in state_rows.items():
        shape, dp, tp, pp, _ = LAYOUTS[name]
        for row in rows:
            stage, replica = row.place[0], row.place[1]
            missing = missing_rows(shape, dp) if replica == dp - 1 else 0
            short = 2 * 4 * missing * (shape.hidden * (stage == 0) + (shape.hidden + 1) * (stage == pp - 1))
            assert row.measured["optimizer"] == row.predicted["optimizer"] - short, f"{name} rank {row.rank}"
            assert row.equal == (short == 0), f"{name} rank {row.rank}: {row.differences()}"
    assert not all(row.equal for rows in state_rows.values() for row in rows)  # some rank shows it


def test_the_derivation_is_what_a_fake_step_allocates():
    """Gradients and optimizer state derived from the parameters' storages equal those a real FSDP2 forward, backward
    and AdamW step allocates under FakeTensorMode, on the last stage's last replica (the uneven head)."""
    ran = scale.measure_model_state(ODD, 4, 1, 16, ranks=[63], optimizer="adamw", run_step=True)
    derived = scale.measure_model_state(ODD, 4, 1, 16, ranks=[63], optimizer="adamw")
    assert ran[0].measured == derived[0].measured
    assert missing_rows(ODD, 4) and ran[0].measured["params"] == ran[0].predicted["params"]


def test_a_planner_that_ignores_padding_is_caught(monkeypatch):
    """The comparison fails a planner that counts the shards unpadded (the model's parameters / dp, rounded once)."""

    def unpadded(model, layout, stage, precision="fp32", optimizer="sgd"):
        count = sum(math.prod(shape) for shape in planner.rank_parameter_shapes(model, layout.tp, layout.pp, stage))
        return model_state_bytes(count, layout.dp, layout.zero, precision, optimizer)

    monkeypatch.setattr(planner, "rank_model_state", unpadded)
    row = scale.measure_model_state(ODD, 4, 1, 16, ranks=[0])[0]
    assert not row.equal and "params" in row.differences() and "grads" in row.differences()


def whole_and_split(tp: int, sp: bool, recompute: str) -> tuple[int, int, int, int]:
    """What PyTorch saves for one course block, in s x b x h values, from its kernels' backward formulas:
    (values split over the sequence by SP, values whole on every TP rank, values split over tp by heads or columns),
    and how many LayerNorm statistics (fp32 mean and 1/std per token) are kept.
    - none: the norms' inputs (the block's input and the residual after attention: SP splits them), the norms'
      outputs as q/k/v's and up's input (DTensor's SP all-gathers them and the matmul keeps the gathered copy:
      whole), Q, K, V, the attention output, the up projection's output and GELU's output (split).
    - full: the block's input only (checkpoint keeps it).
    - selective, keeping every matmul's output: the block's input (checkpoint), Q, K, V, the attention output, up's
      output (split), and the row-parallel o and down projections' outputs before their reduction (whole).
    The attention kernel's fp32 log-sum-exp (a / tp per token) is kept in every mode but full."""
    if recompute == "full":
        return 1, 0, 0, 0
    if recompute == "selective":
        return 1, 2, 3 + 1 + 4, 0
    return (2, 2, 12, 4) if sp else (0, 4, 12, 4)


CASES = [(1, False), (8, False), (8, True)]


@pytest.fixture(scope="module")
def activation_rows():
    return {(tp, sp, mode): scale.measure_block_activations(scale.SEVENTY_B, tp, sp, mode) for tp, sp in CASES for mode
            in scale.RECOMPUTE}  # fmt: skip


@pytest.mark.parametrize("tp, sp", CASES)
@pytest.mark.parametrize("recompute", scale.RECOMPUTE)
def test_block_saves_what_the_kernels_keep(activation_rows, tp, sp, recompute):
    """The measured bytes (fp32, s = 4096, b = 1, h = 8192, a = 64) are PyTorch's saved tensors counted one by one."""
    s, h, a = 4096, 8192, 64
    by_sp, whole, split, stats = whole_and_split(tp, sp, recompute)
    tokens_here = s // (tp if sp else 1)
    expected = 4 * h * (by_sp * tokens_here + whole * s + split * s // tp) + 4 * stats * tokens_here
    expected += 4 * a // tp * s if recompute != "full" else 0
    row = activation_rows[(tp, sp, recompute)]
    assert row.measured == expected, scale.saved_tensors(row)
    assert sum(item.bytes for item in row.saved) == row.measured


@pytest.mark.parametrize(
    "case",
    [(tp, sp, mode) for tp, sp in CASES for mode in scale.RECOMPUTE],
    ids=lambda case: f"tp{case[0]}-{'sp' if case[1] else 'nosp'}-{case[2]}",
)
def test_block_activations_equal_the_planners(activation_rows, case):
    """activation_bytes_per_layer(framework="torch") + the per-layer part of omitted_activation_bytes, to the byte:
    DTensor's sequence parallelism keeps the gathered inputs of q/k/v and up, and a checkpoint policy that keeps
    every matmul's output keeps o's and down's too (the planner's torch framework); Megatron-LM's, which
    Korthikanti et al.'s Table 2 counts, re-gathers the inputs in backward and keeps the residual instead."""
    row = activation_rows[case]
    assert row.equal, f"{row.differences()}\n{scale.saved_tensors(row)}"


def test_bf16_on_a_cpu_keeps_layernorm_statistics_in_bf16():
    """The one place a CPU's kernels save other bytes than a GPU's: LayerNorm's mean and 1/std in bf16 (CUDA: fp32),
    2 norms x 2 statistics x 4096 tokens x 2 bytes fewer than the planner counts."""
    row = scale.measure_block_activations(scale.SEVENTY_B, 8, False, "none", "bf16")
    assert row.measured - row.predicted == -2 * 2 * 4096 * 2
    assert {item.dtype for item in row.saved if "native_layer_norm[" in item.name} == {"bfloat16"}


SMALL = ["--layers", "4", "--hidden", "512", "--heads", "8", "--vocab", "50257", "--seq-len", "256", "--gpus", "8"]


def test_the_command_exits_non_zero_on_a_mismatch(monkeypatch, capsys):
    """All equal (tp 1, no selective recomputation): exit 0; a planner off by one byte: exit 1, the row named."""
    args = [*SMALL, "--tp", "1", "--pp", "2", "--recompute", "none,full", "--dtype", "fp32"]
    assert scale.main(args) == 0
    assert capsys.readouterr().out.rstrip().endswith("all equal")
    real = planner.rank_model_state

    def off_by_one(*args, **kwargs):
        state = real(*args, **kwargs)
        return {**state, "params": state["params"] + 1}

    monkeypatch.setattr(planner, "rank_model_state", off_by_one)
    assert scale.main(args) == 1
    out = capsys.readouterr().out
    assert "DIFFERS: params -1 B" in out and "rows differ from the planner" in out


def test_bad_input_ends_with_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        scale.main([*SMALL, "--tp", "1", "--dp", "3"])
    assert stop.value.code == 2
    assert "is not --gpus 8" in capsys.readouterr().err.splitlines()[-1]

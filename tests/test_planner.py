"""utils/planner.py: memory from utils/memory.py and Korthikanti et al. 2022, time from the alpha-beta model, the
layouts it refuses and why, the command line, and the layouts others published."""

import json
import math
import subprocess
import sys

import pytest

from tests.launch import ROOT
from utils.memory import model_state_bytes
from utils.planner import (
    Cluster,
    Layout,
    Model,
    activation_bytes,
    activation_bytes_per_layer,
    all_gather_seconds,
    all_reduce_seconds,
    bubble_fraction,
    check_layout,
    evaluate,
    inside_one_node,
    plan,
    predict,
)

# The issue's example: a Llama-3-70B-shaped model on 8 nodes of 8 H100s.
LLAMA70 = Model(params=70e9, layers=80, hidden=8192, heads=64, vocab=128256, seq_len=4096)
H100x64 = Cluster(gpus=64, gpus_per_node=8, memory=80e9)
# GPT-3 175B and MT-NLG 530B as Korthikanti et al. 2022 (arXiv:2205.05198) run them, Table 3.
GPT3 = Model(params=175e9, layers=96, hidden=12288, heads=96, vocab=51200, seq_len=2048)
MTNLG = Model(params=530e9, layers=105, hidden=20480, heads=128, vocab=51200, seq_len=2048)


def test_model_state_is_utils_memory_for_the_stage_shard():
    for dp, tp, pp, zero in [(8, 2, 4, 0), (8, 2, 4, 1), (4, 2, 8, 2), (2, 4, 8, 3), (64, 1, 1, 3)]:
        layout = Layout(dp, tp, pp, micro_batch=1, microbatches=1024 // dp, zero=zero)
        expected = model_state_bytes(70e9 / (tp * pp), dp, zero, "mixed", "adam")
        assert predict(LLAMA70, H100x64, layout).model_state == expected
        fp32_sgd = predict(LLAMA70, H100x64, layout, precision="fp32", optimizer="sgd").model_state
        assert fp32_sgd == model_state_bytes(70e9 / (tp * pp), dp, zero, "fp32", "sgd")
    # By hand: ZeRO-3 over 2 ranks of a tp=4 x pp=8 shard, 2 + 2 + 12 bytes per parameter.
    layout = Layout(2, 4, 8, 1, 512, zero=3)
    assert sum(predict(LLAMA70, H100x64, layout).model_state.values()) == 16 * 70e9 / 32 / 2


def test_activation_formulas_are_the_papers_table_2():
    """Korthikanti et al. 2022, Table 2, evaluated by hand for GPT-3's shape (s=2048, b=1, h=12288, a=96, t=8)."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    assert 5 * a * s / h == 80  # the paper's section 4.2.2: "5as/h = 80" for GPT-3

    def per_layer(**kwargs):
        return activation_bytes_per_layer(s, b, h, a, **kwargs)

    assert per_layer() == sbh * (34 + 80)  # no parallelism
    assert per_layer(t=t) == sbh * (10 + 24 / 8 + 80 / 8)  # tensor parallel: 10 of the 34 stay whole
    assert per_layer(t=t, sequence_parallel=True) == sbh * (34 / 8 + 80 / 8)
    assert per_layer(t=t, recompute="selective") == sbh * (10 + 24 / 8)
    assert per_layer(t=t, sequence_parallel=True, recompute="selective") == sbh * 34 / 8
    assert per_layer(t=t, recompute="full") == 2 * sbh  # the table's "full activation recomputation: 2sbh"
    assert per_layer(t=t, sequence_parallel=True, recompute="full") == 2 * sbh / 8  # the input, split by SP
    with pytest.raises(ValueError):
        per_layer(recompute="some")


def test_selective_recomputation_saves_what_the_paper_says():
    """Section 4.2.2: selective recomputation saves 70% of the activation memory of GPT-3 and 65% of MT-NLG's;
    section 1: TP + SP + selective needs about 5x less than tensor parallelism alone (t = 8)."""
    for model, saving in ((GPT3, 0.70), (MTNLG, 0.65)):
        args = (model.seq_len, 1, model.hidden, model.heads)
        kept = activation_bytes_per_layer(*args, recompute="selective") / activation_bytes_per_layer(*args)
        assert round(1 - kept, 2) == saving
    tp_only = activation_bytes_per_layer(2048, 1, 12288, 96, t=8)
    present = activation_bytes_per_layer(2048, 1, 12288, 96, t=8, sequence_parallel=True, recompute="selective")
    assert tp_only / present > 5


def test_first_stage_holds_p_microbatches_under_1f1b():
    """The first of p stages holds p micro-batches of its L/p layers: L layers' worth, whatever p is."""
    s, h = GPT3.seq_len, GPT3.hidden
    sbh = s * h
    per_layer = sbh * 34 / 8  # TP + SP + selective, t = 8
    for pp in (2, 4, 8):
        layout = Layout(64 // (8 * pp), 8, pp, micro_batch=1, microbatches=64)
        embedding_masks = pp * sbh / 8  # section 4.3: sbh/t per micro-batch in flight
        assert activation_bytes(GPT3, layout) == pytest.approx(per_layer * 96 + embedding_masks, rel=1e-12)
    few = Layout(1, 8, 8, micro_batch=1, microbatches=3)  # fewer micro-batches than stages: only 3 in flight
    assert activation_bytes(GPT3, few) == pytest.approx(per_layer * 12 * 3 + 3 * sbh / 8, rel=1e-12)
    # One stage: one micro-batch at a time, plus the output layer's inputs and the fp32 logits (4sbh/t + 4sbv/t).
    single = Layout(8, 8, 1, micro_batch=1, microbatches=8)
    assert activation_bytes(GPT3, single) == pytest.approx(per_layer * 96 + sbh / 8 + 4 * sbh / 8 + 4 * s * 51200 / 8)
    # Full recomputation keeps the layer inputs and rebuilds one whole layer during backward.
    full = Layout(8, 8, 1, micro_batch=1, microbatches=8, recompute="full")
    rebuilt = sbh * (34 + 80) / 8
    assert activation_bytes(GPT3, full) == pytest.approx(2 * sbh / 8 * 96 + rebuilt + 5 * sbh / 8 + 4 * s * 51200 / 8)


def test_alpha_beta_collectives():
    """Lesson 01's ring model: all-reduce 2(n-1) alpha + 2(n-1)/n S beta; all-gather half of it."""
    size, n, bandwidth, latency = 1e9, 8, 1e11, 1e-5
    assert all_reduce_seconds(size, n, bandwidth, latency) == pytest.approx(14 * 1e-5 + 1.75 * size / bandwidth)
    assert all_gather_seconds(size, n, bandwidth, latency) == pytest.approx(7 * 1e-5 + 0.875 * size / bandwidth)
    assert all_reduce_seconds(size, 1, bandwidth, latency) == 0 == all_gather_seconds(size, 1, bandwidth, latency)


def test_bubble_and_the_terms_of_a_step():
    assert bubble_fraction(4, 12) == 3 / 15
    assert bubble_fraction(1, 7) == 0
    layout = Layout(dp=4, tp=2, pp=8, micro_batch=1, microbatches=256)
    pred = predict(LLAMA70, H100x64, layout)
    assert pred.bubble_s / (pred.compute_s + pred.tp_s + pred.bubble_s) == pytest.approx(bubble_fraction(8, 256))
    # Compute: 6 x params x tokens over every GPU at the assumed MFU, times selective recomputation's 1 + s/6h.
    tokens = 1024 * 4096
    expected = 6 * 70e9 * tokens * (1 + 4096 / (6 * 8192)) / (64 * 989e12 * 0.5)
    assert pred.compute_s == pytest.approx(expected)
    # TP: 4 all-reduces of s x b x h 16-bit values per layer per micro-batch, over NVLink.
    one = all_reduce_seconds(2 * 4096 * 8192, 2, 450e9, 5e-6)
    assert pred.tp_s == pytest.approx(80 / 8 * 256 * 4 * one)
    assert pred.step_s == pytest.approx(pred.compute_s + pred.tp_s + pred.bubble_s + pred.pp_s + pred.dp_exposed_s)
    assert pred.tokens_per_s == pytest.approx(tokens / pred.step_s)


def test_data_parallel_traffic_uses_the_slow_link_once_it_leaves_a_node():
    model = Model(params=8e9, layers=32, hidden=4096, heads=32, vocab=128256, seq_len=4096)
    layout = Layout(dp=8, tp=1, pp=1, micro_batch=1, microbatches=4, zero=1)
    grads = 2 * 8e9  # bf16 gradients of the whole model (tp = pp = 1)
    one_node = predict(model, Cluster(gpus=8, gpus_per_node=8), layout)
    two_nodes = predict(model, Cluster(gpus=8, gpus_per_node=4), layout)
    assert one_node.dp_s == pytest.approx(all_reduce_seconds(grads, 8, 450e9, 5e-6))
    assert two_nodes.dp_s == pytest.approx(all_reduce_seconds(grads, 8, 50e9, 10e-6))
    zero3 = predict(model, Cluster(gpus=8, gpus_per_node=4), Layout(8, 1, 1, 1, 4, zero=3))
    assert zero3.dp_s == pytest.approx(1.5 * two_nodes.dp_s)  # ZeRO paper: 3 transfers of the parameters, not 2
    # Only what the last micro-batch's backward (2/3 of its compute) cannot hide is added to the step.
    assert two_nodes.dp_exposed_s == pytest.approx(max(0, two_nodes.dp_s - 2 / 3 * two_nodes.compute_s / 4))


def test_groups_inside_a_node():
    assert inside_one_node(1, 8, 8) and inside_one_node(2, 4, 8) and inside_one_node(4, 2, 8)
    assert not inside_one_node(1, 16, 8)  # TP over two nodes
    assert not inside_one_node(2, 3, 8)  # groups of 6 ranks: the second one straddles ranks 6-11
    assert not inside_one_node(8, 2, 8)  # pipeline neighbours 8 ranks apart


@pytest.mark.parametrize(
    "layout, gpus, words",
    [
        (Layout(4, 2, 4, 1, 256), 64, "dp x tp x pp is not the GPU count"),
        (Layout(8, 3, 1, 1, 128), 24, "heads not divisible by tp"),
        (Layout(4, 16, 1, 1, 256), 64, "TP group crosses a node"),
        (Layout(16, 4, 1, 2, 32), 64, None),
        (Layout(8, 2, 4, 3, 42), 64, "batch does not split"),
        (Layout(1, 8, 8, 1, 1024, zero=1), 64, "ZeRO shards nothing at dp=1"),
        (Layout(8, 8, 1, 1, 128, recompute="half"), 64, "unknown recomputation"),
    ],
)
def test_refused_layouts_say_why(layout, gpus, words):
    reason = check_layout(LLAMA70, Cluster(gpus=gpus), layout, 1024)
    assert reason is None if words is None else reason.startswith(words)


def test_refused_for_the_model_shape():
    cluster = Cluster(gpus=48)
    assert check_layout(LLAMA70, cluster, Layout(16, 1, 3, 1, 64), 1024).startswith("layers not divisible by pp")
    odd_sequence = Model(70e9, 80, 8192, 64, 128256, 4098)
    assert check_layout(odd_sequence, Cluster(gpus=64), Layout(16, 4, 1, 1, 64), 1024).startswith("sequence")
    small = Cluster(gpus=64, memory=16e9)  # no 70B layout without ZeRO-3 fits 16 GB
    refused = evaluate(LLAMA70, small, Layout(8, 8, 1, 1, 128, zero=1), 1024)
    assert refused.reason.startswith("does not fit") and refused.memory > 16e9


def test_plan_ranks_runnable_layouts_and_refuses_the_rest():
    predictions = plan(LLAMA70, H100x64, 1024)
    runnable = [pred for pred in predictions if pred.fits]
    assert 0 < len(runnable) < len(predictions)
    assert predictions[: len(runnable)] == runnable  # runnable first
    speeds = [pred.tokens_per_s for pred in runnable]
    assert speeds == sorted(speeds, reverse=True)
    assert all(pred.memory <= 80e9 for pred in runnable)
    assert all(pred.layout.tp <= 8 for pred in runnable)  # no TP across the node boundary
    crossing = [pred for pred in predictions if pred.layout.tp > 8]
    assert crossing and all(pred.reason.startswith("TP group crosses a node") for pred in crossing)
    assert all(not pred.fits for pred in predictions if pred.layout.pp not in (1, 2, 4, 8, 16))  # 80 layers


def run_planner(*args):
    command = [sys.executable, "-m", "utils.planner", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


ISSUE_EXAMPLE = (
    "--params 70e9 --layers 80 --hidden 8192 --heads 64 --vocab 128256 --seq-len 4096 --global-batch 1024 "
    "--gpus 64 --gpus-per-node 8 --gpu-memory 80GB"
).split()


def test_command_line_prints_a_ranked_table():
    result = run_planner(*ISSUE_EXAMPLE, "--top", "5")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if "tokens/s" in line and "reason" in line)
    rows = [line.split() for line in lines[header + 1 : header + 6]]
    assert [row[0] for row in rows] == ["1", "2", "3", "4", "5"] and all(row[-1] == "runs" for row in rows)
    speeds = [float(row[-3].replace(",", "")) for row in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert "refused" in lines[header + 6]
    assert "TP group crosses a node" in result.stdout and "does not fit" in result.stdout
    # The same ranking as plan(), and the help states the H100 defaults.
    first = plan(LLAMA70, H100x64, 1024)[0].layout
    assert rows[0][1:8] == [str(v) for v in (first.dp, first.tp, first.pp, first.micro_batch, first.microbatches)] + [
        str(first.zero),
        first.recompute,
    ]
    assert "H100" in run_planner("--help").stdout


def test_command_line_refuses_bad_input_in_one_line():
    result = run_planner(*ISSUE_EXAMPLE[:-1], "eighty")
    assert result.returncode == 2 and "--gpu-memory" in result.stderr.splitlines()[-1]
    result = run_planner(*ISSUE_EXAMPLE, "--mfu", "1.5")
    assert result.returncode == 2 and "--mfu" in result.stderr.splitlines()[-1]


PUBLISHED = json.loads((ROOT / "notebooks" / "data" / "published_layouts.json").read_text())["layouts"]


@pytest.mark.parametrize("entry", PUBLISHED, ids=[entry["name"] for entry in PUBLISHED])
def test_published_layouts_fit_or_the_planner_says_why(entry):
    """Each published layout, on the GPUs it ran on: the planner accepts it (its predicted memory fits), or refuses
    it for a reason stated here. Where the source does not say, we assume: micro-batch 1; FSDP as ZeRO-3; selective
    recomputation (Llama 3 does not say; FlashAttention keeps no attention scores either, the same memory)."""
    model = Model(entry["params"], entry["layers"], entry["hidden"], entry["heads"], entry["vocab"], entry["seq_len"])
    cluster = Cluster(entry["gpus"], entry["gpus_per_node"], entry["gpu_memory_GB"] * 1e9)
    assert entry["dp"] * entry["tp"] * entry["pp"] == entry["gpus"]
    micro_batch = entry["micro_batch"] or 1
    microbatches = entry["global_batch"] // (entry["dp"] * micro_batch)
    assert entry["dp"] * micro_batch * microbatches == entry["global_batch"]
    zero = 3 if entry.get("data_parallel") == "FSDP" else 0
    layout = Layout(entry["dp"], entry["tp"], entry["pp"], micro_batch, microbatches, zero, "selective")
    pred = evaluate(model, cluster, layout, entry["global_batch"])
    if entry["name"].startswith("Llama 3 405B"):
        # 126 layers over 16 stages: Llama 3 took one layer off the first and the last stage; this planner
        # splits layers evenly only.
        assert pred.reason == "layers not divisible by pp (126 layers, pp=16)"
        assert predict(model, cluster, layout).memory > 0  # its memory can still be predicted, for the notebook
    else:
        assert pred.fits, pred.reason
        assert 0.25 < pred.memory / cluster.memory < 1  # a published layout uses a good part of the GPU
        assert math.isclose(pred.mfu, pred.tokens_per_s * 6 * model.params / (cluster.gpus * cluster.peak_flops))

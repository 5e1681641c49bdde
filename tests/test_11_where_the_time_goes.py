"""Lesson 11: a step's time read from its traces (TODOs 1-3), selective checkpointing under a cap (TODO 4), the
fastest configuration under a cap (TODO 5), and the lesson script's real traces at 2 ranks.

pytest tests/test_11_where_the_time_goes.py                      # the solution
pytest tests/test_11_where_the_time_goes.py --target exercises   # your exercise (make check LESSON=11)

The TODOs are checked in one process on events, intervals and tables whose answers are known (written here, and a
brute-force count on a grid for the intervals). The real runs are launched once each and shared: DDP with and
without overlap, FSDP2 with explicit prefetch, GPipe and tensor parallelism, every one profiled; their traces must
open as Chrome traces, hold gloo's work on threads of its own, and add up. No test asserts a time.
"""

import json
import random
import re
from collections import Counter

import pytest

from tests.harness.launch import ROOT, course_env, finished, fresh_folder, python, torchrun
from tests.harness.option_effects import check_shared_options, fake_wikitext
from tests.harness.todo_calls import call, prerequisites
from utils.course.lessons import load_script
from utils.course.make_exercises import handed_out
from utils.lesson_11.profiling import read_events, trace_path, training_thread

ENV = course_env(PYTHONPATH=ROOT, COURSE_NO_PROGRESS=1)
COMMON = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--batch-size", "4", "--steps", "4",
          "--optimizer", "sgd"]  # fmt: skip
RUNS = {  # name: (processes, arguments); each profiled
    "overlap": (2, ["--bucket-cap-mb", "0.01", "--autocast", "bf16"]),
    "no_overlap": (2, ["--ddp-overlap", "off", "--checkpointing", "full", "--optimizer-impl", "foreach"]),
    "fsdp": (2, ["--strategy", "fsdp", "--prefetch", "explicit", "--reshard-after-forward", "off",
                 "--checkpointing", "selective", "--optimizer-impl", "fused", "--optimizer", "adamw"]),
    "pp": (2, ["--strategy", "pp", "--microbatches", "2"]),
    "tp": (2, ["--strategy", "tp"]),
}  # fmt: skip
KIND_NAMES = ("computation", "data", "waiting", "other")  # the training thread's time: these add up to the step


def given(name: str, option: str) -> str:
    """The value RUNS[name] passes for `option`."""
    argv = RUNS[name][1]
    return argv[argv.index(option) + 1]


def script_args(argv: list):
    """The lesson's command line parsed and checked as the script does, without running it."""
    from utils.lesson_11.options import add_options, check_options
    from utils.training import base_parser, parse_args

    parser = base_parser("lesson 11", without=("--checkpoint",))
    add_options(parser)
    args = parse_args(parser, [*map(str, argv)])
    check_options(parser, args)
    return args


@pytest.fixture(scope="module")
def script(lesson):
    return load_script(lesson("11"), "lesson11_under_test")


# ---------------------------------------------------------------------------------------------------------------
# TODOs 1-5 in one process, on inputs whose answers are known
# ---------------------------------------------------------------------------------------------------------------

MAIN, GLOO = 100, 101  # the training thread and one of gloo's
EVENTS = [  # (event, its kind): what real CPU and GPU traces hold
    ({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": MAIN}, "computation"),
    ({"ph": "X", "cat": "cpu_op", "name": "aten::_fused_adamw_", "tid": MAIN}, "computation"),
    ({"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: AddmmBackward0", "tid": MAIN},
     "computation"),
    ({"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "tid": MAIN}, "waiting"),
    ({"ph": "X", "cat": "cpu_op", "name": "c10d::recv_", "tid": MAIN}, "waiting"),
    ({"ph": "X", "cat": "user_annotation", "name": "gloo:recv", "tid": MAIN}, "waiting"),
    ({"ph": "X", "cat": "cpu_op", "name": "_c10d_functional::wait_tensor", "tid": MAIN}, "waiting"),
    ({"ph": "X", "cat": "user_annotation", "name": "FSDP::post_backward_rs_wait (blocks.0)", "tid": MAIN}, "waiting"),
    ({"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "tid": GLOO}, "communication"),
    ({"ph": "X", "cat": "user_annotation", "name": "gloo:all_gather", "tid": GLOO}, "communication"),
    ({"ph": "X", "cat": "cpu_op", "name": "aten::add_", "tid": GLOO}, None),
    ({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "tid": 7}, "communication"),
    ({"ph": "X", "cat": "kernel", "name": "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", "tid": 7}, "computation"),
    ({"ph": "X", "cat": "user_annotation", "name": "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__",
      "tid": MAIN}, "data"),
    ({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "tid": MAIN}, None),
    ({"ph": "X", "cat": "user_annotation", "name": "DistributedDataParallel.forward", "tid": MAIN}, None),
    ({"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#AdamW.step", "tid": MAIN}, None),
    ({"ph": "X", "cat": "python_function", "name": "torch/nn/modules/module.py(1771): _call_impl", "tid": MAIN}, None),
    ({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "tid": MAIN}, None),
    ({"ph": "M", "name": "thread_name", "tid": GLOO}, None),
    ({"ph": "f", "cat": "fwdbwd", "name": "fwdbwd", "tid": MAIN}, None),
    # not a complete event, though its category and name are those of work: an instant has no duration to count
    ({"ph": "i", "cat": "cpu_op", "name": "c10d::allreduce_", "tid": MAIN}, None),
    ({"ph": "B", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL", "tid": 7}, None),
]  # fmt: skip


def check_todo1(script):
    for event, want in EVENTS:
        got = call(1, script.kind_of, {**event, "ts": 0.0, "dur": 1.0} if event["ph"] == "X" else event, MAIN)
        where = "the training thread" if event["tid"] == MAIN else f"thread {event['tid']}"
        assert got == want, f"TODO 1: {event['name']!r} ({event.get('cat')}, phase {event['ph']}, on {where}) is " \
                            f"{want!r}, got {got!r}"  # fmt: skip


def covered(intervals, step=0.5, limit=40) -> set:
    """Brute force: the grid points t + step/2 that some interval covers."""
    return {i for i in range(int(limit / step)) for start, end in intervals if start <= i * step + step / 2 < end}


UNIONS = [  # (intervals, their union, what this case has that the others do not: said when it fails)
    ([], [], "no interval at all"),
    ([(1, 3)], [(1, 3)], "one interval"),
    ([(5, 8), (1, 3)], [(1, 3), (5, 8)], "given out of order"),
    ([(1, 10), (2, 3), (4, 5)], [(1, 10)], "(2, 3) and (4, 5) lie inside (1, 10)"),
    ([(1, 3), (3, 4)], [(1, 4)], "(1, 3) ends where (3, 4) starts"),
    ([(1, 4), (2, 6), (5, 7), (9, 9), (12, 11)], [(1, 7)], "a chain of overlaps, and two empty intervals"),
    ([(2, 3), (2, 3), (0, 1)], [(0, 1), (2, 3)], "the same interval twice"),
    ([(0.5, 1.5), (1.25, 1.75), (3.0, 3.5)], [(0.5, 1.75), (3.0, 3.5)], "fractions of a second"),
]


def check_todo2(script):
    for intervals, want, case in UNIONS:
        given = list(intervals)
        got = call(2, script.union, given)
        assert [tuple(i) for i in got] == want, f"TODO 2: union of {intervals} ({case}) is {want}, got {got}"
        assert given == intervals, f"TODO 2: union changed its argument {intervals} into {given}"
    generator = random.Random(11)
    for _ in range(30):
        intervals = [(s, s + generator.choice([0, 0.5, 1, 2, 5])) for s in
                     (generator.randrange(0, 60) / 2 for _ in range(generator.randrange(1, 8)))]  # fmt: skip
        got = [tuple(i) for i in call(2, script.union, intervals)]
        assert covered(got) == covered(intervals), f"TODO 2: union of {intervals} covers other time: {got}"
        disjoint = all(a[1] < b[0] for a, b in zip(got, got[1:])) and all(s < e for s, e in got)
        assert disjoint, f"TODO 2: union of {intervals} must be sorted, disjoint, not touching, none empty: {got}"


INTERSECTIONS = [  # (a, b, the time covered by both, what this case has: said when it fails)
    ([], [(1, 2)], [], "one side empty"),
    ([(0, 10)], [(2, 3), (5, 6)], [(2, 3), (5, 6)], "one long interval over two short ones"),
    ([(2, 3), (5, 6)], [(0, 10)], [(2, 3), (5, 6)], "the same, the sides swapped"),
    ([(0, 4), (6, 9)], [(3, 7)], [(3, 4), (6, 7)], "one interval across two"),
    ([(0, 2)], [(2, 4)], [], "intervals that only touch"),
    ([(0, 5), (1, 2)], [(4, 8), (3, 4.5)], [(3, 5)], "each side overlapping itself"),
    ([(6, 9), (0, 4)], [(8, 12), (1, 2)], [(1, 2), (8, 9)], "each side out of order"),
]


def check_todo3(script, needs):
    needs(2)
    for a, b, want, case in INTERSECTIONS:
        got = [tuple(i) for i in call(3, script.intersection, list(a), list(b))]
        assert got == want, f"TODO 3: intersection of {a} and {b} ({case}) is {want}, got {got}"
    generator = random.Random(12)
    for _ in range(30):
        a, b = ([(s, s + generator.choice([0.5, 1, 3])) for s in (generator.randrange(0, 60) / 2 for _ in range(5))]
                for _ in range(2))  # fmt: skip
        got = [tuple(i) for i in call(3, script.intersection, a, b)]
        assert covered(got) == covered(a) & covered(b), f"TODO 3: intersection of {a} and {b} is not {got}"
    communication, computation = [(0, 4), (10, 12)], [(1, 2), (3, 11)]
    got = call(3, script.exposed, communication, computation)
    assert got == pytest.approx(3.0), (
        f"TODO 3: communication {communication}, computation {computation}: 6 s of communication, 3 of them under "
        f"computation: 3 s exposed, got {got}"
    )


MLP = {"mm": (100, 1000.0), "gelu": (40, 40.0), "norm": (20, 30.0)}
BLOCK = {"mm": (300, 3000.0), "attention": (50, 1000.0), "add": (10, 5.0)}
SAVINGS = [  # (costs {op: (bytes, FLOPs)}, cap, the ops kept, what this case has: said when it fails)
    (MLP, 1000, {"mm", "gelu", "norm"}, "a cap that holds every op"),
    (MLP, 0, set(), "a cap of nothing"),
    (MLP, 120, {"mm", "norm"}, "mm and norm together fill the cap exactly"),
    (MLP, 100, {"mm"}, "mm's bytes equal to the cap"),
    (MLP, 99, {"norm", "gelu"}, "mm, the dearest, does not fit at all"),
    (BLOCK, 310, {"attention", "add"}, "mm has the most FLOPs, attention the most FLOPs per byte"),
    (BLOCK, 350, {"attention", "mm"}, "mm has the most FLOPs, attention the most FLOPs per byte"),
    (
        {"big": (80, 8000.0), "small": (10, 10.0), "mid": (30, 900.0)},
        90,
        {"big", "small"},
        "the op of fewest bytes is the cheapest per byte",
    ),
]


def check_todo4(script):
    for costs, cap, want, case in SAVINGS:
        got = call(4, script.choose_saved, dict(costs), cap)
        assert set(got) == want, (
            f"TODO 4: with {costs} ((bytes, FLOPs) per op) and a cap of {cap} bytes ({case}), keep {sorted(want)}; "
            f"got {sorted(got)}"
        )


ROWS = [
    {"name": "baseline", "tokens_per_s": 100.0, "peak_bytes": 500},
    {"name": "compile", "tokens_per_s": 180.0, "peak_bytes": 520},
    {"name": "full checkpointing", "tokens_per_s": 80.0, "peak_bytes": 200},
    {"name": "selective", "tokens_per_s": 95.0, "peak_bytes": 300},
    {"name": "fused", "tokens_per_s": 95.0, "peak_bytes": 280},
]
CAPS = [  # (cap, the fastest row that fits, what this case has: said when it fails)
    (1000, "compile", "every row fits"),
    (520, "compile", "the fastest row's memory equal to the cap"),
    (519, "baseline", "the fastest row just over the cap"),
    (300, "fused", "selective and fused equally fast, fused in less memory"),
    (279, "full checkpointing", "only the slowest row and the smallest fit"),
    (200, "full checkpointing", "the smallest row's memory equal to the cap"),
    (199, None, "no row fits"),
]


def check_todo5(script):
    for cap, want, case in CAPS:
        got = call(5, script.fastest_under_cap, [dict(row) for row in ROWS], cap)
        name = None if got is None else got["name"]
        assert name == want, f"TODO 5: under a cap of {cap} bytes ({case}) the fastest that fits is {want}, got {name}"
    assert call(5, script.fastest_under_cap, [], 100) is None, "TODO 5: an empty table has no fastest row: None"


@pytest.fixture(scope="module")
def needs(script):
    """needs(2): skip this test, naming the TODO, while that TODO's own check fails."""
    return prerequisites(lambda todo: {1: check_todo1, 2: check_todo2, 4: check_todo4}[todo](script))


def test_todo1_kind_of_each_event(script):
    check_todo1(script)


def test_todo2_union_of_intervals(script):
    check_todo2(script)


def test_todo3_intersection_and_exposed_communication(script, needs):
    check_todo3(script, needs)


def test_todo4_selective_checkpointing_keeps_the_dearest_ops_within_the_cap(script):
    check_todo4(script)


def test_todo5_fastest_configuration_under_a_memory_cap(script):
    check_todo5(script)


# ---------------------------------------------------------------------------------------------------------------
# The lesson script's real traces, at 2 ranks (each run launched once)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (metrics, [each rank's trace events], output)."""
    tmp, done = tmp_path_factory.mktemp("lesson11"), {}

    def launch(name):
        if name not in done:
            nproc, extra = RUNS[name]
            folder = fresh_folder(tmp / name)
            args = [*COMMON, *extra, "--log-dir", folder / "runs", "--profile", folder / "traces"]
            result = torchrun(lesson("11"), nproc, args, tmp_path=folder, env=ENV, timeout=240)
            metrics = finished(result, 3)
            traces = [read_events(trace_path(folder / "traces", rank)) for rank in range(nproc)]
            done[name] = metrics, traces, result.output
        return done[name]

    return launch


def per_step(events, thread_only=True) -> Counter:
    """How many times each complete event's name occurs per recorded step (on the training thread only)."""
    thread = training_thread(events)
    steps = sum(1 for e in events if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#"))
    names = Counter(e["name"] for e in events if e.get("ph") == "X" and (not thread_only or e["tid"] == thread))
    return Counter({name: count / steps for name, count in names.items()})


@pytest.mark.parametrize("name", list(RUNS))
def test_every_rank_writes_a_trace_whose_kinds_add_up(run, name):
    """--profile: one Chrome trace per rank (what TensorBoard and Perfetto open), whatever the --strategy; the
    metrics' seconds are the script's own analysis of it; waiting, data, computation and other split the step;
    exposed communication <= communication."""
    metrics, traces, output = run(name)
    assert metrics["strategy"] == (given(name, "--strategy") if "--strategy" in RUNS[name][1] else "ddp")
    assert metrics["profile"].endswith("traces") and len(traces) == metrics["world_size"], "--profile"
    assert "traces:" in output and "rank 1:" in output, output[-2000:]
    for rank, (events, seconds) in enumerate(zip(traces, metrics["per_rank"])):
        assert any(e.get("ph") == "X" and e["name"].startswith("ProfilerStep#") for e in events), (name, rank)
        assert sum(seconds[kind] for kind in KIND_NAMES) == pytest.approx(seconds["step"], rel=1e-9), seconds
        assert all(seconds[kind] >= -1e-9 for kind in (*KIND_NAMES, "communication", "exposed_communication"))
        assert seconds["exposed_communication"] <= seconds["communication"] + 1e-9, seconds
        assert seconds["computation"] > 0 and seconds["step"] > 0, seconds
        assert seconds["peak_step_bytes"] > 0 and seconds["params"] > 0, seconds


def test_gloo_works_on_threads_of_its_own(run):
    """On the CPU a collective's work (gloo:all_reduce) runs on gloo's threads, not the training thread, which only
    hands it over (c10d::allreduce_): what the lesson's communication and waiting are built on."""
    for events, seconds in zip(run("overlap")[1], run("overlap")[0]["per_rank"]):
        thread = training_thread(events)
        work = [e for e in events if e.get("ph") == "X" and e["name"] == "gloo:all_reduce"]
        assert work and all(e["tid"] != thread for e in work), "gloo:all_reduce should run on gloo's own threads"
        assert any(e["name"] == "c10d::allreduce_" and e["tid"] == thread for e in events if e.get("ph") == "X")
        assert seconds["communication"] > 0, seconds


def test_overlap_and_buckets_change_the_all_reduces(run):
    """--ddp-overlap off: one flat all-reduce of the gradients after backward, and the loss's, per step; on, with
    --bucket-cap-mb 0.01: DDP's buckets, each its own all-reduce as soon as its gradients are ready."""
    off = [per_step(events)["c10d::allreduce_"] for events in run("no_overlap")[1]]
    on = [per_step(events)["c10d::allreduce_"] for events in run("overlap")[1]]
    assert off == [2.0, 2.0], f"--ddp-overlap off: all-reduces per step {off}, expected the gradients' and the loss's"
    assert all(count >= 4 for count in on), f"--bucket-cap-mb 0.01 on a model of ~40 k parameters: {on} per step"
    assert run("overlap")[0]["bucket_cap_mb"] == float(given("overlap", "--bucket-cap-mb"))
    assert run("no_overlap")[0]["ddp_overlap"] == given("no_overlap", "--ddp-overlap") == "off"


def test_speed_up_options_reach_the_step(run):
    """--autocast bf16 casts the weights every forward; --checkpointing full recomputes the forward in backward
    (every GELU twice); selective recomputes what TODO 4 did not keep (GELU among them);
    --optimizer-impl foreach and fused run the multi-tensor and fused kernels."""
    layers = 2
    assert run("overlap")[0]["autocast"] == given("overlap", "--autocast") == "bf16"
    assert run("no_overlap")[0]["checkpointing"] == given("no_overlap", "--checkpointing") == "full"
    assert run("fsdp")[0]["optimizer_impl"] == given("fsdp", "--optimizer-impl") == "fused"
    casts = per_step(run("overlap")[1][0])["aten::_to_copy"], per_step(run("no_overlap")[1][0])["aten::_to_copy"]
    assert casts[0] >= 6 * layers + 1 > casts[1], f"--autocast bf16: casts per step {casts[0]}, without {casts[1]}"
    gelus = per_step(run("no_overlap")[1][0])["aten::gelu"], per_step(run("overlap")[1][0])["aten::gelu"]
    assert gelus == (2 * layers, layers), f"--checkpointing full: GELUs per step {gelus[0]}, without {gelus[1]}"
    fsdp = per_step(run("fsdp")[1][0])
    assert fsdp["aten::gelu"] > layers, "--checkpointing selective: the GELUs are recomputed"
    assert per_step(run("no_overlap")[1][0])["aten::_foreach_add_"] >= 1, "--optimizer-impl foreach"
    assert fsdp["aten::_fused_adamw_"] + fsdp["aten::_fused_sgd_"] >= 1, "--optimizer-impl fused"
    assert "selective keeps ['aten.addmm', 'attention']" in run("fsdp")[2], run("fsdp")[2][-1500:]


def test_fsdp_prefetch_and_reshard_options(run):
    """--prefetch explicit: each block's forward starts gathering the next block; --reshard-after-forward off: a
    block is gathered once per step (forward), not again in backward."""
    counts = per_step(run("fsdp")[1][0])
    assert (given("fsdp", "--prefetch"), given("fsdp", "--reshard-after-forward")) == ("explicit", "off")
    assert counts["FSDP::forward_prefetch for blocks.1"] == 1, "--prefetch explicit: no forward prefetch of blocks.1"
    assert counts["FSDP::all_gather (blocks.0)"] == 1, f"--reshard-after-forward off: {counts} gathers of blocks.0"


def test_pipeline_and_tensor_parallel_traces(run):
    """GPipe with --microbatches 2: the first stage sends 2 activations and receives 2 gradients a step, on its
    training thread (gloo's point-to-point runs there: waiting). Tensor parallelism waits inside every block."""
    first = per_step(run("pp")[1][0])
    assert given("pp", "--microbatches") == "2" and run("pp")[0]["microbatches"] == 2
    assert first["c10d::send"] == 2 and first["c10d::recv_"] == 2, f"--microbatches 2: {first['c10d::send']} sends"
    assert all(seconds["waiting"] > 0 for seconds in run("pp")[0]["per_rank"])
    tp = per_step(run("tp")[1][0])
    assert tp["_c10d_functional::wait_tensor"] >= 4, "tensor parallelism: a wait per all-reduce, 4 per block"
    assert all(seconds["waiting"] > 0 for seconds in run("tp")[0]["per_rank"])


def test_compile_wraps_every_block(script):
    """--compile: every block is compiled (inductor compiles it on its first call: the notebook's benchmark runs
    it); without it, none is."""
    from utils.model import TINY, build_model

    model = script.apply_speed_ups(build_model(TINY), script_args(["--compile"]))
    assert all(block._compiled_call_impl is not None for block in model.blocks), "--compile: a block not compiled"
    plain = script.apply_speed_ups(build_model(TINY), script_args([]))
    assert all(block._compiled_call_impl is None for block in plain.blocks)


def test_checkpointing_memory_full_below_selective_below_none(script, needs):
    """A step of the course model on one process: full checkpointing holds the fewest bytes at its peak, none the
    most, selective (what TODO 4 keeps under the cap) in between; the gradients are the same."""
    import torch

    from utils.lesson_11.profiling import StepProfiler
    from utils.model import TINY, build_model, loss_fn

    needs(4)
    tokens = torch.randint(0, TINY.vocab_size, (8, TINY.seq_len + 1), generator=torch.Generator().manual_seed(0))
    peaks, gradients = {}, {}
    for how in ("none", "selective", "full"):
        args = script_args(["--checkpointing", how, "--batch-size", 8, "--seq-len", TINY.seq_len])
        model = script.apply_speed_ups(build_model(TINY), args)
        profiler = StepProfiler(None, 0, torch.device("cpu"))
        for step in (1, 2):  # the profiler measures step 2
            with profiler.step(step):
                model.zero_grad(set_to_none=True)
                loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        peaks[how], gradients[how] = profiler.peak_bytes, [p.grad.clone() for p in model.parameters()]
    assert peaks["none"] > peaks["selective"] > peaks["full"] > 0, f"TODO 4: peak bytes of a step {peaks}"
    for how in ("selective", "full"):
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(gradients[how], gradients["none"])), how


def test_shared_options_change_the_run(lesson, tmp_path):
    """Every shared option but --checkpoint (refused: this lesson saves nothing) at a value other than its default,
    on one process: the run trains like the same steps written out with PyTorch alone."""
    fake_wikitext(tmp_path / "data")
    args = [
        "--steps", 3, "--seed", 3, "--batch-size", 4, "--optimizer", "sgd", "--lr", 0.05, "--dataset", "wikitext",
        "--data-dir", tmp_path / "data", "--seq-len", 16, "--dim", 24, "--n-layers", 1, "--n-heads", 3,
        "--log-dir", tmp_path / "runs", "--log-every", 2, "--wandb", "--metrics-out", tmp_path / "metrics.json",
    ]  # fmt: skip
    result = python(lesson("11"), args, timeout=180, env=ENV)
    check_shared_options(result, order="generator")


# ---------------------------------------------------------------------------------------------------------------
# Refusals and the untouched exercise
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, words", [
    (["--prefetch", "explicit"], "argument --prefetch: only with --strategy fsdp"),
    (["--strategy", "fsdp", "--bucket-cap-mb", "1"], "argument --bucket-cap-mb: only with --strategy ddp"),
    (["--ddp-overlap", "off", "--bucket-cap-mb", "1"], "only with --ddp-overlap on"),
    (["--strategy", "tp", "--compile"], "argument --compile: only with --strategy ddp or fsdp"),
    (["--strategy", "tp", "--optimizer", "sgd", "--optimizer-impl", "fused"], "fused SGD has no DTensor version"),
    (["--strategy", "pp", "--batch-size", "6", "--microbatches", "4"], "must split into 4 equal micro-batches"),
    (["--profile", "README.md"], "argument --profile: README.md exists and is not a folder"),
])  # fmt: skip
def test_refuses_what_cannot_run_in_one_line(lesson, argv, words, capsys, tmp_path):
    module = load_script(lesson("11"), "lesson11_options")
    module.setup = lambda *a, **k: pytest.fail(f"{argv} was not refused before the process group started")
    import sys

    saved = sys.argv
    sys.argv = [str(lesson("11")), *argv, "--log-dir", str(tmp_path / "runs")]
    try:
        with pytest.raises(SystemExit) as stopped:
            module.main()
    finally:
        sys.argv = saved
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert stopped.value.code == 2 and len(lines) == 1 and words in lines[0], lines


def test_untouched_exercise_stops_at_todo1(tmp_path):
    exercise = handed_out("11_where_the_time_goes.py", tmp_path / "exercises")
    args = [*COMMON, "--log-dir", tmp_path / "runs", "--profile", tmp_path / "traces"]
    result = python(exercise, args, env=ENV, timeout=90)
    assert result.returncode == 2 and "ERROR: TODO 1: the kind of an event" in result.output, result.tail()
    assert json.loads(trace_path(tmp_path / "traces", 0).read_text())["traceEvents"], "the trace is written first"
    assert re.search(r"step\s+4\s+loss", result.output), "the untouched exercise trains like lesson 00 first"

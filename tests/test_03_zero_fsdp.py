"""Lesson 03: ZeRO-1/2/3 and FSDP2 shard the model state, and still train exactly like one process.

pytest tests/test_03_zero_fsdp.py                      # the solution
pytest tests/test_03_zero_fsdp.py --target exercises   # your exercise (make check LESSON=03)

Two kinds of checks. tests/workers/zero_edge_cases.py calls each TODO's code on its own at 3 ranks, on a model
with padding, frozen, unused and tied parameters, so a TODO is checked as soon as it is written. The lesson's
script then trains every strategy (`--strategy all`, launched once per configuration and shared by the tests);
a strategy that reaches an unfinished TODO stops on its own while the others go on, and a strategy missing from
a launch that crashed is launched alone. The model (width 27, 3 blocks: Psi = 42,295 parameters, odd) needs
padding at 2 and 4 ranks in ZeRO-1's single flat buffer, in every ZeRO-3 block and in FSDP2's 27-row parameters,
and none in the root unit at 2 ranks or in FSDP2's 32-, 108- and 256-row parameters (positions, MLP, vocabulary):
both paths run (test_the_model_needs_padding_in_some_buffers_only). Every run has a global batch of 8.
Expected bytes come from the model and the world size (or, for the bytes on the wire, from the layout the
strategy reports and that a test checks first), never from the estimate the run computed itself. TODO 8 (the
debugging lab) is checked by utils/lesson_03/lab.py at 3 ranks, against one process.
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch

from tests.harness.blame import SECONDARY, tracebacks
from tests.harness.launch import ROOT, course_env, fresh_folder, python, torchrun
from tests.harness.option_effects import check_shared_options, fake_wikitext, passed, written_out_training
from utils.course.lessons import load_script
from utils.course.make_exercises import BEGIN, END, EXERCISE, make_exercise
from utils.lesson_03.lab import failure as lab_failure
from utils.memory import model_state_bytes, padded_numel, peak_model_state_bytes
from utils.metrics import param_checksum
from utils.model import ModelConfig, build_model, count_parameters
from utils.training import DEFAULT_LR

TOLERANCE = 1e-6  # fp32, SGD: sharded and single-process runs differ only by the order of additions
ADAMW_TOLERANCE = 1e-4  # AdamW divides by sqrt(second moment): rounding differences grow; parameters, absolute
BF16_TOLERANCE = 2e-2  # bf16 keeps 8 bits of mantissa: the loss stays within 2 % of fp32's over 4 steps
CONFIG = ModelConfig(seq_len=32, dim=27, n_heads=3, n_layers=3)
MODEL = ["--dim", "27", "--n-layers", "3", "--n-heads", "3", "--seq-len", "32", "--log-every", "4"]
BUCKET_MB = 0.03  # ZeRO-2's buckets: about 7,800 fp32 gradients each, so the model's 42,295 make 6 of them
SGD = ["--optimizer", "sgd", "--momentum", "0.9", "--strategy", "all", "--steps", "4", "--bucket-cap-mb", BUCKET_MB]
ADAMW = ["--optimizer", "adamw", "--bucket-cap-mb", BUCKET_MB]
STRATEGIES = ["ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp"]
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3, "hsdp": 3}
TODO = {"ddp": None, "zero1": 2, "zero2": 3, "zero3": 6, "fsdp": 7, "hsdp": 7}  # the TODO that completes each
PSI = count_parameters(CONFIG)


def runs(folder):
    """name: (processes, arguments). The dcp runs form a chain: 4 ranks save, 2 resume and save, 1 resumes.
    "kept": HSDP as one replica of 2 shards, each unit kept gathered from its forward to its backward."""
    return {
        "one": (1, [*SGD, "--batch-size", "8"]),
        "two": (2, [*SGD, "--batch-size", "4", "--reshard-after-forward"]),  # the default, written out
        "kept": (2, ["--optimizer", "sgd", "--momentum", "0.9", "--steps", "4", "--batch-size", "4",
                     "--strategy", "hsdp", "--replicas", "1", "--no-reshard-after-forward"]),
        "four": (4, [*SGD, "--batch-size", "2"]),
        "adamw": (2, [*ADAMW, "--strategy", "all", "--batch-size", "4", "--steps", "8"]),
        "bf16": (2, [*ADAMW, "--strategy", "all", "--batch-size", "4", "--steps", "4", "--precision", "bf16"]),
        "dcp4": (4, [*ADAMW, "--strategy", "fsdp", "--batch-size", "2", "--steps", "4",
                     "--save-dcp", folder / "dcp4", "--checkpoint", folder / "full4.pt"]),
        "dcp2": (2, [*ADAMW, "--strategy", "fsdp", "--batch-size", "4", "--steps", "6",
                     "--resume", folder / "dcp4", "--save-dcp", folder / "dcp2"]),
        "dcp1": (1, [*ADAMW, "--strategy", "fsdp", "--batch-size", "8", "--steps", "8", "--resume", folder / "dcp2"]),
        "full1": (1, [*ADAMW, "--strategy", "ddp", "--batch-size", "8", "--steps", "6",
                      "--resume", folder / "full4.pt"]),
    }  # fmt: skip


def run_error(result, name: str) -> str:
    """A failed run's first error on one line: the blame when a TODO's code raised, else the error and where, with
    the likely cause when a known mistake gives it."""
    blame = result.blame()
    if blame:
        return str(blame)
    found = [(frames, error) for frames, error in tracebacks(result.output) if not any(s in error for s in SECONDARY)]
    if not found:
        return f"exit code {result.returncode}, no traceback"
    frames, error = found[0]
    where = f" ({Path(frames[-1][0]).name}:{frames[-1][1]})" if frames else ""
    cause = ""
    if name == "bf16" and "same dtype" in error:  # fp32 weights met bf16 activations inside the model
        cause = ": likely some units gather fp32 parameters in this bf16 run (each fully_shard call needs mp_policy)"
    return f"{error[:160]}{where}{cause}"


class Launches:
    """Each configuration launched once, the first time a test asks for it (and the runs it resumes from)."""

    def __init__(self, script, folder):
        self.script, self.folder, self.done = script, folder, {}

    def launch(self, name, strategy=None):
        """(Run, metrics or None, folder). strategy: launch that strategy alone instead of `--strategy all`."""
        key = (name, strategy)
        if key not in self.done:
            if name in ("dcp2", "dcp1", "full1"):
                self.launch({"dcp2": "dcp4", "dcp1": "dcp2", "full1": "dcp4"}[name])
            nproc, extra = runs(self.folder)[name]
            folder = self.folder / (f"run-{name}" if strategy is None else f"run-{name}-{strategy}")
            fresh_folder(folder)
            if strategy is not None:  # the same run, with one strategy instead of all
                at = extra.index("--strategy")
                extra = [*extra[:at], *extra[at + 2 :], "--strategy", strategy]
            if "--checkpoint" not in extra:
                extra += ["--checkpoint", folder / "model.pt"]
            metrics_path = folder / "metrics.json"
            args = [*MODEL, *extra, "--log-dir", folder / "runs", "--metrics-out", metrics_path]
            env = course_env(PYTHONPATH=ROOT)  # `import utils` also for a script outside the course (a mutant's copy)
            if nproc == 1:
                result = python(self.script, args, timeout=300, env=env)
            else:
                result = torchrun(self.script, nproc, args, timeout=300, env=env)
            metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else None
            self.done[key] = (result, metrics, folder)
        return self.done[key]

    def strategy(self, name: str, strategy: str, todo) -> dict:
        """One strategy's metrics from configuration `name` (plus world_size and the path of its weights), or a
        failure naming the TODO it stopped at, or the error its run ended with."""
        result, metrics, folder = self.launch(name)
        if metrics is None or metrics.get("strategies") is None or strategy not in metrics["strategies"]:
            result, metrics, folder = self.launch(name, strategy)  # the shared launch crashed before it: alone
            record = metrics if metrics is not None else {}
            weights = folder / "model.pt"
        else:
            record = metrics["strategies"][strategy]
            weights = folder / f"model-{strategy}.pt"
        label = f"TODO {todo}" if todo else "other check"
        if "stopped" in record:
            raise AssertionError(f"ERROR: {record['stopped']} is not done yet ({strategy} stopped there)")
        assert "bytes_per_rank" in record, (
            f"{label}: the {strategy} run failed: {run_error(result, name)}. Its last lines:\n{result.tail()}"
        )
        return {**record, "world_size": metrics["world_size"], "weights": weights}

    def partial(self, name: str, strategy: str) -> dict:
        """What a strategy reported even if it stopped at an unfinished TODO ({} if its run crashed)."""
        _, metrics, _ = self.launch(name)
        if metrics and metrics.get("strategies") and strategy in metrics["strategies"]:
            return {**metrics["strategies"][strategy], "world_size": metrics["world_size"]}
        _, metrics, _ = self.launch(name, strategy)
        return metrics or {}


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    return Launches(lesson("03"), tmp_path_factory.mktemp("lesson03"))


@pytest.fixture(scope="module")
def edge(lesson, tmp_path_factory):
    """tests/workers/zero_edge_cases.py at 3 ranks: each TODO's code called on its own, on an awkward model.
    The worker writes its report after every check: a check that hung leaves the ones before it."""
    out = tmp_path_factory.mktemp("edge") / "edge.json"
    result = torchrun(ROOT / "tests" / "workers" / "zero_edge_cases.py", 3, [lesson("03"), out], timeout=300)
    report = json.loads(out.read_text()) if out.exists() else {}
    report["tail"] = "" if result.returncode == 0 else result.tail(12)
    return report


PREREQUISITES = {"zero1": ("todo1",), "zero2": ("todo1",), "zero3": ("todo4", "todo5", "todo6")}


def edge_check(edge, key: str, todo: int) -> dict:
    """One of the worker's checks, or a failure naming the TODO it stopped at (or the earlier TODO it needs)."""
    if key not in edge:
        for needed in PREREQUISITES.get(key, ()):
            if needed in edge and ("error" in edge[needed] or "not_done" in edge[needed]):
                raise AssertionError(f"TODO {todo}: needs {needed.replace('todo', 'TODO ')} first (the worker stopped)")
        raise AssertionError(f"TODO {todo}: the edge-case worker stopped before this check:\n{edge['tail']}")
    report = edge[key]
    if "not_done" in report:
        raise AssertionError(f"ERROR: {report['not_done']} is not done yet")
    assert "error" not in report, f"TODO {todo}: {report['error']}"
    return report


def weights(record: dict) -> dict:
    return torch.load(record["weights"], weights_only=True)["model"]


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"different parameters: {sorted(a.keys() ^ b.keys())[:4]}"
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def block_and_root() -> tuple[int, int]:
    """Parameters of one block and of the rest (embeddings, final norm, head), from the model itself."""
    model = build_model(CONFIG)
    block = sum(p.numel() for p in model.blocks[0].parameters())
    return block, PSI - block * CONFIG.n_layers


def fsdp_padded(shard: int) -> int:
    """FSDP2 pads every parameter's first dimension (its rows) to a multiple of the shard ranks."""
    return sum(math.ceil(p.shape[0] / shard) * shard * p[0].numel() for p in build_model(CONFIG).parameters())


def check_layout(record: dict, n: int, todo: int, what: str):
    """ZeroOptimizer's buckets as reported: together the model, each one's [lo, hi) tiled by the ranks."""
    buckets = record["buckets"]
    assert sum(b["numel"] for b in buckets) == PSI, (
        f"TODO {todo}: the buckets hold {sum(b['numel'] for b in buckets)} parameters, the model {PSI}"
    )
    for b in buckets:
        s = math.ceil(b["numel"] / n)
        tiles = [[min(r * s, b["numel"]), min((r + 1) * s, b["numel"])] for r in range(n)]
        assert b["shard_numel"] == s and b["ranges"] == tiles, (
            f"TODO {todo}: {what} at {n} ranks: a bucket of {b['numel']} elements is owned as {b['ranges']} with "
            f"S = {b['shard_numel']}; expected S = ceil(numel / N) = {s} and ranges {tiles}"
        )
        assert b["inner_numels"] == [hi - lo for lo, hi in tiles], (
            f"TODO {todo}: {what}: the inner optimizer steps {b['inner_numels']} elements per rank, not the slices "
            f"{[hi - lo for lo, hi in tiles]}: give it flat[lo:hi] only"
        )


def zero_padded(record: dict, n: int) -> int:
    return sum(math.ceil(b["numel"] / n) * n for b in record["buckets"])


def check_bytes(record, name, optimizer, todo, padded):
    n = record["world_size"]
    shard = {"ddp": 1, "hsdp": n // 2 if n % 2 == 0 else n}.get(name, n)
    expected, got = model_state_bytes(PSI, shard, STAGE[name], "fp32", optimizer, padded), record["bytes_per_rank"]
    kind = next((k for k in expected if got.get(k) != expected[k]), "params")  # the first kind that differs
    cause = {  # the known ways to hold too much: the full tensors kept beside the shard, or no sharding at all
        expected[kind] + 4 * PSI: f": the full {kind} (4 bytes x Psi) are still held beside the shard"
        + (", likely never freed (p.grad = None) once reduce-scattered" if kind == "grads" else ""),
        4 * PSI: f": as many as one process holds, as if the {kind} were not sharded",
    }.get(got.get(kind), "")
    assert got == expected, (
        f"TODO {todo}: {name} at {n} ranks holds {got.get(kind)} bytes of {kind} on rank 0, utils.memory predicts "
        f"{expected[kind]} (stage {STAGE[name]}, sharded over {shard}, {padded} elements after padding){cause}"
    )


def zero3_padded(n: int) -> tuple[int, int, int]:
    """(all units padded, one block padded, the root padded) for the lesson's ZeRO-3 at n ranks."""
    block, root = block_and_root()
    blocks, rest = padded_numel([block], n), padded_numel([root], n)
    return blocks * CONFIG.n_layers + rest, blocks, rest


# ------------------------------------------------------------------------------------------------
# TODO 1-3: ZeroOptimizer (ZeRO-1 and ZeRO-2)
# ------------------------------------------------------------------------------------------------


def test_todo1_each_rank_owns_one_slice_of_each_bucket(edge):
    """3 ranks on the awkward model: one bucket (ZeRO-1) and one bucket per parameter (ZeRO-2's small buckets)."""
    report = edge_check(edge, "todo1", 1)
    for label, outcome in report.items():
        assert not outcome["problems"], f"TODO 1: {label}: {outcome['problems'][0]}"


@pytest.mark.parametrize("ranks", ["two", "four"])
def test_todo1_zero1_keeps_optimizer_state_for_its_shard_only(run, ranks):
    record = run.partial(ranks, "zero1")
    assert "buckets" in record, f"TODO 1: the zero1 run stopped before its optimizer was built: {record.get('stopped')}"
    n = record["world_size"]
    check_layout(record, n, 1, "zero1")
    if "stopped" not in record:  # momentum exists only after a step (TODO 2)
        check_bytes(record, "zero1", "momentum", 1, zero_padded(record, n))


def needs(todo: int, earlier: int, *checks):
    """Run TODO `earlier`'s own checks (test functions, called with their arguments bound); when one fails, TODO
    `todo`'s line waits for TODO `earlier` instead of being blamed for its mistake. An earlier TODO that is not done
    yet is left to the test's own handling (what a learner who works in order has finished still counts)."""
    try:
        for check in checks:
            check()
    except AssertionError as failure:
        if re.search(r"is not done yet|stopped before this check", str(failure)):  # not checked: nothing to blame
            return
        raise AssertionError(f"TODO {todo}: needs TODO {earlier} first (see TODO {earlier}'s own line)") from None


def needs_todo1(todo: int, edge, run=None, ranks=None):
    """ZeRO-1 and ZeRO-2 step on TODO 1's slices (one slicing mistake would otherwise fail three TODOs)."""
    checks = [lambda: test_todo1_each_rank_owns_one_slice_of_each_bucket(edge)]
    if run is not None:
        checks.append(lambda: test_todo1_zero1_keeps_optimizer_state_for_its_shard_only(run, ranks))
    needs(todo, 1, *checks)


def needs_todo2(edge, run=None, ranks=None):
    """ZeRO-2 ends its step with TODO 2's all-gather of the updated shards."""
    needs(3, 2, lambda: test_todo2_zero1_step_on_known_gradients(edge))
    if run is not None:
        needs(3, 2, lambda: test_todo2_zero1_step_matches_one_process(run, edge, ranks))
    else:
        needs(3, 2, lambda: test_todo2_zero1_matches_one_process_on_an_awkward_model(edge))


def needs_todos_4_5(edge):
    """ZeRO-3's schedule (TODO 6) runs TODO 4's gather and TODO 5's reduce-scatter."""
    needs(6, 4, lambda: test_todo4_gather_gives_the_parameters_in_the_compute_dtype(edge))
    needs(6, 5, lambda: test_todo5_reduce_gradients_returns_this_ranks_average_and_frees(edge))


def known_step(edge, stage: str, todo: int):
    """The worker's one step on known gradients: the first element that differs, on which rank, and why."""
    problems = edge_check(edge, f"step_{stage}", todo)["problems"]
    assert not problems, f"TODO {todo}: {stage}: {problems[0]}"


def test_todo2_zero1_step_on_known_gradients(edge):
    needs_todo1(2, edge)
    known_step(edge, "zero1", 2)


def test_todo3_zero2_step_on_known_gradients(edge):
    needs_todo1(3, edge)
    needs(3, 2, lambda: test_todo2_zero1_step_on_known_gradients(edge))
    known_step(edge, "zero2", 3)


@pytest.mark.parametrize("ranks", ["two", "four"])
def test_todo2_zero1_step_matches_one_process(run, edge, ranks):
    needs_todo1(2, edge, run, ranks)
    record, one = run.strategy(ranks, "zero1", 2), run.strategy("one", "ddp", None)
    n = record["world_size"]
    difference = max_difference(weights(record), weights(one))
    assert difference <= TOLERANCE, (
        f"TODO 2: after 4 SGD steps ZeRO-1 differs from one process by {difference:.1e} (expected at most "
        f"{TOLERANCE:.0e}): each rank should step its slice of the averaged gradient, then all-gather the slices"
    )
    wire, padded = record["wire_bytes_per_step"], zero_padded(record, n)
    reduced = wire["all_reduce"] + wire["reduce_scatter"]  # the lesson's all-reduce (3 Psi) or the paper's (2 Psi)
    assert reduced == 4 * padded and wire["all_gather"] == 4 * padded, (
        f"TODO 2: ZeRO-1 should reduce the padded gradient once ({4 * padded} bytes, by all-reduce or "
        f"reduce-scatter) and all-gather the parameters once ({4 * padded} bytes) per step, through the script's "
        f"counting collectives; counted {wire}"
    )


@pytest.mark.parametrize("ranks", ["two", "four"])
def test_todo3_zero2_reduce_scatters_each_bucket_during_backward(run, edge, ranks):
    needs_todo1(3, edge, run, ranks)
    needs_todo2(edge, run, ranks)
    record, one = run.strategy(ranks, "zero2", 3), run.strategy("one", "ddp", None)
    n = record["world_size"]
    check_layout(record, n, 1, "zero2")
    difference = max_difference(weights(record), weights(one))
    assert difference <= TOLERANCE, (
        f"TODO 3: after 4 SGD steps ZeRO-2 differs from one process by {difference:.1e} "
        f"(expected at most {TOLERANCE:.0e})"
    )
    padded = zero_padded(record, n)
    wire = record["wire_bytes_per_step"]
    assert wire == {"all_reduce": 0, "all_gather": 4 * padded, "reduce_scatter": 4 * padded}, (
        f"TODO 3: ZeRO-2 should reduce-scatter the gradients ({4 * padded} bytes, through the script's counting "
        f"reduce_scatter) instead of all-reducing them; counted {wire}"
    )
    check_bytes(record, "zero2", "momentum", 3, padded)
    largest = max(b["numel"] for b in record["buckets"])
    bound = peak_model_state_bytes(PSI, n, 2, "fp32", "momentum", padded, bucket_params=largest)["grads"]
    peak = record["peak_bytes_in_backward"]["grads"]
    cause = (  # every full gradient alive at once: none was released after its bucket's reduce-scatter
        f"as many as every full gradient ({4 * PSI:,}): the full gradients are likely never freed (p.grad = None) "
        "once their bucket is reduce-scattered"
        if peak >= 4 * PSI
        else "is a bucket's p.grad set to None once it is reduce-scattered?"
    )
    assert peak <= bound < 4 * PSI, (
        f"TODO 3: during backward ZeRO-2 held {peak:,} gradient bytes, more than its shards and one bucket "
        f"({bound:,}): {cause}"
    )


# ------------------------------------------------------------------------------------------------
# TODO 4-6: Zero3
# ------------------------------------------------------------------------------------------------


def test_todo4_gather_gives_the_parameters_in_the_compute_dtype(edge):
    report = edge_check(edge, "todo4", 4)
    assert "bf16_error" not in report, f"TODO 4: with compute dtype bf16: {report.get('bf16_error')}"
    for dtype in ("fp32", "bf16"):
        expected = "torch.float32" if dtype == "fp32" else "torch.bfloat16"
        assert report[f"{dtype}_dtype"] == expected, (
            f"TODO 4: with compute dtype {dtype} the gathered buffer is {report[f'{dtype}_dtype']}, expected {expected}"
        )
        assert report[f"{dtype}_max_difference"] == 0, f"TODO 4: after gather() ({dtype}) {report[f'{dtype}_problem']}"


@pytest.mark.parametrize("ranks", ["two", "four"])
def test_todo4_zero3_first_step_loss_equals_ddps(run, edge, ranks):
    """The forward runs on gathered parameters: its loss must be DDP's (same weights, same batch)."""
    needs(4, 6, lambda: test_todo6_schedule_gathers_before_and_frees_after(edge))  # the runs use TODO 6's schedule
    zero3, ddp = run.partial(ranks, "zero3"), run.strategy(ranks, "ddp", None)
    if "first_loss" not in zero3:  # the forward needs TODO 6 too: until it runs, TODO 4's own check only
        test_todo4_gather_gives_the_parameters_in_the_compute_dtype(edge)
        return
    assert zero3["first_loss"] == pytest.approx(ddp["first_loss"], rel=TOLERANCE), (
        f"TODO 4: ZeRO-3's first loss {zero3['first_loss']:.6f} differs from DDP's {ddp['first_loss']:.6f} on the "
        "same weights and batch: the gathered parameters are not the model's"
    )


def test_todo4_zero3_gathers_in_bf16(run, edge):
    """--precision bf16: the all-gathers move 2 bytes per parameter (the shards stay fp32)."""
    needs(4, 6, lambda: test_todo6_schedule_gathers_before_and_frees_after(edge))  # how often it gathers: TODO 6
    record = run.partial("bf16", "zero3")
    if "wire_bytes_per_step" not in record:  # a step needs TODOs 5 and 6 too: until then, TODO 4's own check
        test_todo4_gather_gives_the_parameters_in_the_compute_dtype(edge)
        return
    n = record["world_size"]
    total, blocks, root = zero3_padded(n)
    expected = 2 * (2 * blocks * CONFIG.n_layers + root)
    assert record["wire_bytes_per_step"]["all_gather"] == expected, (
        f"TODO 4: in bf16 ZeRO-3 should all-gather {expected:,} bytes per step (2 per parameter), not "
        f"{record['wire_bytes_per_step']['all_gather']:,}: all-gather the shard cast to the compute dtype"
    )


def test_todo5_reduce_gradients_returns_this_ranks_average_and_frees(edge):
    report = edge_check(edge, "todo5", 5)
    for dtype, outcome in report.items():
        assert "error" not in outcome, f"TODO 5: from {dtype} gradients: {outcome.get('error')}"
        assert outcome["shape"] == outcome["expected_shape"] and outcome["dtype"] == "torch.float32", (
            f"TODO 5: from {dtype} gradients reduce_gradients returned {outcome['dtype']} of shape {outcome['shape']}, "
            f"expected float32 of shape {outcome['expected_shape']} (this rank's S elements, reduced in fp32)"
        )
        assert outcome["max_difference"] <= TOLERANCE, f"TODO 5: reduce_gradients ({dtype}): {outcome['problem']}"
        assert outcome["freed"], (
            f"TODO 5: after reduce_gradients ({dtype}) the unit's gathered parameters are still allocated; expected "
            "them freed (backward is done with them)"
        )
        assert not outcome.get("still_awaiting", False), (
            f"TODO 5: after reduce_gradients ({dtype}) the unit still awaits gradients, expected it done: the end of "
            "backward would reduce-scatter zeros for it a second time"
        )


def test_todo5_backward_holds_at_most_the_root_and_one_block(edge):
    """The freeing check: during backward, each unit is freed once its gradients are reduce-scattered."""
    schedule = edge.get("todo6", {})
    report = schedule.get("reshard_True")
    if report is None or report["after_forward"] != report["expected_after_forward"]:
        test_todo5_reduce_gradients_returns_this_ranks_average_and_frees(edge)  # TODO 6's test names its problem
        return
    assert report["peak_in_backward"] <= report["root_plus_one_unit"], (
        f"TODO 5: {report['peak_in_backward']} bytes were gathered at once during backward, more than the root and "
        f"one unit ({report['root_plus_one_unit']}): free the unit in reduce_gradients"
    )


@pytest.mark.parametrize("ranks", ["two", "four"])
def test_todo5_zero3_first_step_gradients_equal_ddps(run, edge, ranks):
    """Checked once the forward is right (TODO 4's loss check) and zero3 finishes a step."""
    zero3, ddp = run.partial(ranks, "zero3"), run.strategy(ranks, "ddp", None)
    if "first_gradients" not in zero3 or zero3.get("first_loss") != pytest.approx(ddp["first_loss"], rel=TOLERANCE):
        test_todo5_reduce_gradients_returns_this_ranks_average_and_frees(edge)  # TODO 5's own check only
        return
    worst = max(zero3["first_gradients"], key=lambda k: abs(zero3["first_gradients"][k] - ddp["first_gradients"][k]))
    ours, theirs = zero3["first_gradients"][worst], ddp["first_gradients"][worst]
    assert ours == pytest.approx(theirs, rel=1e-5), (
        f"TODO 5: after the first backward the squared norm of {worst}'s averaged gradient is {ours:.6e} with "
        f"ZeRO-3, {theirs:.6e} with DDP: reduce-scatter with the average (not the sum) into the owner's shard"
    )


def test_todo6_schedule_gathers_before_and_frees_after(edge):
    """One step: after forward only the root stays gathered (reshard_after_forward) or every unit does (without);
    blocks are all-gathered twice (forward, backward) or once; nothing stays gathered after backward."""
    needs_todos_4_5(edge)
    report = edge_check(edge, "todo6", 6)
    assert "error" not in report, f"TODO 6: {report.get('error')}"
    for mode, outcome in report.items():
        after, expected = outcome["after_forward"], outcome["expected_after_forward"]
        cause = (  # compared with what the units that ran hold gathered: all of them, or none
            "every unit that ran stays gathered: no unit is freed after its forward"
            if after == outcome["expected_in_forward"]
            else "nothing stays gathered: the root is freed too, and backward gathers it again at once"
            if after == 0
            else "each unit whose self.reshards(unit) is true is freed after its forward"
        )
        assert after == expected, (
            f"TODO 6 ({mode}): {after} bytes stay gathered after forward, expected {expected}: {cause}"
        )
        assert outcome["all_gather"] == outcome["expected_all_gather"], (
            f"TODO 6 ({mode}): one step all-gathered {outcome['all_gather']} bytes, expected "
            f"{outcome['expected_all_gather']}: hook each output so backward gathers a freed unit again"
        )
        assert outcome["after_backward"] == 0, f"TODO 6 ({mode}): parameters stay gathered after backward"


@pytest.mark.parametrize("ranks", ["two", "four"])
def test_todo6_zero3_matches_one_process_and_shards(run, edge, ranks):
    needs_todos_4_5(edge)
    record, one = run.strategy(ranks, "zero3", 6), run.strategy("one", "ddp", None)
    n = record["world_size"]
    total, blocks, root = zero3_padded(n)
    wire = record["wire_bytes_per_step"]
    expected = {"all_reduce": 0, "all_gather": 4 * (2 * blocks * CONFIG.n_layers + root), "reduce_scatter": 4 * total}
    assert wire == expected, (
        f"TODO 6: ZeRO-3 should all-gather each block before its forward and again before its backward, the root "
        f"once, and reduce-scatter every gradient: {expected}, not {wire}"
    )
    check_bytes(record, "zero3", "momentum", 6, total)
    if all("not_done" not in edge[k] and "error" not in edge[k] for k in ("todo4", "todo5")):
        difference = max_difference(weights(record), weights(one))
        assert difference <= TOLERANCE, f"TODO 6: after 4 SGD steps ZeRO-3 differs from one process by {difference:.1e}"
    peak = record["peak_bytes_in_backward"]["params"]
    expected_peak = peak_model_state_bytes(PSI, n, 3, "fp32", "momentum", total, gathered_params=root + blocks)
    assert peak == expected_peak["params"], (
        f"TODO 6: during backward ZeRO-3 held {peak:,} parameter bytes, expected its shards and the root and one "
        f"block gathered ({expected_peak['params']:,})"
    )


def awkward_model_matches_one_process(edge, stage, todo):
    """3 ranks (nothing divides by 3), a frozen layer, an unused layer, a block never called, a shared layer;
    ZeRO-2 with one bucket per parameter (so the unused parameter's bucket waits for the step)."""
    outcome = edge_check(edge, stage, todo)
    assert not outcome["names_differ"], f"TODO {todo}: {stage}'s state has other names: {outcome['names_differ']}"
    assert outcome["max_difference"] <= TOLERANCE, (
        f"TODO {todo}: {stage} differs from one process by {outcome['max_difference']:.1e} on a model with "
        "padding, a frozen, an unused and a shared layer"
    )


def test_todo2_zero1_matches_one_process_on_an_awkward_model(edge):
    needs_todo1(2, edge)
    awkward_model_matches_one_process(edge, "zero1", 2)


def test_todo3_zero2_matches_one_process_on_an_awkward_model(edge):
    needs_todo1(3, edge)
    needs_todo2(edge)
    awkward_model_matches_one_process(edge, "zero2", 3)


def test_todo6_zero3_matches_one_process_on_an_awkward_model(edge):
    needs_todos_4_5(edge)
    awkward_model_matches_one_process(edge, "zero3", 6)


# ------------------------------------------------------------------------------------------------
# TODO 7: FSDP2 and HSDP
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fsdp", "hsdp"])
@pytest.mark.parametrize("ranks", ["two", "four"])
def test_todo7_fsdp2_matches_one_process_and_shards(run, ranks, name):
    record, one = run.strategy(ranks, name, 7), run.strategy("one", "ddp", None)
    difference = max_difference(weights(record), weights(one))
    assert difference <= TOLERANCE, f"TODO 7: {name} differs from one process by {difference:.1e}"
    n = record["world_size"]
    shard = n if name == "fsdp" else n // 2
    check_bytes(record, name, "momentum", 7, fsdp_padded(shard))


@pytest.mark.parametrize("name", ["fsdp", "hsdp"])
def test_todo7_fsdp2_bytes_on_the_wire(run, name):
    """FSDP2's own collectives, per mesh dimension, at 4 ranks: blocks all-gathered twice and the root once
    (its default reshard_after_forward) inside the shard group; HSDP all-reduces only its gradient shard across
    the replicas, and never all-gathers parameters there."""
    record = run.strategy("four", name, 7)
    shard = 4 if name == "fsdp" else 2
    model = build_model(CONFIG)
    block = sum(math.ceil(p.shape[0] / shard) * shard * p[0].numel() for p in model.blocks[0].parameters())
    padded = fsdp_padded(shard)
    root = padded - block * CONFIG.n_layers
    wire = record["library_wire_bytes"]
    gathered, want = wire["shard"].get("all_gather", 0), 4 * (2 * block * CONFIG.n_layers + root)
    cause = {  # what the known mistakes gather: each parameter once (one unit) or twice (the root resharded too)
        4 * padded: "every parameter gathered once, as one unit: likely only the root is sharded (fully_shard each "
        "block first)",
        8 * padded: "every parameter gathered twice: likely the root reshards after forward too (its default keeps "
        "it gathered for backward)",
    }.get(gathered, "fully_shard each block, then the root with its default reshard_after_forward")
    assert gathered == want, (
        f"TODO 7: {name}'s shard group all-gathered {gathered:,} bytes in a step, expected {want:,} (the blocks "
        f"twice, the root once): {cause}"
    )
    assert wire["shard"] == {"all_gather": want, "reduce_scatter": 4 * padded}, (
        f"TODO 7: {name}'s shard group moved {wire['shard']}, expected one reduce-scatter of {4 * padded:,} bytes"
    )
    if name == "hsdp":
        assert wire["replicate"] == {"all_reduce": 4 * padded // shard}, (
            f"TODO 7: across replicas HSDP should all-reduce only the gradient shard ({4 * padded // shard} bytes), "
            f"not {wire['replicate']}"
        )


def test_todo7_fsdp2_gathers_in_bf16(run):
    record = run.strategy("bf16", "fsdp", 7)
    model = build_model(CONFIG)
    block = sum(math.ceil(p.shape[0] / 2) * 2 * p[0].numel() for p in model.blocks[0].parameters())
    root = fsdp_padded(2) - block * CONFIG.n_layers
    expected = 2 * (2 * block * CONFIG.n_layers + root)  # bf16: 2 bytes per gathered parameter
    gathered = record["library_wire_bytes"]["shard"]["all_gather"]
    cause = {  # which units gathered fp32 (4 bytes a parameter)
        4 * 2 * block * CONFIG.n_layers + 2 * root: "the blocks gather fp32 (4 bytes a parameter), the root bf16: "
        "likely fully_shard(block) without mp_policy",
        2 * expected: "every unit gathers fp32 (4 bytes a parameter): likely no fully_shard call gets mp_policy",
    }.get(gathered, "pass mp_policy to every fully_shard call")
    assert gathered == expected, (
        f"TODO 7: with --precision bf16 FSDP2 all-gathered {gathered:,} bytes in a step, expected {expected:,} (2 a "
        f"parameter): {cause}"
    )


# ------------------------------------------------------------------------------------------------
# TODO 8: the debugging lab (a unit never gathered again), graded like lessons 01 and 02's labs
# ------------------------------------------------------------------------------------------------


def tensor_paths(output, path="output") -> list[tuple[str, torch.Tensor]]:
    """Every tensor in a nested output with where it sits: [("output['aux'][1][0]", tensor), ...]."""
    if torch.is_tensor(output):
        return [(path, output)]
    if isinstance(output, dict):
        items = output.items()
    else:
        items = enumerate(output) if isinstance(output, (tuple, list)) else ()
    return [pair for key, item in items for pair in tensor_paths(item, f"{path}[{key!r}]")]


def searched(output, values) -> list:
    """output_tensors written with `values(a_dict)` as what it searches in a dict: the lab's known mistakes."""
    if isinstance(output, dict):
        output = values(output)
    if isinstance(output, (tuple, list)):
        return [tensor for item in output for tensor in searched(item, values)]
    return [output] if torch.is_tensor(output) else []


DICT_MISTAKES = {  # what output_tensors searches in a dict, when written with a known mistake
    "iterating a dict gives its keys, not its values": lambda d: list(d),
    "only a dict's first value is searched": lambda d: list(d.values())[:1],
    "only the tensors directly in a dict are found, not those nested in its tuples, lists or dicts": lambda d: [
        v for v in d.values() if torch.is_tensor(v)
    ],
}


def test_todo8_output_tensors_finds_every_tensor_however_nested(lesson):
    """Blocks may return tensors inside dicts inside tuples inside lists: every one of them, and only them. The
    dict's first value is nested, so that searching only it and searching only its own tensors differ."""
    script = load_script(lesson("03"), "lesson03_todo8")
    tensors = [torch.full((2,), float(i)) for i in range(5)]
    output = {"aux": (tensors[1], [tensors[2], {"deep": tensors[3], "step": 3}]), "hidden": tensors[0], "n": None}
    for shape in [tensors[4], output, [output, (tensors[4],)]]:
        expected = tensor_paths(shape)
        found = script.output_tensors(shape)
        ids = [id(t) for t in found]
        if sorted(ids) == sorted(id(t) for _, t in expected):  # in any order: Zero3 hooks each tensor once
            continue
        missed = next((path for path, t in expected if id(t) not in ids), None)
        known = (why for why, values in DICT_MISTAKES.items() if ids == [id(t) for t in searched(shape, values)])
        cause = next(known, "each tensor must be found once, inside dicts, tuples and lists at any depth; nothing else")
        first = f"the first missed is {missed}" if missed else "none missed, but some found twice, or something else"
        raise AssertionError(
            f"TODO 8: output_tensors found {len(found)} of the {len(expected)} tensors in a {type(shape).__name__} "
            f"output; {first}: {cause}"
        )


def test_todo8_lab_every_unit_is_gathered_again_for_backward(lesson, tmp_path):
    """3 ranks, the lab's model (its blocks return dicts) in the course's Zero3 with the script's output_tensors:
    one step's gradient equals one process's. gloo with a 5 s timeout: a rank left waiting ends the lab."""
    out = tmp_path / "lab.json"
    result = torchrun(ROOT / "utils" / "lesson_03" / "lab.py", 3, [lesson("03"), "--metrics-out", out], timeout=120)
    assert out.exists(), f"TODO 8: the lab's ranks ended without a result. Their last lines:\n{result.tail()}"
    message = lab_failure(json.loads(out.read_text())["outcomes"])
    assert message is None, message


# ------------------------------------------------------------------------------------------------
# Memory, bytes on the wire, activations
# ------------------------------------------------------------------------------------------------


def test_the_model_needs_padding_in_some_buffers_only():
    """The module docstring's claim, from the model itself: at 2 and 4 ranks some sharded buffers are padded and
    some divide evenly, so the tests run both paths."""
    block, root = block_and_root()
    rows = {p.shape[0] for p in build_model(CONFIG).parameters()}
    for n in (2, 4):
        assert PSI % n and block % n, f"test setup: Psi ({PSI}) and a block ({block}) should not divide by {n}"
        padded = {r for r in rows if r % n}
        assert padded == {CONFIG.dim}, f"test setup: at {n} ranks {sorted(padded)}-row parameters need padding"
    even = {CONFIG.seq_len, CONFIG.mlp_ratio * CONFIG.dim, CONFIG.vocab_size}
    assert root % 2 == 0 and rows - {CONFIG.dim} == even, f"test setup: root {root}, rows {sorted(rows)}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_one_process_holds_what_ddp_holds(run, name):
    """At 1 rank nobody shares: every strategy holds Psi of each kind, AdamW's state 2 Psi (the estimator at dp=1)."""
    record = run.strategy("one", name, TODO[name])
    assert record["bytes_per_rank"] == {"params": 4 * PSI, "grads": 4 * PSI, "optimizer": 4 * PSI}, (
        f"TODO {TODO[name]}: {name} at 1 rank holds {record['bytes_per_rank']}, not {4 * PSI} bytes of each kind"
    )


def test_peak_gradients_fall_only_where_gradients_are_reduced_during_backward(run):
    """DDP and ZeRO-1 hold every full gradient before the reduction; ZeRO-2 its shard and about one bucket."""
    peaks = {name: run.strategy("four", name, TODO[name])["peak_bytes_in_backward"]["grads"] for name in STRATEGIES[:3]}
    assert peaks["ddp"] == peaks["zero1"] == 4 * PSI > peaks["zero2"], (
        f"TODO 3: the most gradient bytes alive during backward were {peaks}; expected DDP and ZeRO-1 at every full "
        f"gradient ({4 * PSI:,}) and ZeRO-2 below"
    )


def test_activations_do_not_shrink_with_zero(run):
    activations = {name: run.strategy("four", name, TODO[name])["activation_bytes"] for name in STRATEGIES}
    assert len(set(activations.values())) == 1 and activations["ddp"] > 0, (
        f"activations saved for backward should be the same bytes for every strategy at 4 ranks: {activations}"
    )


def test_hsdp_groups(run):
    result, _, _ = run.launch("four")
    record = run.strategy("four", "hsdp", 7)
    assert (record["replicas"], record["shard_ranks"]) == (2, 2)
    assert "HSDP mesh (replicate x shard): [[0, 1], [2, 3]]" in result.output


# ------------------------------------------------------------------------------------------------
# FSDP2's prefetching: utils/lesson_03/prefetch.py, the worker whose timeline the notebook draws
# ------------------------------------------------------------------------------------------------

PREFETCHES = {"none": (False, False), "default": (False, True), "explicit": (True, True)}  # (forward, backward)


@pytest.fixture(scope="module")
def prefetch(tmp_path_factory):
    result = torchrun(
        ROOT / "utils" / "lesson_03" / "prefetch.py", 2, tmp_path=tmp_path_factory.mktemp("prefetch"), timeout=180
    )
    assert result.returncode == 0 and result.metrics, result.tail()
    return result.metrics


def spans(rows) -> dict:
    """{(unit, kind): (start, end)}, failing if a unit has a kind twice or a block misses one."""
    found = {}
    for unit, kind, start, end in rows:
        assert (unit, kind) not in found, f"{unit} has two {kind} spans in one step"
        assert start <= end, (unit, kind, start, end)
        found[unit, kind] = (start, end)
    for i in range(CONFIG.n_layers):
        for kind in ("forward gather", "forward", "backward gather", "backward", "reduce-scatter"):
            assert (f"blocks.{i}", kind) in found, f"blocks.{i}: no {kind} in the timeline"
    return found


@pytest.mark.parametrize("mode", PREFETCHES)
def test_fsdp2_prefetching_issues_the_next_blocks_gather_before_this_blocks_compute_ends(prefetch, mode):
    """The notebook's claim, on every rank: with explicit prefetching block i+1's all-gather is issued before block
    i's forward ends (backward: block i-1's before block i's backward ends); without, each starts only after. FSDP2
    prefetches in backward by default. Every block's compute starts after its own all-gather returned."""
    forward, backward = PREFETCHES[mode]
    assert prefetch["world_size"] == 2 and len(prefetch["timelines"][mode]) == 2
    for rank, rows in enumerate(prefetch["timelines"][mode]):
        at = spans(rows)
        for i in range(CONFIG.n_layers):
            block = f"blocks.{i}"
            for kind in ("forward", "backward"):
                assert at[block, f"{kind} gather"][1] <= at[block, kind][0], f"{mode}, rank {rank}: {block} {kind}"
        for i in range(CONFIG.n_layers - 1):
            issued, ends = at[f"blocks.{i + 1}", "forward gather"][0], at[f"blocks.{i}", "forward"][1]
            assert (issued < ends) == forward, (
                f"{mode}, rank {rank}: blocks.{i + 1}'s all-gather issued at {issued:.3f} ms, blocks.{i}'s forward "
                f"ends at {ends:.3f} ms: {'expected before' if forward else 'expected after'}"
            )
        for i in range(CONFIG.n_layers - 1, 0, -1):
            issued, ends = at[f"blocks.{i - 1}", "backward gather"][0], at[f"blocks.{i}", "backward"][1]
            assert (issued < ends) == backward, (
                f"{mode}, rank {rank}: blocks.{i - 1}'s backward all-gather issued at {issued:.3f} ms, blocks.{i}'s "
                f"backward ends at {ends:.3f} ms: {'expected before' if backward else 'expected after'}"
            )


# ------------------------------------------------------------------------------------------------
# AdamW and bf16
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", STRATEGIES[1:])
def test_adamw_matches_ddp_within_a_looser_tolerance(run, name):
    record, ddp = run.strategy("adamw", name, TODO[name]), run.strategy("adamw", "ddp", None)
    difference = max_difference(weights(record), weights(ddp))
    assert difference <= ADAMW_TOLERANCE, f"TODO {TODO[name]}: with AdamW {name} differs from DDP by {difference:.1e}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_bf16_loss_stays_near_fp32(run, name):
    fp32 = run.strategy("adamw", name, TODO[name])["losses"][:4]
    bf16 = run.strategy("bf16", name, TODO[name])
    result, _, _ = run.launch("bf16")
    assert passed(result, "--precision") == bf16["precision"] == "bf16", bf16["precision"]
    assert bf16["losses"] != fp32, "bf16 should change the losses a little"
    assert bf16["losses"] == pytest.approx(fp32, rel=BF16_TOLERANCE), (bf16["losses"], fp32)
    assert bf16["bytes_per_rank"] == run.strategy("adamw", name, TODO[name])["bytes_per_rank"], "fp32 master state"


# ------------------------------------------------------------------------------------------------
# Distributed checkpoints: 4 ranks -> 2 -> 1, a full-state file, resuming, bad checkpoints
# ------------------------------------------------------------------------------------------------


def finished(run, name: str, strategy=None, todo=7) -> dict:
    """A single-strategy run's metrics (the checkpoint chain runs FSDP2 or DDP), or its failure for TODO `todo`.
    strategy: that strategy instead of the run's own."""
    result, metrics, _ = run.launch(name, strategy)
    assert result.returncode == 0 and metrics, f"TODO {todo}: the {name} run failed. Its last lines:\n{result.tail()}"
    return metrics


@pytest.mark.parametrize("resumed,saved", [("dcp2", "dcp4"), ("dcp1", "dcp2"), ("full1", "dcp4")])
def test_todo7_checkpoint_loads_at_another_world_size_with_identical_state(run, resumed, saved):
    before, after = finished(run, saved), finished(run, resumed)
    assert after["loaded_param_checksum"] == pytest.approx(before["param_checksum"], rel=1e-12), (
        f"TODO 7: {resumed} loaded parameters with checksum {after['loaded_param_checksum']!r}, {saved} saved "
        f"{before['param_checksum']!r}"
    )
    assert after["loaded_optimizer_checksum"] == pytest.approx(before["optimizer_checksum"], rel=1e-12), (
        f"TODO 7: {resumed} loaded optimizer state with checksum {after['loaded_optimizer_checksum']!r}, {saved} "
        f"saved {before['optimizer_checksum']!r}"
    )


@pytest.mark.parametrize("resumed", ["dcp2", "dcp1", "full1"])
def test_todo7_resume_continues_the_loss_curve(run, resumed):
    metrics = finished(run, resumed)
    reference = run.strategy("adamw", "fsdp", 7)["losses"]  # 8 steps without stopping, 2 ranks
    first = metrics["first_step"]
    assert first in (5, 7), f"TODO 7: {resumed} began at step {first}, expected 5 or 7 (after the saved step)"
    expected = reference[first - 1 : first - 1 + metrics["steps"]]
    assert metrics["losses"] == pytest.approx(expected, rel=1e-4), (
        f"TODO 7: {resumed}'s losses {metrics['losses']} do not continue the uninterrupted run's {expected}"
    )


def test_todo7_full_checkpoint_loads_into_a_plain_model(run):
    metrics = finished(run, "dcp4")
    state = torch.load(run.folder / "full4.pt", weights_only=True)
    model = build_model(CONFIG, seed=123)
    model.load_state_dict(state["model"])
    assert param_checksum(model) == pytest.approx(metrics["param_checksum"], rel=1e-12)


def damage(folder, tmp_path, case):
    """A copy of the DCP folder `folder` with one thing wrong."""
    import shutil

    broken = tmp_path / f"ckpt-{case}"
    shutil.copytree(folder, broken)
    shard = sorted(broken.glob("*.distcp"))[0]
    if case == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif case == "shard_missing":
        shard.unlink()
    elif case == "metadata_damaged":
        (broken / ".metadata").write_bytes(b"not a checkpoint")
    elif case == "metadata_missing":
        (broken / ".metadata").unlink()
    return broken


BAD = {
    "missing": "no such checkpoint",
    "other_model": "another model",
    "truncated": "damaged",
    "shard_missing": "damaged",
    "metadata_damaged": "damaged",
    "metadata_missing": "no distributed checkpoint",
    "not_a_checkpoint": "not a checkpoint",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_one_line_naming_the_folder(run, lesson, tmp_path, case):
    args = [*MODEL, "--strategy", "fsdp", "--steps", "1"]
    if case == "missing":
        target = tmp_path / "nowhere"
    elif case == "not_a_checkpoint":
        target = tmp_path / "notes.txt"
        target.write_text("hello")
    else:
        finished(run, "dcp4")
        target = run.folder / "dcp4"
        if case == "other_model":
            args[1] = "30"  # --dim 30 (and 3 heads): another model
        else:
            target = damage(target, tmp_path, case)
    env = course_env(PYTHONPATH=ROOT)
    result = python(lesson("03"), [*args, "--resume", target, "--log-dir", tmp_path / "runs"], timeout=120, env=env)
    assert result.returncode == 2, result.tail()
    errors = [line for line in result.output.splitlines() if "ERROR:" in line]
    assert len(errors) == 1 and BAD[case] in errors[0] and str(target) in errors[0], result.tail()
    assert "Traceback" not in result.output, result.tail()


def test_rank0_prints_once_and_finishes(run):
    result, _, _ = run.launch("two")
    assert result.returncode == 0, result.tail()
    lines = result.output.rstrip().splitlines()
    assert lines[-1].startswith("FINISHED"), lines[-1]
    assert sum(line.startswith("FINISHED") for line in lines) == 1


def test_autocast_is_refused_not_ignored(lesson, tmp_path):
    result = python(
        lesson("03"), [*MODEL, "--autocast", "bf16", "--steps", "1"], timeout=60, env=course_env(PYTHONPATH=ROOT)
    )
    assert result.returncode == 2 and "--autocast" in result.output and "Traceback" not in result.output, result.tail()


# ------------------------------------------------------------------------------------------------
# The command line: every option changes the run (tests/test_options.py names these tests)
# ------------------------------------------------------------------------------------------------


def test_shared_options_change_the_run(lesson, tmp_path):
    """Every option of the shared command line at a value other than its default, on one process with DDP (the
    strategy no TODO stands in the way of): the run trains like the same steps written out with PyTorch alone
    (tests/harness/option_effects.py, a DistributedSampler of one replica) and logs into its strategy's folder."""
    fake_wikitext(tmp_path / "data")
    args = [
        "--steps", 3, "--seed", 3, "--batch-size", 4, "--optimizer", "sgd", "--lr", 0.05, "--dataset", "wikitext",
        "--data-dir", tmp_path / "data", "--seq-len", 16, "--dim", 24, "--n-layers", 1, "--n-heads", 3,
        "--log-dir", tmp_path / "runs", "--log-every", 2, "--wandb", "--checkpoint", tmp_path / "model.pt",
        "--metrics-out", tmp_path / "metrics.json", "--strategy", "ddp",
    ]  # fmt: skip
    result = python(lesson("03"), args, timeout=180, env=course_env(PYTHONPATH=ROOT))
    metrics = check_shared_options(result, order="sampler", log_dir=tmp_path / "runs" / "ddp")
    assert metrics["strategy"] == "ddp" and metrics["strategies"] is None, metrics["strategy"]


def test_strategy_all_trains_each_strategy_in_turn(run):
    """--strategy all: every strategy trains the same steps, one after the other, each reporting its own stage
    and writing its own weights (a single strategy, as in the test above, trains that one alone)."""
    result, metrics, _ = run.launch("two")
    trained = sorted(metrics["strategies"])
    assert passed(result, "--strategy") == "all" and trained == sorted(STRATEGIES), trained
    printed = re.findall(r"^\s*(\w+) step\s+4\s+loss", result.output, flags=re.MULTILINE)
    assert printed == STRATEGIES, f"the strategies printed their last step in the order {printed}"
    for name in STRATEGIES:
        record = run.strategy("two", name, TODO[name])
        assert (record["strategy"], record["stage"]) == (name, STAGE[name]), (name, record["strategy"])
        assert record["weights"].exists() and len(record["losses"]) == 4, f"{name}: no weights or not 4 steps"
        times = record["step_times_s"]  # the notebook's table of time per step
        assert len(times) == 4 and all(t > 0 for t in times), f"{name}: step times {times}"


def test_bucket_cap_mb_cuts_zero2s_gradients_into_buckets(run):
    """--bucket-cap-mb: ZeRO-2 groups the parameters, last layer first, into buckets of at most that many MiB
    (one larger parameter alone in its own); ZeRO-1 reduces once after backward, in one bucket whatever the cap."""
    result, _, _ = run.launch("two")
    cap = float(passed(result, "--bucket-cap-mb")) * 2**20
    expected, size = [], cap
    for p in reversed(list(build_model(CONFIG).parameters())):
        if size + 4 * p.numel() > cap:
            expected.append(0)
            size = 0
        expected[-1] += p.numel()
        size += 4 * p.numel()
    zero1, zero2 = run.partial("two", "zero1"), run.partial("two", "zero2")
    assert "buckets" in zero1 and "buckets" in zero2, "TODO 1: the ZeRO runs stopped before their optimizer was built"
    assert [b["numel"] for b in zero1["buckets"]] == [PSI], "ZeRO-1 should keep all its parameters in one bucket"
    assert len(expected) > 1 and [b["numel"] for b in zero2["buckets"]] == expected, (
        f"--bucket-cap-mb {cap / 2**20}: ZeRO-2's buckets hold {[b['numel'] for b in zero2['buckets']]} parameters, "
        f"expected {expected}"
    )


def test_one_process_reference_is_sgd_with_momentum_written_out(run):
    """The reference of every parity test ("one": DDP on one process) is itself the same 4 steps of SGD with
    --momentum written out with PyTorch alone (a DistributedSampler of one replica): a mistake that bent the
    reference and the sharded runs alike would otherwise pass them. Momentum keeps one buffer per parameter."""
    result, _, _ = run.launch("one")
    record = run.strategy("one", "ddp", None)
    momentum = float(passed(result, "--momentum"))
    losses, checksum, _ = written_out_training(result, "sampler", 8, DEFAULT_LR["sgd"], momentum=momentum)
    assert momentum > 0 and record["losses"] == pytest.approx(losses, rel=1e-5), (
        f"on one process the losses {record['losses']} are not those of SGD with momentum {momentum}: {losses}"
    )
    assert record["param_checksum"] == pytest.approx(checksum, rel=1e-6), "the final parameters differ"
    assert record["bytes_per_rank"]["optimizer"] == 4 * PSI, "--momentum: one fp32 buffer per parameter"


def test_replicas_sets_hsdps_mesh(run):
    """--replicas 1 at 2 ranks: one replica of 2 shards (like FSDP2) instead of the default, one replica per node
    or 2 of 1 shard on one machine; every parameter is then sharded over both ranks, and it still trains like one
    process."""
    result, _, folder = run.launch("kept")
    metrics = finished(run, "kept")
    replicas = int(passed(result, "--replicas"))
    assert (metrics["replicas"], metrics["shard_ranks"]) == (replicas, 2 // replicas) == (1, 2), (
        f"--replicas {replicas}: HSDP built {metrics['replicas']} replicas of {metrics['shard_ranks']} shards"
    )
    assert "HSDP mesh (replicate x shard): [[0, 1]]" in result.output, result.tail()
    default = run.strategy("two", "hsdp", 7)
    assert (default["replicas"], default["shard_ranks"]) == (2, 1), "without --replicas: 2 replicas of 1 shard"
    expected = model_state_bytes(PSI, 2, 3, "fp32", "momentum", fsdp_padded(2))
    assert metrics["bytes_per_rank"] == expected, f"sharded over 2 ranks: {expected}, not {metrics['bytes_per_rank']}"
    trained = torch.load(folder / "model.pt", weights_only=True)["model"]
    difference = max_difference(trained, weights(run.strategy("one", "ddp", None)))
    assert difference <= TOLERANCE, f"HSDP with one replica differs from one process by {difference:.1e}"


@pytest.mark.parametrize("name", ["zero3", "hsdp"])
def test_no_reshard_after_forward_gathers_each_block_once(run, name):
    """--no-reshard-after-forward keeps each block gathered from its forward to its backward: one all-gather of
    every unit per step, where --reshard-after-forward (the default) gathers each block again for backward.
    The lesson's Zero3 (its own counters) and FSDP2 (through HSDP with one replica: 2 shards) alike."""
    two, _, _ = run.launch("two")
    kept, _, _ = run.launch("kept", "zero3" if name == "zero3" else None)
    assert passed(two, "--reshard-after-forward") is True and passed(kept, "--no-reshard-after-forward") is True
    todo = TODO[name]
    if name == "zero3":
        total, blocks, root = zero3_padded(2)
        resharded = run.strategy("two", "zero3", todo)["wire_bytes_per_step"]["all_gather"]
        gathered = finished(run, "kept", "zero3", todo)["wire_bytes_per_step"]["all_gather"]
    else:
        total = fsdp_padded(2)
        blocks = sum(math.ceil(p.shape[0] / 2) * 2 * p[0].numel() for p in build_model(CONFIG).blocks[0].parameters())
        root = total - blocks * CONFIG.n_layers
        resharded = run.strategy("two", "fsdp", todo)["library_wire_bytes"]["shard"]["all_gather"]
        gathered = finished(run, "kept", None, todo)["library_wire_bytes"].get("shard", {}).get("all_gather", 0)
    assert resharded == 4 * (2 * blocks * CONFIG.n_layers + root), f"TODO {todo}: {name} resharded: {resharded}"
    assert gathered == 4 * total, (
        f"TODO {todo}: with --no-reshard-after-forward {name} all-gathered {gathered:,} bytes in a step, expected "
        f"every unit once ({4 * total:,})"
    )


def test_save_dcp_writes_every_ranks_shards_and_resume_starts_after_its_step(run):
    """--save-dcp: one shard file per rank beside DCP's index and the course's description (its step and model);
    --resume: the run goes on from the step after the saved one, at another world size."""
    first_step = finished(run, "dcp2")["first_step"]  # launches dcp4 first
    (saved, _, _), (resumed, _, _) = run.launch("dcp4"), run.launch("dcp2")
    folder = Path(passed(saved, "--save-dcp"))
    assert (folder / ".metadata").exists() and len(list(folder.glob("*.distcp"))) == 4, sorted(folder.iterdir())
    described = json.loads((folder / "course.json").read_text())
    assert described["step"] == 4 and described["config"] == vars(CONFIG), described
    assert Path(passed(resumed, "--resume")) == folder
    assert first_step == described["step"] + 1, f"--resume: the run began at step {first_step}, not after the saved one"


def exercise_with(tmp_path, done: set) -> Path:
    """The generated exercise with the solution's code in the regions of the TODOs in `done` (a learner who
    has done those TODOs)."""
    solution = ROOT / "solutions" / "03_zero_fsdp.py"
    source = solution.read_text().splitlines()
    exercise = make_exercise(solution.read_text(), solution.name)[0].splitlines()
    for number in sorted(done, reverse=True):  # from the end, so earlier line numbers stay valid
        header = next(i for i, line in enumerate(source) if line.strip().startswith(f"# TODO {number}:"))
        begin = next(i for i in range(header, len(source)) if source[i].strip() == BEGIN)
        end = next(i for i in range(begin, len(source)) if source[i].strip() == END)
        alternative = next((i for i in range(begin, end) if source[i].strip() == EXERCISE), None)
        code = source[begin + 1 : alternative if alternative is not None else end]
        placeholder = end - alternative - 1 if alternative is not None else 1  # lines the exercise has instead
        at = next(i for i, line in enumerate(exercise) if line.strip().startswith(f"# TODO {number}:")) + 1
        while exercise[at].strip().startswith("#   "):  # the comment's own lines come first (its hints do not)
            at += 1
        exercise[at : at + placeholder] = code
    path = tmp_path / "exercises" / solution.name
    path.parent.mkdir(exist_ok=True)
    path.write_text("\n".join(exercise) + "\n")
    return path


def test_untouched_exercise_stops_at_once_naming_a_todo(tmp_path):
    exercise = exercise_with(tmp_path, set())
    env = course_env(PYTHONPATH=ROOT)
    result = python(exercise, [*MODEL, "--steps", "1", "--log-dir", tmp_path / "runs"], env=env, timeout=120)
    assert result.returncode == 2 and "ERROR: TODO 7: shard the model with FSDP2 is not done yet" in result.output, (
        result.tail()
    )


def test_all_strategies_report_what_finished_when_a_todo_is_not_done(tmp_path):
    """TODOs 1-3 done: --strategy all trains DDP, ZeRO-1 and ZeRO-2, says where ZeRO-3 and FSDP2 stopped, and
    ends naming the first unfinished TODO (partial credit: each TODO's tests use what finished)."""
    exercise = exercise_with(tmp_path, {1, 2, 3})
    env = course_env(PYTHONPATH=ROOT)
    out = tmp_path / "metrics.json"
    args = [*MODEL, *SGD, "--batch-size", "8", "--steps", "1", "--metrics-out", out, "--log-dir", tmp_path / "runs"]
    result = python(exercise, args, env=env, timeout=180)
    assert (
        result.returncode == 2 and "ERROR: TODO 4: all-gather a unit's full parameters is not done yet" in result.output
    ), result.tail()
    strategies = json.loads(out.read_text())["strategies"]
    assert all("stopped" not in strategies[name] for name in ("ddp", "zero1", "zero2")), strategies
    assert strategies["zero3"]["stopped"].startswith("TODO 4") and strategies["fsdp"]["stopped"].startswith("TODO 7")

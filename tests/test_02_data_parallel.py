"""Lesson 02: N data-parallel ranks train exactly like one process with an N times larger batch.

pytest tests/test_02_data_parallel.py                      # the solution
pytest tests/test_02_data_parallel.py --target exercises   # your exercise (make check LESSON=02)

TODOs 1-4 (the hand-written DataParallel) are checked by tests/workers/ddp_parity.py under torchrun: each TODO
alone first (the other three replaced by reference code), then together on small models: a plain one, one
with a frozen layer, one with parameters some steps do not use, one with a shared weight. TODOs 5-11 (the
training script) are checked by running the script (and TODO 6 by reading each rank's sampler in that worker);
TODO 12 (the debugging lab) by tests/workers/lab_check.py. Each run is launched once, the first time a test
needs it, and shared by the tests below. The reference is the same script on one process with the global
batch: 8 sequences per step. A test that runs several TODOs' code waits (needs(...)) until the other TODOs pass
their own checks, so a mistake is blamed on its own TODO.
"""

import json
import math

import pytest
import torch

from tests.harness.launch import ROOT, course_env, finished, fresh_folder, python, torchrun
from tests.harness.option_effects import check_shared_options, fake_wikitext, passed, written_out_training
from utils.course.lab import failure
from utils.course.make_exercises import handed_out
from utils.metrics import param_checksum
from utils.model import ModelConfig, build_model, count_parameters

TOLERANCE = 1e-6  # fp32, SGD: N ranks and one process differ only by the order of additions
SMALL = ["--dim", "32", "--n-layers", "1", "--n-heads", "2", "--optimizer", "sgd", "--log-every", "1"]
COMMON = [*SMALL, "--seq-len", "32", "--steps", "4"]
RUNS = {  # name: (processes, arguments); every one has a global batch of 8 sequences
    "one": (1, ["--batch-size", "8"]),
    "builtin2": (2, ["--batch-size", "4", "--ddp", "builtin"]),
    "scratch4": (4, ["--batch-size", "2", "--ddp", "scratch", "--bucket-cap-mb", "0.05"]),
    "accum2": (2, ["--batch-size", "2", "--grad-accum", "2", "--ddp", "scratch"]),
}


# --------------------------------------------------------------------------------------------------
# TODOs 1-4: the hand-written DataParallel, on small models (tests/workers/ddp_parity.py, 2 ranks)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scratch(lesson, tmp_path_factory):
    """The worker's results for the lesson's DataParallel (and for DistributedDataParallel) at 2 ranks."""
    path = tmp_path_factory.mktemp("ddp_parity") / "results.json"
    torchrun(ROOT / "tests/workers/ddp_parity.py", 2, [lesson("02"), path], timeout=180).check()
    return json.loads(path.read_text())


def reached(results, check: str, todo: int):
    """Fail naming the TODO if the check stopped at it unfinished, or crashed; skip, naming the TODO it waits
    for, if it stopped at another unfinished TODO."""
    stopped = results.get("stopped", {}).get(check)
    if stopped is not None:
        waits_for = stopped.split(":")[0]
        if waits_for != f"TODO {todo}":
            pytest.skip(f"needs {waits_for} first (not done yet: {stopped})")
        pytest.fail(f"TODO {todo}: not done yet ({stopped})")
    error = results.get("errors", {}).get(check)
    assert error is None, f"TODO {todo}: the check raised {error}"


def check_todo1(scratch):
    reached(scratch, "broadcast", 1)
    diff, holds = scratch["broadcast_diff"], scratch["weights_of"]
    source = holds[0] if len(set(holds)) == 1 and holds[0] not in (None, 0) else None
    assert diff == 0, (
        f"TODO 1: after wrapping, a rank's weights differ from rank 0's by {diff:.1e}, expected 0"
        + (f": every rank holds rank {source}'s weights, the broadcast came from rank {source}" if source else
           ": every rank should hold rank 0's values, whatever seed it built its copy from")
    )  # fmt: skip
    diff = scratch["buffer_diff"]
    assert diff == 0, (
        f"TODO 1: after wrapping, the parameters agree but a rank's buffers differ from rank 0's by {diff:.1e}, "
        "expected 0: buffers (state that is not a parameter) must start alike too"
    )


def check_todo2(scratch):
    """The hooks alone: _launch and the end of backward are the worker's reference code here."""
    reached(scratch, "hooks", 2)
    for kind, hooks in scratch["hooks"].items():
        buckets = hooks["buckets"]
        assert buckets >= 3, f"only {buckets} buckets, expected 3 or more: the tiny bucket cap should split them"
        where = "" if kind == "mlp" else " (one hook completing several)"  # the reordered model: all at once
        from_hooks = hooks["from_hooks"]
        why = (
            ": no hook launched one, every bucket waited for the end of backward" if from_hooks == 0 else
            f": the last hook completed all {buckets} but launched only {from_hooks}" if kind == "reordered" else
            ": a bucket should go as soon as it and every bucket before it are full"
        )  # fmt: skip
        assert from_hooks == buckets, (
            f"TODO 2: {from_hooks} of {buckets} buckets were launched from the hooks{where}, expected all of them{why}"
        )
        expected = list(range(buckets))
        wrong = next(((r, o) for r, o in enumerate(hooks["orders"]) if o != expected), None)
        first = wrong and next((i for i, (a, b) in enumerate(zip(wrong[1], expected)) if a != b), None)
        assert wrong is None, (
            f"TODO 2: the ranks launched the buckets in the orders {hooks['orders']}{where}, expected {expected} on "
            "every rank"
            + (f": rank {wrong[0]} launched bucket {wrong[1][first]} before bucket {expected[first]}, which was not "
               "full yet" if first is not None else ": launch them in list order, never one before an earlier one")
        )  # fmt: skip
        assert hooks["grad_vs_average"] <= TOLERANCE, (
            f"TODO 2: after backward, .grad differs from the average over ranks by {hooks['grad_vs_average']:.1e}"
            f"{where}, expected 0: each parameter's gradient should travel in its own bucket"
        )


def check_todo3(scratch):
    """_launch alone, called on full buckets in order (as TODO 2's hooks do), then waited for by the worker."""
    reached(scratch, "launch", 3)
    launch = scratch["launch"]
    assert launch["handles"] == ["Work"], (
        f"TODO 3: bucket.work holds {launch['handles']}, expected ['Work']: the handle of an all-reduce launched "
        "without waiting (async_op=True)"
    )
    times, n = launch["times_average"], scratch["world_size"]
    assert launch["flat_vs_average"] <= TOLERANCE, (
        f"TODO 3: after the all-reduce, a bucket differs from the average of the ranks' gradients by "
        f"{launch['flat_vs_average']:.1e}, expected 0"
        + (f": it is {times:.2f} times the average, the sum over the {n} ranks" if abs(times - n) < 1e-6 else "")
    )
    counted, gradients = launch["allreduce_bytes"], launch["param_bytes"]
    repeated = counted > gradients and counted % gradients == 0  # every bucket counted the same number of times
    assert counted == gradients, (
        f"TODO 3: counted {counted} bytes all-reduced in one backward for {gradients} bytes of gradients"
        + (f": each bucket's bytes counted {counted // gradients} times" if repeated else ", expected them equal")
        + ": count each launched bucket's bytes once"
    )
    buckets = launch["buckets"]
    assert launch["order"] == list(range(buckets)) and launch["next_to_launch"] == buckets, (
        f"TODO 3: after launching buckets 0-{buckets - 1}, launch_order is {launch['order']} and _next_to_launch "
        f"{launch['next_to_launch']}, expected {list(range(buckets))} and {buckets}: record each launch"
    )


def check_todo4(scratch):
    """The end of backward alone, every bucket full and launched (handles that all-reduce when waited for)."""
    reached(scratch, "unpack", 4)
    unpack = scratch["unpack"]
    why = (
        ": no handle was waited for, so .grad got the buckets before their all-reduce ran" if not unpack["waited"] else
        ": .grad still holds this rank's own gradient, the averaged buckets never reached it" if unpack["grad_is_own"]
        else ": a bucket holds the average only once its all-reduce is waited for, then .grad must get it"
    )  # fmt: skip
    assert unpack["grad_vs_average"] <= TOLERANCE, (
        f"TODO 4: after backward, .grad differs from the average over ranks by {unpack['grad_vs_average']:.1e}, "
        f"expected 0{why}"
    )
    assert unpack["buckets_reset"], (
        f"TODO 4: after backward, {unpack['not_reset'][0]}, expected every bucket empty: the next backward would "
        "find it already full"
    )


def test_todo1_broadcast_gives_every_rank_rank0_weights_and_buffers(scratch):
    check_todo1(scratch)


def test_todo2_hooks_launch_every_full_bucket_during_backward_in_order(scratch):
    check_todo2(scratch)


def test_todo3_async_allreduce_averages_and_counts_each_bucket_once(scratch):
    check_todo3(scratch)


def test_todo4_wait_and_unpack_gives_averaged_gradients(scratch):
    check_todo4(scratch)


def test_todos_1_2_3_4_together_launch_from_the_hooks_and_average(scratch, needs):
    """The wrapper as written, hooks, launches and the end of backward together, with real asynchronous
    all-reduces."""
    needs(1, 2, 3, 4)
    reached(scratch, "together", 4)
    together = scratch["together"]
    buckets = together["buckets"]
    assert together["overlapped"] == buckets, f"TODO 2: {together['overlapped']} of {buckets} launched from hooks"
    assert all(order == list(range(buckets)) for order in together["orders"]), f"TODO 2: {together['orders']}"
    assert together["handles"] == ["Work"], f"TODO 3: bucket.work holds {together['handles']}"
    assert together["allreduce_bytes"] == together["param_bytes"], f"TODO 3: {together['allreduce_bytes']} bytes"
    assert together["grad_vs_average"] <= TOLERANCE, f"TODO 4: .grad is {together['grad_vs_average']:.1e} off"
    assert together["buckets_reset"], "TODO 4: after backward some bucket is not empty again (handle, ready set)"


MODELS = ["mlp", "frozen", "unused", "tied"]


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("kind", MODELS)
def test_todos_1_2_3_4_data_parallel_matches_one_process(scratch, needs, kind, accum):
    """2 ranks with batch b take the SGD steps of one process with batch 2b: with a frozen layer (never sent),
    parameters a step does not use (sent as zeros at the end of backward), a weight used twice (sent once),
    and with 2 micro-batches under no_sync."""
    needs(1, 2, 3, 4)
    key = f"{kind}_scratch_small_buckets_accum{accum}"
    reached(scratch, key, 4)
    diff = scratch[f"max_diff_{key}"]
    assert diff <= TOLERANCE, f"TODO 4: the {kind} model differs from one process by {diff:.1e} (accumulation {accum})"
    sent, trained = scratch[f"allreduce_bytes_{key}"], scratch[f"trained_bytes_{kind}"]
    assert sent == trained, f"TODO 3: {sent:,.0f} bytes all-reduced per step for {trained:,} bytes of trained gradients"


@pytest.mark.parametrize("kind", MODELS)
def test_builtin_ddp_matches_one_process(scratch, kind):
    """The reference the hand-written wrapper is held to (find_unused_parameters=True for the unused model)."""
    for accum in (1, 2):
        diff = scratch[f"max_diff_{kind}_builtin_accum{accum}"]
        assert diff <= TOLERANCE, f"DistributedDataParallel on the {kind} model differs by {diff:.1e}"


def test_bus_bytes_is_the_ring_formula(lesson):
    """2(N-1)/N x the bytes: what each rank sends (and receives) in a ring all-reduce."""
    from tests.workers.ddp_parity import load_lesson

    bus_bytes = load_lesson(lesson("02")).bus_bytes
    assert [bus_bytes(1200, n) for n in (1, 2, 4, 8)] == [0, 1200, 1800, 2100]


# --------------------------------------------------------------------------------------------------
# TODOs 5-11: the training script
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (Run, folder): launches RUNS[name] the first time it is asked for."""
    tmp, done = tmp_path_factory.mktemp("lesson02"), {}

    def launch(name):
        if name not in done:
            nproc, extra = RUNS[name]
            folder = tmp / name
            fresh_folder(folder)
            args = [*COMMON, *extra, "--log-dir", folder / "runs", "--checkpoint", folder / "model.pt"]
            if nproc == 1:
                done[name] = python(lesson("02"), args, tmp_path=folder), folder
            else:
                done[name] = torchrun(lesson("02"), nproc, args, tmp_path=folder), folder
        return done[name]

    return launch


def weights(folder) -> dict:
    """The checkpoint's parameters, with any "module." prefix of a wrapper removed."""
    state = torch.load(folder / "model.pt", weights_only=True)["model"]
    return {name.removeprefix("module."): tensor for name, tensor in state.items()}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), f"different parameters: {sorted(a.keys() ^ b.keys())[:4]}"
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def check_recipe(result, metrics, expected: str):
    assert metrics["world_size"] == 2, f"TODO 5: the run had world size {metrics['world_size']}, not 2"
    per_rank_step = 8 // metrics["world_size"]  # the runs checked here: 2 ranks, global batch 8
    missing_ranks = f": that is one rank's share, the {metrics['world_size']} ranks are missing from the product"
    assert metrics["global_batch_size"] == 8, (
        f"TODO 5: global_batch_size is {metrics['global_batch_size']}, expected 8 for this run"
        + (missing_ranks if metrics["global_batch_size"] == per_rank_step else ": the sequences one optimizer step "
           "sees, all ranks together")
    )  # fmt: skip
    printed = result.output.count("global batch 8")
    every_rank = ": every rank printed it" if printed == metrics["world_size"] else ""
    assert printed == 1, (
        f"TODO 5: the recipe 'global batch 8 ...' was printed {printed} times, expected once (rank 0){every_rank}"
    )
    line = next((line for line in result.output.splitlines() if "global batch" in line), "(no such line)")
    assert expected in result.output, f"TODO 5: the recipe reads {line!r}, expected it to start '{expected} ...'"


def check_todo5(run):
    result, _ = run("builtin2")
    check_recipe(result, finished(result, 5), "8 sequences = 4 per rank x 1")


def check_shard(run, scratch):
    """Each rank reads its own part of every epoch, together all of it (the worker reads the ranks' samplers)."""
    reached(scratch, "shard", 6)
    shard = scratch["shard"]
    samples, per_rank = shard["samples"], shard["per_rank"]
    why = (
        f": every rank reads all {samples} (a sampler of one replica)" if all(n >= samples for n in per_rank) else
        f": the shares ({per_rank} samples) are the right size but overlap, so the ranks drew different orders"
        if sum(per_rank) <= samples else ": the ranks must split one shuffled order that they all draw alike"
    )  # fmt: skip
    assert shard["read_twice"] == 0, (
        f"TODO 6: {shard['read_twice']} of {samples} samples go to more than one rank in an epoch, expected 0{why}"
    )
    assert shard["read"] > samples - len(per_rank), (
        f"TODO 6: the ranks read {shard['read']} of the {samples} samples in an epoch ({per_rank} each): each keeps "
        "every world_size-th sample of one shuffled order (DistributedSampler)"
    )
    one, ranks = finished(run("one")[0], 6), finished(run("builtin2")[0], 6)
    assert ranks["batches_per_epoch"] == one["batches_per_epoch"], (
        f"TODO 6: each of 2 ranks should get half the data per epoch ({one['batches_per_epoch']} batches of 4), "
        f"not {ranks['batches_per_epoch']}: give the DataLoader a DistributedSampler"
    )


def check_one_process_reference(run):
    """The reference of every parity test below ("one": this script on one process) is itself checked against
    the same 4 SGD steps written out with PyTorch alone (a DistributedSampler of one replica): a mistake that
    bent the reference and the parallel runs alike would otherwise pass them."""
    result, folder = run("one")
    metrics = finished(result, 6)
    losses, checksum, _ = written_out_training(result, "sampler", samples_per_step=8, lr=0.2)
    assert metrics["losses"] == pytest.approx(losses, rel=1e-5), (
        f"TODO 6: on one process the losses {metrics['losses']} are not plain training's {losses}: draw the batches "
        "from a DistributedSampler seeded with --seed (shuffle=True, drop_last=True)"
    )
    assert metrics["param_checksum"] == pytest.approx(checksum, rel=1e-6), "TODO 6: the final parameters differ"


def check_todo7(run):
    """Each --ddp gets its wrapper (the parity of the wrapped runs is test_todo7_ddp_wrap_matches_single_process)."""
    for name in ("builtin2", "scratch4"):
        result, _ = run(name)
        metrics = finished(result, 7)
        ddp = passed(result, "--ddp")
        wanted = {"builtin": "DistributedDataParallel", "scratch": "DataParallel"}[ddp]
        assert metrics["wrapper"] == wanted, (
            f"TODO 7: --ddp {ddp} wrapped the model in {metrics['wrapper']}, expected {wanted}"
        )
    # --bucket-cap-mb reaches the hand-written wrapper: every bucket but the last holds at least the cap, so there
    # are at most gradient bytes / cap buckets, rounded up; with the default 25 MB the whole model is one bucket.
    result, _ = run("scratch4")
    metrics, cap = finished(result, 7), float(passed(result, "--bucket-cap-mb")) * 2**20
    gradient_bytes = metrics["bytes_per_rank"]["params"]
    one_bucket = ": one bucket for every gradient, as the default 25 MB gives: the option never reached the wrapper"
    assert 2 <= metrics["buckets"] <= math.ceil(gradient_bytes / cap), (
        f"TODO 7: with --bucket-cap-mb {cap / 2**20} the wrapper made {metrics['buckets']} buckets for "
        f"{gradient_bytes:,} bytes of gradients, expected 2 to {math.ceil(gradient_bytes / cap)}"
        + (one_bucket if metrics["buckets"] == 1 else "")
    )


def check_todo9(run):
    result, folder = run("accum2")
    metrics = finished(result, 9)
    assert passed(result, "--grad-accum") == "2" and metrics["grad_accum"] == 2, (
        f"TODO 9: the run with --grad-accum 2 recorded grad_accum {metrics['grad_accum']}, expected 2"
    )
    check_recipe(result, metrics, "8 sequences = 2 per rank x 2")
    difference = max_difference(weights(folder), weights(run("one")[1]))
    assert difference <= TOLERANCE, (
        f"TODO 9: after 4 steps, 2 ranks x 2 micro-batches differ from one process by {difference:.1e}, expected at "
        "most 1e-6"
    )
    params, sent = metrics["bytes_per_rank"]["params"], metrics["allreduce_bytes_per_step"]
    every_micro_step = f": every one of the {metrics['grad_accum']} micro-steps all-reduced them"
    assert sent == params, (
        f"TODO 9: {sent:,.0f} bytes all-reduced per step for {params:,} bytes of gradients, expected one all-reduce "
        "of them per step"
        + (every_micro_step if sent == metrics["grad_accum"] * params else ": the earlier micro-steps must not "
           "communicate")
    )  # fmt: skip


CHECKS = {  # TODO: its check, from the shared launches
    1: lambda scratch, run: check_todo1(scratch),
    2: lambda scratch, run: check_todo2(scratch),
    3: lambda scratch, run: check_todo3(scratch),
    4: lambda scratch, run: check_todo4(scratch),
    5: lambda scratch, run: check_todo5(run),
    6: lambda scratch, run: (check_shard(run, scratch), check_one_process_reference(run)),
    7: lambda scratch, run: check_todo7(run),
    9: lambda scratch, run: check_todo9(run),
}


@pytest.fixture(scope="module")
def needs(scratch, run):
    """needs(1, 4, ...): skip this test, naming them, while those TODOs fail their own checks. A test that runs
    code of several TODOs checks its own TODO only once the others pass theirs: a mistake is then blamed on
    its TODO alone, and a learner is told which TODO to fix first."""
    outcome = {}

    def check(*todos):
        for todo in todos:
            if todo not in outcome:
                try:
                    CHECKS[todo](scratch, run)
                    outcome[todo] = True
                except BaseException:  # AssertionError, or pytest's fail or skip
                    outcome[todo] = False
        failing = [todo for todo in todos if not outcome[todo]]
        if failing:
            pytest.skip(f"needs TODO {', '.join(map(str, failing))} first (see its own test)")

    return check


def test_todo5_global_batch_recipe(run):
    check_todo5(run)


def test_todo6_distributed_sampler_gives_each_rank_its_share(run, scratch, needs):
    needs(5)  # the 2-rank runs stop at TODO 5 until it is done
    check_shard(run, scratch)


def test_todo6_one_process_reference_is_the_plain_training_loop(run):
    check_one_process_reference(run)


def test_todo7_each_ddp_option_gets_its_wrapper(run, needs):
    needs(1, 2, 3, 4, 5)  # --ddp scratch trains with the hand-written wrapper: a crash there is not TODO 7's
    check_todo7(run)


@pytest.mark.parametrize("name", ["builtin2", "scratch4"])
def test_todo7_ddp_wrap_matches_single_process(run, needs, name):
    # Every rank's data (TODO 6) and the training loop's backward (TODO 9's no_sync) go into the weights;
    # --ddp scratch trains with the hand-written wrapper (TODOs 1-4).
    needs(*{"builtin2": (5, 6, 9), "scratch4": (1, 2, 3, 4, 5, 6, 9)}[name])
    one_metrics, one_folder = finished(run("one")[0], 7), run("one")[1]
    result, folder = run(name)
    metrics = finished(result, 7)
    difference = max_difference(weights(folder), weights(one_folder))
    assert difference <= TOLERANCE, (
        f"TODO 7: after 4 SGD steps, {name} differs from one process by {difference:.1e} on some parameter "
        "(wrap the model so gradients are averaged across ranks)"
    )
    assert metrics["param_checksum"] == pytest.approx(one_metrics["param_checksum"], rel=1e-6), (
        f"TODO 7: {name}'s parameter checksum {metrics['param_checksum']:.6f} is not one process's "
        f"{one_metrics['param_checksum']:.6f}"
    )


def test_todo8_set_epoch_reshuffles_every_epoch(lesson, tmp_path, needs):
    """With --lr 0 the model never changes, so each step's loss depends only on the batch it saw:
    equal losses in epoch 1 and epoch 2 mean the same batches in the same order."""
    needs(5, 6)
    args = [*SMALL, "--seq-len", "256", "--batch-size", "128", "--steps", "12", "--lr", "0"]
    result = torchrun(lesson("02"), 2, [*args, "--log-dir", tmp_path / "runs"], tmp_path=tmp_path)
    metrics = finished(result, 8)
    per_epoch = metrics["batches_per_epoch"]
    assert per_epoch == 6, f"TODO 8: 1562 blocks over 2 ranks in batches of 128 make 6 batches, not {per_epoch}"
    first, second = metrics["losses"][:6], metrics["losses"][6:]
    assert first != second, (
        f"TODO 8: epoch 2's losses {second} are epoch 1's: the same batches in the same order, expected a new "
        "order every epoch"
    )


def test_todo9_no_sync_accumulation_matches_one_large_batch(run, needs):
    needs(1, 2, 3, 4, 5, 6, 7)  # --ddp scratch: the hand-written wrapper's no_sync
    check_todo9(run)


@pytest.mark.parametrize("name", ["builtin2", "scratch4"])
def test_todo10_loss_is_averaged_across_ranks(run, needs, name):
    """The first step's loss comes before any update: it depends only on the data and on the averaging."""
    needs(*{"builtin2": (5, 6, 7, 9), "scratch4": (1, 2, 3, 4, 5, 6, 7, 9)}[name])
    one, ranks = finished(run("one")[0], 10), finished(run(name)[0], 10)
    ratio = ranks["losses"][0] / one["losses"][0]
    summed = abs(ratio - ranks["world_size"]) < 1e-3  # the ranks' losses are close: their sum is n times the mean
    assert ranks["losses"][0] == pytest.approx(one["losses"][0], rel=1e-6), (
        f"TODO 10: the first logged loss is {ranks['losses'][0]:.6f}, expected the global batch's "
        f"{one['losses'][0]:.6f} (one process's)"
        + (f": it is {ratio:.2f} times that, the ranks' losses summed, not averaged" if summed else
           ": the mean over ranks of each rank's loss")
    )  # fmt: skip
    # Later steps match too once the ranks' updates are averaged (TODOs 7 and 9, checked before this one).
    assert ranks["losses"] == pytest.approx(one["losses"], rel=1e-5), (
        f"TODO 10: the logged losses are {ranks['losses']}, expected one process's {one['losses']}: the mean over "
        "ranks of each step's loss"
    )


@pytest.mark.parametrize("name", ["builtin2", "scratch4"])
def test_todo11_checkpoint_saved_once_and_loads_into_a_plain_model(run, needs, name):
    """Whichever wrapper --ddp chose, the file holds the plain model's names (and the optimizer)."""
    needs(5, 7)
    result, folder = run(name)
    metrics = finished(result, 11)
    saved = result.output.count("saved the model")
    assert saved == 1, f"TODO 11: 'saved the model' printed {saved} times, expected once: rank 0 alone saves"
    state = torch.load(folder / "model.pt", weights_only=True)
    model = build_model(ModelConfig(**state["config"]), seed=123)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as error:
        first = str(error).strip().splitlines()[0]
        wrapped = [name for name in state["model"] if name.startswith("module.")]
        why = f": its names start with `module.` ({wrapped[0]}), the wrapper's, not the model's" if wrapped else ""
        raise AssertionError(f"TODO 11: the file does not load into a plain model{why}: {first}") from None
    assert param_checksum(model) == pytest.approx(metrics["param_checksum"], rel=1e-12), (
        f"TODO 11: the saved weights' checksum {param_checksum(model):.6f} is not the run's "
        f"{metrics['param_checksum']:.6f}"
    )
    groups = state.get("optimizer", {}).get("param_groups", [])
    assert [group["lr"] for group in groups] == [metrics["lr"]], (
        f"TODO 11: the checkpoint's optimizer state is {state.get('optimizer')!r}, expected the optimizer's state "
        "dict beside the model's, so that training can resume from the file"
    )


def test_bytes_on_the_wire_per_step(run, needs):
    """The hand-written DDP all-reduces each gradient once per step, all from hooks during backward."""
    needs(1, 2, 3, 4, 5, 7, 9)
    metrics = finished(run("scratch4")[0], 7)
    n = metrics["world_size"]
    params = count_parameters(ModelConfig(seq_len=32, dim=32, n_layers=1, n_heads=2))
    assert metrics["bytes_per_rank"]["params"] == 4 * params
    assert metrics["allreduce_bytes_per_step"] == 4 * params, (
        f"TODO 7: --ddp scratch should all-reduce {4 * params:,} bytes per step (wrap the model in DataParallel), "
        f"not {metrics['allreduce_bytes_per_step']}"
    )
    assert metrics["bus_bytes_per_step"] == pytest.approx(2 * (n - 1) / n * 4 * params)
    assert metrics["buckets_overlapped"] == metrics["buckets"], (
        f"TODO 2: {metrics['buckets_overlapped']} of {metrics['buckets']} buckets launched during backward"
    )


def test_rank0_prints_once_and_finishes(run, needs):
    needs(5)
    result, _ = run("scratch4")
    finished(result, 5)
    lines = result.output.rstrip().splitlines()
    assert lines[-1].startswith("FINISHED"), lines[-1]
    assert sum(line.startswith("FINISHED") for line in lines) == 1, "print with print0: once, from rank 0"
    assert sum(line.startswith("step    4") for line in lines) == 1


def test_untouched_exercise_is_lesson_00_on_one_process_and_names_todo5_on_two(tmp_path):
    """The generated exercise (not your edited copy) runs as the single-device baseline (with either --ddp),
    else stops at once at TODO 5."""
    exercise = handed_out("02_data_parallel.py", tmp_path / "exercises")
    env = course_env(PYTHONPATH=ROOT)  # the copy lives outside the course folder
    args = [*COMMON, "--batch-size", "8", "--log-dir", tmp_path / "runs"]
    untouched = python(exercise, [*args, "--ddp", "scratch"], tmp_path=tmp_path, env=env, timeout=300).check()
    baseline = python(ROOT / "solutions" / "00_setup_and_baseline.py", args, tmp_path=tmp_path, timeout=300).check()
    assert untouched.metrics["losses"] == baseline.metrics["losses"], "the untouched exercise should be lesson 00"
    two = torchrun(exercise, 2, args, timeout=180, env=env)
    assert two.returncode != 0 and "ERROR: TODO 5: the global batch recipe is not done yet" in two.output, two.tail()


def test_autocast_bf16_is_honoured_as_in_lesson_00(lesson, tmp_path):
    """--autocast bf16 changes the run (the forward in bf16), as in lesson 00; it is not accepted and ignored."""
    args = [*COMMON, "--batch-size", "8"]
    runs = {}
    for mode in ("off", "bf16"):
        folder = tmp_path / mode
        runs[mode] = python(lesson("02"), [*args, "--autocast", mode, "--log-dir", folder / "runs"], tmp_path=folder)
        finished(runs[mode], 5)
    off, bf16 = runs["off"].metrics, runs["bf16"].metrics
    assert bf16["autocast"] == "bf16" and off["autocast"] == "off", (off["autocast"], bf16["autocast"])
    assert bf16["losses"] != off["losses"], "--autocast bf16 gave the fp32 losses: the forward must run in autocast"
    gap = max(abs(a - b) for a, b in zip(bf16["losses"], off["losses"]))
    assert gap < 0.1, f"bf16 losses differ from fp32 by {gap:.3f}: more than rounding"


def test_shared_options_change_the_run(lesson, tmp_path):
    """Every option of the shared command line, and lesson 02's batch recipe options, at values other than their
    defaults, on one process: the run trains like the same steps written out with PyTorch alone
    (tests/harness/option_effects.py): 2 micro-batches of 2 are one batch of 4, at the learning rate x sqrt(4 / 8)."""
    fake_wikitext(tmp_path / "data")
    trace = tmp_path / "trace.json"
    args = [
        "--steps", 3, "--seed", 3, "--batch-size", 2, "--optimizer", "sgd", "--lr", 0.05, "--dataset", "wikitext",
        "--data-dir", tmp_path / "data", "--seq-len", 16, "--dim", 24, "--n-layers", 1, "--n-heads", 3,
        "--log-dir", tmp_path / "runs", "--log-every", 2, "--wandb", "--checkpoint", tmp_path / "model.pt",
        "--metrics-out", tmp_path / "metrics.json", "--grad-accum", 2, "--lr-scaling", "sqrt", "--trace", trace,
    ]  # fmt: skip
    result = python(lesson("02"), args, timeout=180)
    finished(result, 5)
    lr = 0.05 * (4 / 8) ** 0.5  # --lr-scaling sqrt: global batch 2 x 2 x 1 = 4, the base batch 8
    metrics = check_shared_options(result, order="sampler", samples_per_step=4, lr=lr)
    assert metrics["lr"] == pytest.approx(lr, rel=1e-12) and metrics["global_batch_size"] == 4, metrics["lr"]
    names = {event["name"] for event in json.loads(trace.read_text())}  # --trace: the profiled step's events
    assert "autograd::engine::evaluate_function" in " ".join(names) and any("Optimizer.step" in n for n in names), (
        f"--trace: no backward or optimizer step among the traced events {sorted(names)[:8]}"
    )


# --------------------------------------------------------------------------------------------------
# TODO 12: the debugging lab (uneven batches), graded like lesson 01's (utils/course/lab.py)
# --------------------------------------------------------------------------------------------------


def test_todo12_lab_uneven_batches_every_rank_takes_the_same_steps(lesson, tmp_path):
    """3 ranks, 7 samples: rank 0 has one batch more. Each case runs in a fresh gloo group, 5 s timeout."""
    out = tmp_path / "lab.json"
    torchrun(ROOT / "tests/workers/lab_check.py", 3, [lesson("02"), out, "uneven"], timeout=300).check()
    message = failure("uneven", json.loads(out.read_text())["uneven"], 12)
    assert message is None, message


# --------------------------------------------------------------------------------------------------
# Bad input: a one-line message naming the cause, within seconds, never a hang
# --------------------------------------------------------------------------------------------------

BAD_OPTIONS = {  # arguments: what the message must name
    "no micro-batches": (["--grad-accum", "0"], "--grad-accum"),
    "empty buckets": (["--bucket-cap-mb", "0"], "--bucket-cap-mb"),
    "negative buckets": (["--bucket-cap-mb", "-1"], "--bucket-cap-mb"),
    "not a number": (["--bucket-cap-mb", "nan"], "--bucket-cap-mb"),
    "unknown scaling": (["--lr-scaling", "cubic"], "--lr-scaling"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_bad_option_stops_at_once_naming_it(lesson, case):
    args, option = BAD_OPTIONS[case]
    result = python(lesson("02"), [*COMMON, *args], timeout=120)  # seconds on an idle machine; a busy one is slow
    message = result.output.strip().splitlines()[-1]
    assert result.returncode == 2 and option in message, result.tail()


BAD_DATA = {  # (processes, arguments, message): some rank would get no batch (12,502 blocks of 33 tokens, 2 ranks)
    "batch larger than a rank's share": (2, ["--batch-size", "7000"], "--batch-size 7000 is too large"),
    "sequence longer than the corpus": (2, ["--seq-len", "500000", "--batch-size", "1"], "--seq-len"),
    "accumulation beyond the share": (2, ["--batch-size", "100", "--grad-accum", "70"], "use --batch-size"),
}


@pytest.mark.parametrize("case", BAD_DATA)
def test_no_batch_for_a_rank_stops_instead_of_hanging(lesson, case, tmp_path):
    nproc, args, expected = BAD_DATA[case]
    result = torchrun(lesson("02"), nproc, [*COMMON, *args, "--log-dir", tmp_path / "runs"], timeout=120)
    errors = [line for line in result.output.splitlines() if "ERROR:" in line]
    assert result.returncode != 0 and errors and expected in errors[0], result.tail()

"""Lesson 05's debugging lab (TODO 8): a 1F1B schedule whose warm-ups deadlock, run on live ranks and graded.

The lesson's `capped_warmup(p, m, rank, max_in_flight)` says how many forwards each rank runs before its first
backward when the first stage may hold at most `max_in_flight` micro-batches. Here each rank turns its warm-up into
a 1F1B step list and runs it with the solution's engine (lesson("05") of utils.course.lessons: its stages, its
batched point-to-point plan, not the learner's TODOs 4-7) on a 4-stage course model, in a gloo group with a 5 s
timeout, so a deadlock ends in seconds. Each rank notes what it waits for before every wait; rank 0 writes every
rank's outcome. The notebook and `make check` run the same file:

    torchrun --nproc_per_node=4 utils/lesson_05/lab.py exercises/05_pipeline_parallel.py --metrics-out lab.json

    passed, lines = verdict(json.load(open("lab.json")))   # on one process: each rank's outcome, the cause
    message = check_warmups(lesson.capped_warmup)          # the pure-Python check, without launching anything

Why gloo even on a GPU node: a receive that never comes makes gloo raise after the timeout, which the lab reports;
NCCL's watchdog kills the process instead (utils/course/lab.py says more).
"""

import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from utils.course.lab import (  # noqa: E402
    describe_lab_error,
    failure_message,
    join_lab_group,
    start_rank,
    where_raised,
    write_outcomes,
)
from utils.course.lessons import lesson  # noqa: E402
from utils.distributed_utils import destroy_process_group  # noqa: E402

STAGES, MICROBATCHES, MAX_IN_FLIGHT = 4, 4, 2  # the live run: 4 stages, 4 micro-batches, rank 0 holds at most 2
TIMEOUT_S = 5.0  # how long a rank waits for a tensor before gloo gives up
TOLERANCE = 1e-6  # the stages' gradients against one process on the whole batch (fp32)
HINT = (  # a question that leads to the cause, not the fix: the lab is the finding
    "for the rank that waits, count the activations its warm-up forwards need from the rank before it, and how "
    "many that rank sends before it waits for its own first gradient"
)


def expected_warmup(n_stages: int, n_microbatches: int, rank: int, max_in_flight: int) -> int:
    return min(n_stages - rank - 1, max_in_flight - 1, n_microbatches)


def steps_from_warmup(warmup: int, n_microbatches: int) -> list[tuple[str, int]]:
    """1F1B's step list with `warmup` forwards first: then one F one B, then the backwards left."""
    steps = [("F", mb) for mb in range(warmup)]
    for i in range(n_microbatches - warmup):
        steps += [("F", warmup + i), ("B", i)]
    return steps + [("B", mb) for mb in range(n_microbatches - warmup, n_microbatches)]


def in_flight(steps) -> int:
    held = most = 0
    for kind, _ in steps:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def deadlock(step_lists) -> str | None:
    """None when every rank's list finishes (F(i) on rank r needs F(i) on r - 1 done, B(i) needs B(i) on r + 1);
    else one line naming the ranks that wait for each other, what each waits for and what it ran before."""
    p, done, position = len(step_lists), set(), [0] * len(step_lists)
    moved = True
    while moved:
        moved = False
        for r, steps in enumerate(step_lists):
            while position[r] < len(steps):
                kind, mb = steps[position[r]]
                peer = r - 1 if kind == "F" else r + 1
                if 0 <= peer < p and (kind, mb, peer) not in done:
                    break
                done.add((kind, mb, r))
                position[r], moved = position[r] + 1, True
    stuck = [r for r in range(p) if position[r] < len(step_lists[r])]
    if not stuck:
        return None
    waits = {}  # rank -> (what it waits for, in words; the rank it waits for)
    for r in stuck:
        kind, mb = step_lists[r][position[r]]
        ran = " ".join(k + str(i) for k, i in step_lists[r][: position[r]]) or "nothing"
        what, peer = ("activation", r - 1) if kind == "F" else ("gradient", r + 1)
        waits[r] = (f"rank {r} (after {ran}) waits before {kind}{mb} for {what} {mb} from rank {peer}", peer)
    pairs = [r for r in stuck if waits.get(waits[r][1], (None, None))[1] == r]  # neighbours waiting for each other
    behind = [str(r) for r in stuck if r not in pairs]
    return (
        "deadlock: "
        + ", while ".join(waits[r][0] for r in pairs)
        + (f" (rank{'s' * (len(behind) > 1)} {', '.join(behind)} wait behind them)" if behind else "")
    )


WARMUP_MISTAKES = {  # cause: the warm-up it gives (p, m, rank, cap); the exercise's own is the lab's finding
    "the cap counted only the warm-up forwards, not the forward that follows them": lambda p, m, r, cap: min(
        p - r - 1, cap, m
    ),
    "no rank warmed up": lambda p, m, r, cap: 0,
    "the warm-up were counted from the wrong end of the pipeline (by the rank, not the stages after it)": (
        lambda p, m, r, cap: min(r, cap - 1, m)
    ),
    "the warm-up were not limited to the m micro-batches": lambda p, m, r, cap: min(p - r - 1, cap - 1),
}


def as_if(warmups: list, p: int, m: int, cap: int) -> str:
    """The cause, ": as if ...", when the first len(warmups) ranks' warm-ups are a known mistake's, else ""."""
    causes = [cause for cause, mistake in WARMUP_MISTAKES.items()
              if [mistake(p, m, r, cap) for r in range(len(warmups))] == warmups]  # fmt: skip
    return ": as if " + " or ".join(causes) if causes else ""


def check_warmups(capped_warmup) -> str | None:
    """The lab's grading without launching anything: None when right, else the first mistake, naming its cause.
    The live configuration first, then other pipelines (up to 6 stages, 8 micro-batches, every cap)."""
    configurations = [(STAGES, MICROBATCHES, MAX_IN_FLIGHT)]
    configurations += [(p, m, c) for p in range(1, 7) for m in range(1, 9) for c in range(1, p + 1)]
    for p, m, cap in configurations:
        warmups = []
        for rank in range(p):
            call = f"capped_warmup({p}, {m}, rank={rank}, max_in_flight={cap})"
            try:
                warmup = capped_warmup(p, m, rank, cap)
            except NotImplementedError as error:
                return f"not done yet ({error})"
            except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
                return f"{call} raised {type(error).__name__}{where_raised(error)}: {error}"
            if not isinstance(warmup, int) or not 0 <= warmup <= m:
                return (
                    f"{call} returned {warmup!r}: a warm-up is a number of forwards, 0 to m = {m}"
                    f"{as_if([*warmups, warmup], p, m, cap)}"
                )
            warmups.append(warmup)
        step_lists = [steps_from_warmup(w, m) for w in warmups]
        where = f"p={p}, m={m}, max_in_flight={cap}, warm-ups {warmups}"
        stuck = deadlock(step_lists)
        if stuck:
            return f"{where}: {stuck}{as_if(warmups, p, m, cap)}"
        if in_flight(step_lists[0]) > cap:
            return (
                f"{where}: rank 0 holds {in_flight(step_lists[0])} micro-batches, more than the cap"
                f"{as_if(warmups, p, m, cap)}"
            )
        for rank, warmup in enumerate(warmups):
            best = expected_warmup(p, m, rank, cap)
            if warmup != best:
                more = "holds more than it needs to" if warmup > best else "leaves the pipeline idle longer"
                return (
                    f"{where}: rank {rank} warms up {warmup}, the cap allows {best} ({more}){as_if(warmups, p, m, cap)}"
                )
    return None


# --------------------------------------------------------------------------------------------------
# The live run: torchrun --nproc_per_node=4 utils/lesson_05/lab.py LESSON.py --metrics-out FILE
# --------------------------------------------------------------------------------------------------


STUCK = f"waited until the {TIMEOUT_S:.0f} s timeout (or until a neighbour gave up)"


def describe(error: BaseException) -> str:
    return describe_lab_error(error, STUCK)


def waited_for(batch) -> str:
    """The posted batch of (op, peer, what, mb) a rank waits in, in words."""
    ops = [f"{'receive' if op == 'recv' else 'send'} {what} {mb} {'from' if op == 'recv' else 'to'} rank {peer}"
           for op, peer, what, mb in batch]  # fmt: skip
    return f"stuck in batch_isend_irecv [{', '.join(ops)}]"


def run_rank(capped_warmup, build_stage, run_steps, exchange, store, rank: int, world_size: int) -> dict:
    """This rank's part of the lab: its warm-up from `capped_warmup` (the learner's), its step list through an
    engine that is right (build_stage, run_steps and exchange of the lesson's solution)."""
    outcome = {"warmup": None, "steps": None, "error": None, "waiting_for": None, "gradient_difference": None}
    try:
        warmup = capped_warmup(world_size, MICROBATCHES, rank, MAX_IN_FLIGHT)
        assert isinstance(warmup, int) and 0 <= warmup <= MICROBATCHES, f"returned {warmup!r}, not 0 to m"
    except NotImplementedError as error:
        outcome["error"] = f"not done: {error}"
    except Exception as error:  # noqa: BLE001 - the learner's code may raise anything
        outcome["error"] = f"capped_warmup {type(error).__name__}: {error}"
    store.set(f"lab/ok/{rank}", "0" if outcome["error"] else "1")
    store.wait([f"lab/ok/{r}" for r in range(world_size)], timedelta(seconds=60))
    if outcome["error"] or any(store.get(f"lab/ok/{r}") == b"0" for r in range(world_size)):
        outcome["error"] = outcome["error"] or "did not run: another rank's capped_warmup failed"
        return outcome  # a rank without a step list would only leave its neighbours waiting
    steps = steps_from_warmup(warmup, MICROBATCHES)
    outcome.update(warmup=warmup, steps=steps)

    from utils.model import ModelConfig, build_model, loss_fn

    config = ModelConfig(seq_len=8, dim=16, n_heads=2, n_layers=world_size)
    model = build_model(config, seed=0)
    stage = build_stage(model, rank, world_size)
    generator = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, config.vocab_size, (MICROBATCHES, config.seq_len), generator=generator)
                       for _ in "xy")  # fmt: skip
    posted = []  # the batch this rank waits for now: what it names when the wait times out

    def recorded(batch, *args, **kwargs):
        posted[:] = [batch]
        exchange(batch, *args, **kwargs)
        posted.clear()

    join_lab_group(store, rank, world_size, TIMEOUT_S)
    try:
        run_steps(
            stage, steps, rank=rank, n_stages=world_size, inputs=list(tokens.chunk(MICROBATCHES)),
            targets=list(targets.chunk(MICROBATCHES)), activation_shape=(1, config.seq_len, config.dim),
            device=torch.device("cpu"), post=recorded,
        )  # fmt: skip
    except Exception as error:  # noqa: BLE001 - a timeout, or a peer that gave up first
        outcome["error"] = describe(error)
        outcome["waiting_for"] = waited_for(posted[0]) if posted else None
    dist.destroy_process_group()  # no barrier: the group may be broken
    if outcome["error"] is None:  # one process on the whole batch: the gradients the pipeline must give
        whole = build_model(config, seed=0)
        loss_fn(whole(tokens), targets).backward()
        grads = dict(whole.named_parameters())
        outcome["gradient_difference"] = max(
            float((p.grad - grads[name].grad).abs().max()) if p.grad is not None else float("inf")
            for name, p in stage.named_parameters()
        )
    return outcome


def main():
    lab = start_rank("05", "capped_warmup")
    learner, store, rank, world_size = lab.learner, lab.store, lab.rank, lab.world_size
    engine = lesson("05")  # the solution's engine: a mistake in TODOs 4-7 must not show up as the lab's
    started = time.perf_counter()
    outcome = run_rank(
        learner.capped_warmup, engine.build_stage, engine.run_steps, engine.exchange, store, rank, world_size
    )
    outcome["seconds"] = time.perf_counter() - started
    record = {"stages": world_size, "microbatches": MICROBATCHES, "max_in_flight": MAX_IN_FLIGHT}
    write_outcomes(store, rank, world_size, outcome, record, lab.metrics_out)
    destroy_process_group()  # the course's: a barrier first, then gloo's threads let go before Python exits


# --------------------------------------------------------------------------------------------------
# Grading, on one process, from the run's record
# --------------------------------------------------------------------------------------------------


def verdict(record: dict) -> tuple[bool, list[str]]:
    """(passed, one line per rank, then the cause): what each rank did and whether it is right."""
    p, m, cap = record["stages"], record["microbatches"], record["max_in_flight"]
    lines, passed = [], True
    for rank, outcome in enumerate(record["ranks"]):
        expected = expected_warmup(p, m, rank, cap)
        head = f"rank {rank}: warm-up {outcome['warmup']}"
        if outcome["error"]:
            waiting = f", {outcome['waiting_for']}" if outcome["waiting_for"] else ""
            lines.append(f"{head}{waiting}: {outcome['error']}")
            passed = False
        elif outcome["gradient_difference"] > TOLERANCE:
            lines.append(f"{head}: finished, but its gradients differ from one process's by "
                         f"{outcome['gradient_difference']:.1e}")  # fmt: skip
            passed = False
        elif outcome["warmup"] != expected:
            lines.append(f"{head}: finished, gradients right, but 1F1B under the cap warms up {expected}")
            passed = False
        else:
            ran = " ".join(kind + str(mb) for kind, mb in outcome["steps"])
            lines.append(f"{head}: ran {ran}, gradients equal one process's (right)")
    warmups = [outcome["warmup"] for outcome in record["ranks"]]
    if None not in warmups:
        stuck = deadlock([steps_from_warmup(w, m) for w in warmups])
        if stuck:
            lines.append(f"why: {stuck}")
    return passed, lines


def failure(record: dict, todo: int) -> str | None:
    """None when the lab passed; else the test's message: the TODO, the cause, a hint, then every rank."""
    passed, lines = verdict(record)
    return None if passed else failure_message(lines, todo, HINT)


if __name__ == "__main__":
    main()

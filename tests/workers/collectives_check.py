"""Run under torchrun by tests/test_01_collectives.py: check each TODO of a lesson-01 file.

Imports the lesson file (solution or a learner's exercise) as a module and compares each hand-written
piece with the torch.distributed collective that does the same job, on several shapes, including
tensors with fewer elements than ranks. Where a result differs, the check says where it first differs (the rank,
the element, what it holds and what it should) and, when a known mistake written out here on every rank's inputs
gives exactly what came back, the likely cause. Rank 0 writes, as each shape is done, {check: {shape: {"gap":
largest difference over the ranks, "problem": that line or None}, or "not done: ..."}}.
Arguments: LESSON OUT [CHECK ...] (default: every check).
"""

import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from utils.course.lessons import load_script
from utils.distributed_utils import destroy_process_group, setup

# (4, 6) first: its 24 elements split evenly at 2, 3 and 4 ranks, so a wrong index shows as wrong values (with
# a cause) before a shape whose chunks differ in size can make a receive too small.
SHAPES = [(4, 6), (1,), (3,), (5,), (1000,), (33, 17)]


def rank_tensor(shape, rank):
    # Integers in float32: every summation order gives the exact same result.
    return torch.randint(-1000, 1000, shape, generator=torch.Generator().manual_seed(rank * 7 + len(shape))).float()


def same(a, b) -> bool:
    """Equal shapes and values, NaN equal to NaN (TODO 2's chunks still to arrive hold NaN)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def chunk_of(element: int, sizes: list[int]) -> int:
    """The chunk (of tensor_split's `sizes`) that holds `element` of the flat tensor."""
    return next(c for c in range(len(sizes)) if element < sum(sizes[: c + 1]))


def outcome(got, want, who: str, cause=None, offset: int = 0, n: int = 1) -> dict:
    """{"gap": largest difference, "problem": None, or where the flat `got` (elements offset... of the tensor under
    test, split in n chunks) first differs from `want`, and the likely cause (cause() is asked only then)}."""
    if got.shape != want.shape:
        return {"gap": float("inf"), "problem": f"{who} result has {got.numel()} elements, want {want.numel()}"}
    differs = (got != want).nonzero()
    if not len(differs):
        return {"gap": 0.0, "problem": None}
    i = int(differs[0])
    sizes = [len(part) for part in torch.arange(offset + len(got)).tensor_split(n)]
    where = f"{who} element {offset + i}" + (f" (in chunk {chunk_of(offset + i, sizes)})" if n > 1 else "")
    first = f"{where} is {got[i].item():g}, want {want[i].item():g}"
    why = cause() if cause else None
    if got[i].isnan():  # TODO 2's check: a chunk still to arrive holds NaN
        first = f"{where} still holds NaN" + ("" if why else ": the chunk never arrived")
    return {"gap": (got - want).abs().max().item(), "problem": first + (f": {why}" if why else "")}


# --- the ring written out on every rank's chunks at once, to recognise a known mistake by what it returns ---


def ring_phase(held, send_of, receive_of, combine, steps):
    """Every rank's chunks after `steps` ring steps in which rank r sends chunk send_of(r, s) to the right and
    adds ("add") or copies ("copy") the one from the left into chunk receive_of(r, s); None if a size differs."""
    n = len(held)
    held = [[chunk.clone() for chunk in chunks] for chunks in held]
    for s in range(steps):
        sent = [held[r][send_of(r, s) % n].clone() for r in range(n)]
        for r in range(n):
            incoming, into = sent[(r - 1) % n], held[r][receive_of(r, s) % n]
            if incoming.shape != into.shape:
                return None
            if combine == "add":
                into += incoming
            else:
                into.copy_(incoming)
    return held


REDUCE_SCATTER = {"send_of": lambda r, s: r - s, "receive_of": lambda r, s: r - s - 1, "combine": "add"}
ALL_GATHER = {"send_of": lambda r, s: r + 1 - s, "receive_of": lambda r, s: r - s, "combine": "copy"}
TODO1_MISTAKES = {  # cause -> what differs from REDUCE_SCATTER (n: the world size)
    "the partial sum from the left is added into the chunk this rank just sent, not into the one that arrived":
        lambda n: {"receive_of": lambda r, s: r - s},
    "the partial sum from the left replaced this rank's own values instead of being added to them":
        lambda n: {"combine": "copy"},
    "the ring stopped a step early: one rank's values never reached this chunk": lambda n: {"steps": n - 2},
}  # fmt: skip
TODO2_MISTAKES = {  # cause -> what differs from ALL_GATHER
    "a rank passed on a chunk it did not hold yet (NaN), so NaN spread: it must pass on one it holds, its finished "
    "one first": lambda n: {"send_of": lambda r, s: r - s, "receive_of": lambda r, s: r - 1 - s},
    "the chunk never arrived: the ring stopped a step early (n - 1 chunks must arrive)": lambda n: {"steps": n - 2},
}


def reduce_scatter_cause(inputs, x, rank, owned) -> str | None:
    """The likely cause when a known mistake leaves this rank's tensor exactly as `x` (all its chunks), or a
    description of the owned chunk's sum when it is over some ranks only."""
    n = len(inputs)
    if torch.equal(x, inputs[rank]):
        return (
            "the tensor still holds this rank's own values: the sums never reached it (`chunks[i] = chunks[i] + ...` "
            "puts a new tensor in the list; add into the chunk in place)"
        )
    held = [list(t.tensor_split(n)) for t in inputs]
    for cause, change in TODO1_MISTAKES.items():
        result = ring_phase(held, **{**REDUCE_SCATTER, "steps": n - 1, **change(n)})
        if result is not None and torch.equal(torch.cat(result[rank]), x):
            return cause
    got = x.tensor_split(n)[owned]
    for size in range(1, n):
        for ranks in itertools.combinations(range(n), size):
            if torch.equal(sum(inputs[r].tensor_split(n)[owned] for r in ranks), got):
                return f"it holds the sum over ranks {list(ranks)} only"
    return None


def all_gather_cause(start, got, rank) -> str | None:
    n = len(start)
    for cause, change in TODO2_MISTAKES.items():
        result = ring_phase(start, **{**ALL_GATHER, "steps": n - 1, **change(n)})
        if result is not None and same(torch.cat(result[rank]), got):
            return cause
    return None


# --- pass_around_ring with the sizes told first: a receive too small for what arrives raises an error that says
# so, blamed on the TODO that called it (gloo itself aborts the process); a smaller message fills the receive's
# front, as in gloo ---

views: list[torch.Tensor] = []  # the chunks of the tensor under test, to name a tensor the lesson passes


def index_of(tensor) -> int:
    """Which chunk of the tensor under test `tensor` is (a view of the same elements), or -1."""
    if tensor.numel() == 0:  # an empty view has no elements to tell it apart
        return -1
    same_view = ((v.data_ptr(), v.numel()) for v in views)
    return next((i for i, view in enumerate(same_view) if view == (tensor.data_ptr(), tensor.numel())), -1)


def sizes_told(original):
    def pass_around_ring(send, receive):
        rank, n = dist.get_rank(), dist.get_world_size()
        told = torch.tensor([send.numel(), index_of(send)])
        heard = torch.empty_like(told)
        request = dist.isend(told, dst=(rank + 1) % n)
        dist.recv(heard, src=(rank - 1) % n)
        request.wait()
        arriving, chunk = int(heard[0]), int(heard[1])
        if arriving > receive.numel():
            into = f"chunk {index_of(receive)}" if index_of(receive) >= 0 else "a tensor"
            sized_like_sent = receive.numel() == send.numel()
            likely = " (sized like the chunk it sends, not like the one that arrives)" * sized_like_sent
            raise ValueError(
                f"rank {rank} receives {f'chunk {chunk}' if chunk >= 0 else 'a tensor'} of {arriving} element(s) from "
                f"rank {(rank - 1) % n} into {into} of {receive.numel()}{likely}: tensor_split's chunks differ in size"
            )
        original(send, receive)

    return pass_around_ring


def check(compare, world_size, save):
    """{shape: outcome} of one check, each shape saved as it is done (a later shape may crash the launch)."""
    results = {}
    for shape in SHAPES:
        try:
            mine = compare(shape)
        except NotImplementedError as error:
            results[str(shape)] = f"not done: {error}"
            continue
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        gaps = [r["gap"] for r in everyone]
        first = next((r["problem"] for r in everyone if r["problem"]), None)  # the lowest rank's
        results[str(shape)] = {"gap": float("nan") if any(g != g for g in gaps) else max(gaps), "problem": first}
        save(results)
    return results


def main():
    lesson_path, out_path = sys.argv[1], sys.argv[2]
    _, rank, _, world_size = setup(seed=0)
    lesson = load_script(lesson_path, "lesson01")
    lesson.pass_around_ring = sizes_told(lesson.pass_around_ring)
    n = world_size

    def inputs_of(shape):
        return [rank_tensor(shape, r).view(-1) for r in range(n)]

    def library_sum(x):
        expected = x.clone()
        dist.all_reduce(expected)
        return expected

    def todo1_reduce_scatter(shape):
        inputs = inputs_of(shape)
        x = inputs[rank].clone()
        expected = library_sum(x)
        chunks = list(x.tensor_split(n))
        views[:] = chunks
        lesson.ring_reduce_scatter(chunks)
        owned = (rank + 1) % n  # the chunk this rank must hold, summed, after the phase
        # Read from the tensor, not the list: the chunks are views, and the sum must land in the tensor they view.
        got, want = x.tensor_split(n)[owned], expected.tensor_split(n)[owned]
        offset = sum(len(c) for c in expected.tensor_split(n)[:owned])
        return outcome(got, want, f"rank {rank}'s", lambda: reduce_scatter_cause(inputs, x, rank, owned), offset, n)

    def todo2_all_gather(shape):
        total = sum(inputs_of(shape))
        expected_chunks = total.tensor_split(n)

        def start(r):  # the state TODO 1 leaves behind: rank r holds its finished chunk, NaN elsewhere
            chunks = list(torch.full_like(total, float("nan")).tensor_split(n))
            chunks[(r + 1) % n].copy_(expected_chunks[(r + 1) % n])
            return chunks

        gathered = torch.cat(start(rank))
        chunks = list(gathered.tensor_split(n))  # views into one tensor, as ring_all_reduce makes them
        views[:] = chunks
        lesson.ring_all_gather(chunks)
        return outcome(gathered, total, f"rank {rank}'s", lambda: all_gather_cause(
            [start(r) for r in range(n)], gathered, rank), n=n)  # fmt: skip

    def ring_all_reduce(shape):
        x = inputs_of(shape)[rank].view(shape).clone()
        expected = library_sum(x)
        views[:] = x.view(-1).tensor_split(n)
        result = lesson.ring_all_reduce(x)
        return outcome(result.reshape(-1), expected.view(-1), f"rank {rank}'s", n=n)

    def todo3_rs_ag(shape):
        inputs = inputs_of(shape)
        x = inputs[rank].view(shape).clone()
        expected = library_sum(x)
        result = lesson.all_reduce_from_collectives(x)
        if result.shape != expected.shape:
            return {"gap": float("inf"), "problem": f"it returned a tensor of shape {tuple(result.shape)}, not "
                    f"{tuple(expected.shape)}"}  # fmt: skip
        got, want = x.view(-1), expected.view(-1)  # in place: x itself must hold the sum

        def cause():
            if torch.equal(got, inputs[rank]):
                return (
                    "the tensor still holds this rank's own values: the sum must be written into it (returning a new "
                    "tensor leaves the caller's unchanged)"
                )
            if torch.allclose(got, want / n, rtol=1e-6, atol=1e-6):
                return "it holds the mean over the ranks, not the sum"
            return None

        return outcome(got, want, f"rank {rank}'s", cause)

    checks = {"todo1": todo1_reduce_scatter, "todo2": todo2_all_gather, "ring": ring_all_reduce, "todo3": todo3_rs_ag}
    chosen = sys.argv[3:] or list(checks)  # the test re-runs one check at a time when a launch crashes
    results = {}

    def save(one):  # rank 0 writes what is done so far, whole (a crash never leaves half a file)
        if rank == 0:
            Path(out_path + ".part").write_text(json.dumps({**results, name: one}))
            os.replace(out_path + ".part", out_path)

    for name in chosen:
        results[name] = check(checks[name], world_size, save)
    destroy_process_group()


if __name__ == "__main__":
    main()

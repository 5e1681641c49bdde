"""Lesson 09, part 1: context parallelism (ring attention) trains exactly like one process.

pytest tests/test_09_context.py                      # the solution
pytest tests/test_09_context.py --target exercises   # your exercise (make check LESSON=09)

The reference is never the learner's own code. TODOs 1-3 are checked in this process against plain tensor code
written here; TODOs 4 and 5 (the ring forward and backward) run N ranks as N threads of this process that pass
their blocks through a mailbox in place of isend/irecv, against F.scaled_dot_product_attention(is_causal=True)
and its autograd on the whole sequence (TODO 4 with this file's block attention and merge in place of TODOs 2
and 3, so that each TODO is checked on its own). The training runs, at 2 and 4 ranks with both splits and at 3
ranks with zigzag (36 tokens: 2 x 3 chunks), are compared with lesson 00's solution on one process at the same
sequence length (the same seed, the same batches, SGD) and launched once each. No test asserts on a timing (the
timeline test checks the order of the ring's events, not their durations).
"""

import contextlib
import importlib.util
import math
import queue
import re
import threading

import pytest
import torch
import torch.nn.functional as F

from tests.launch import ROOT, course_env, finished, python, torchrun
from tests.option_effects import check_shared_options, fake_wikitext
from utils.context_parallel import in_flight
from utils.distributed_utils import CourseError
from utils.make_exercises import make_exercise

TOLERANCE = 1e-6  # fp32, SGD: ring attention and one process differ only by the order of additions
COMMON = [
    "--parallel", "cp", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "32", "--steps", "3",
    "--optimizer", "sgd", "--log-every", "1", "--batch-size", "4",
]  # fmt: skip
RUNS_SPLITS = ("contiguous", "zigzag")
SEQ_LEN = 32  # COMMON's
RUNS = {f"{n}_{split}": (n, split, SEQ_LEN) for n in (2, 4) for split in RUNS_SPLITS}  # name: (ranks, split, seq len)
RUNS["3_zigzag"] = (3, "zigzag", 36)  # 3 ranks: 36 tokens cut into 2 x 3 chunks (32 is refused, tested below)
ENV = course_env(PYTHONPATH=ROOT)  # `import utils` also for a script in another folder (--target-dir)
WAIT_S = 15  # a simulated rank that waits longer than this for a block will never get it


@pytest.fixture(scope="module")
def script(lesson):
    """The lesson script imported as a module (its functions, without running main)."""
    spec = importlib.util.spec_from_file_location("lesson09_context_under_test", lesson("09"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call(todo: int, function, *args):
    """function(*args), or a failure naming the TODO when the exercise has not done it yet or raises."""
    try:
        return function(*args)
    except NotImplementedError as error:
        pytest.fail(f"TODO {todo}: not done yet ({error})", pytrace=False)
    except Exception as error:  # a learner's mistake that raises: name the TODO, keep the cause
        pytest.fail(f"TODO {todo}: {function.__name__} raised {type(error).__name__}: {error}", pytrace=False)


# ---------------------------------------------------------------------------------------------------------------
# References, written here with plain tensor code
# ---------------------------------------------------------------------------------------------------------------


def reference_positions(seq_len: int, rank: int, world_size: int, split: str) -> torch.Tensor:
    places = torch.arange(seq_len)
    if split == "contiguous":
        return places.chunk(world_size)[rank]
    chunks = places.chunk(2 * world_size)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])


def reference_block(q, k, v, q_positions, k_positions):
    """(softmax(q k^T / sqrt(d), hiding later keys) @ v, log-sum-exp of those scores), in float64."""
    scores = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(k_positions[None, :] > q_positions[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return (torch.softmax(scores, dim=-1) @ v.double()).to(q.dtype), lse.to(q.dtype)


def reference_merge(out, lse, block_out, block_lse):
    total = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - total)[..., None] + block_out * torch.exp(block_lse - total)[..., None], total


def reference_pairs(seq_len: int, rank: int, world_size: int, split: str) -> int:
    """The (query piece, key piece) blocks rank `rank` computes in one ring: the pieces are the two halves of each
    rank's tokens; a block is skipped when its first key comes after its last query."""
    mine = reference_positions(seq_len, rank, world_size, split).chunk(2)
    return sum(
        int(keys[0] <= queries[-1])
        for owner in range(world_size)
        for keys in reference_positions(seq_len, owner, world_size, split).chunk(2)
        for queries in mine
    )


def random_qkv(seq_len: int, seed: int, shape=(2, 3), head_dim: int = 8):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, seq_len, head_dim, generator=generator) for _ in range(3)]


# ---------------------------------------------------------------------------------------------------------------
# N ranks in one process: threads, and a mailbox in place of isend/irecv
# ---------------------------------------------------------------------------------------------------------------


class Mailbox:
    """One queue per (sender, receiver): what a rank sends to another waits there until that rank takes it."""

    def __init__(self, size: int):
        self.size = size
        self.queues = {(a, b): queue.Queue() for a in range(size) for b in range(size)}


class FakeRing:
    """The script's Ring, for one simulated rank: start() drops a copy of the tensor in the receiver's queue, and
    wait() takes what the other rank sent (or fails after WAIT_S: nobody sent it). Records what happens."""

    def __init__(self, rank: int, mailbox: Mailbox):
        self.rank, self.size, self.mailbox = rank, mailbox.size, mailbox
        self.pairs = self.starts = self.sent = 0
        self.phase = "forward"  # what RingAttention's timed() sets
        self.blocks_at_start, self.blocks_at_wait = [], []  # blocks computed so far when each exchange began/ended
        self.received_from = []

    def start(self, tensor, send_to: int, receive_from: int):
        assert 0 <= send_to < self.size and 0 <= receive_from < self.size, (
            f"rank {self.rank} sends to rank {send_to} and receives from rank {receive_from}: "
            f"the ranks are 0..{self.size - 1}"
        )
        self.starts += 1
        self.sent += tensor.numel() * tensor.element_size()
        self.blocks_at_start.append(self.pairs)
        self.mailbox.queues[(self.rank, send_to)].put(tensor.clone())
        return FakePending(self, receive_from)

    def count(self, queries: int, keys: int):
        self.pairs += 1

    @contextlib.contextmanager
    def timed(self, phase: str):  # RingAttention's forward and backward run inside it
        self.phase = phase
        yield self


class FakePending:
    def __init__(self, ring: FakeRing, sender: int):
        self.ring, self.sender = ring, sender

    def wait(self):
        try:
            received = self.ring.mailbox.queues[(self.sender, self.ring.rank)].get(timeout=WAIT_S)
        except queue.Empty:
            raise TimeoutError(
                f"rank {self.ring.rank} waited {WAIT_S} s for a block from rank {self.sender}, which never sent it one "
                "(a ring sends to r + 1 and receives from r - 1)"
            ) from None
        self.ring.blocks_at_wait.append(self.ring.pairs)
        self.ring.received_from.append(self.sender)
        return received


def run_ranks(todo: int, world_size: int, work):
    """work(rank, ring) on world_size threads at once; returns ([results by rank], [rings by rank])."""
    mailbox = Mailbox(world_size)
    rings = [FakeRing(rank, mailbox) for rank in range(world_size)]
    results, errors = [None] * world_size, [None] * world_size

    def target(rank):
        try:
            results[rank] = work(rank, rings[rank])
        except BaseException as error:  # noqa: BLE001 (reported below, naming the TODO)
            errors[rank] = error

    threads = [threading.Thread(target=target, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if failed:
        rank, error = failed[0]
        if isinstance(error, NotImplementedError):
            pytest.fail(f"TODO {todo}: not done yet ({error})", pytrace=False)
        pytest.fail(
            f"TODO {todo}: on {world_size} ranks, rank {rank} raised {type(error).__name__}: {error}", pytrace=False
        )
    return results, rings


def whole(pieces_by_rank, positions_by_rank, seq_len):
    """The ranks' pieces [..., n, d] (or [..., n]) put back at their places in the sequence."""
    first = pieces_by_rank[0]
    if first.dim() == 3:  # lse: [B, H, n]
        return whole([p[..., None] for p in pieces_by_rank], positions_by_rank, seq_len)[..., 0]
    full = torch.zeros(*first.shape[:-2], seq_len, first.shape[-1], dtype=first.dtype)
    for piece, places in zip(pieces_by_rank, positions_by_rank):
        full[..., places, :] = piece
    return full


# (2, "zigzag", 4): pieces of one token, where a block's first key can be its last query (the diagonal, computed)
RING_CASES = [(2, "contiguous", 16), (2, "zigzag", 4), (3, "zigzag", 12), (4, "contiguous", 16), (4, "zigzag", 16)]


# ---------------------------------------------------------------------------------------------------------------
# The checks of each TODO on its own, as functions: the tests call them, and later tests call them first
# ---------------------------------------------------------------------------------------------------------------


def check_todo1(script):
    for world_size in (1, 2, 3, 4):
        for split in ("contiguous", "zigzag"):
            seq_len = 2 * world_size * 3
            seen = []
            for rank in range(world_size):
                got = call(1, script.chunk_positions, seq_len, rank, world_size, split)
                want = reference_positions(seq_len, rank, world_size, split)
                assert torch.is_tensor(got) and torch.equal(got.long().cpu(), want), (
                    f"TODO 1: --cp-split {split}, {world_size} ranks, --seq-len {seq_len}: rank {rank} holds places "
                    f"{want.tolist()}, got {got.tolist() if torch.is_tensor(got) else got}"
                )
                seen += got.tolist()
            assert sorted(seen) == list(range(seq_len)), f"TODO 1: {split}: the ranks do not cover each place once"


def check_todo2(script):
    q, k, v = random_qkv(7, seed=1)
    cases = {
        "keys all before the queries": (torch.arange(20, 25), torch.arange(0, 7)),
        "the diagonal (same places)": (torch.arange(8, 13), torch.arange(8, 13)),
        "keys overlapping the queries": (torch.arange(10, 15), torch.arange(6, 13)),
    }
    for what, (q_positions, k_positions) in cases.items():
        n, m = len(q_positions), len(k_positions)
        queries, keys, values = q[..., :n, :], k[..., :m, :], v[..., :m, :]
        got = call(2, script.block_attention, queries, keys, values, q_positions, k_positions)
        want_out, want_lse = reference_block(queries, keys, values, q_positions, k_positions)
        out, lse = got
        assert out.shape == want_out.shape and lse.shape == want_lse.shape, (
            f"TODO 2: {what}: shapes {tuple(out.shape)}, {tuple(lse.shape)}; expected {tuple(want_out.shape)}, "
            f"{tuple(want_lse.shape)}"
        )
        assert torch.allclose(out, want_out, atol=1e-5), (
            f"TODO 2: {what} (query places {q_positions[0]}..{q_positions[-1]}, key places {k_positions[0]}.."
            f"{k_positions[-1]}): the output differs from softmax(q k^T / sqrt(d), later keys hidden) v by "
            f"{(out - want_out).abs().max():.2e}"
        )
        assert torch.allclose(lse, want_lse, atol=1e-5), (
            f"TODO 2: {what}: the log-sum-exp differs from the reference by {(lse - want_lse).abs().max():.2e}"
        )


def check_todo3(script):
    for scale in (1.0, 400.0):  # 400: scores in the hundreds, where exp() alone overflows float32
        q, k, v = random_qkv(12, seed=2)
        q = q * scale
        places = torch.arange(12)
        want_out, want_lse = reference_block(q, k, v, places, places)
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"))
        for block in (slice(0, 5), slice(5, 8), slice(8, 12)):
            block_out, block_lse = reference_block(q, k[..., block, :], v[..., block, :], places, places[block])
            block_out, block_lse = block_out.nan_to_num(0.0), block_lse  # rows that see no key of this block
            got = call(3, script.merge, out, lse, block_out, block_lse)
            out, lse = got
        assert torch.allclose(lse, want_lse, rtol=1e-5, atol=1e-4), (
            f"TODO 3: scores x {scale:g}: after merging three blocks, the log-sum-exp differs from the whole "
            f"softmax's by {(lse - want_lse).abs().max():.2e}"
        )
        assert torch.allclose(out, want_out, atol=1e-5), (
            f"TODO 3: scores x {scale:g}: after merging three blocks, the output differs from attention over all the "
            f"keys at once by {(out - want_out).abs().max():.2e} (rescale the running output AND the block's)"
        )


def ring_forward_on_threads(script, world_size, split, seq_len, seed=3):
    q, k, v = random_qkv(seq_len, seed=seed)
    all_positions = [reference_positions(seq_len, r, world_size, split) for r in range(world_size)]

    def work(rank, ring):
        places = all_positions[rank]
        mine = [t[..., places, :].contiguous() for t in (q, k, v)]
        return script.ring_attention_forward(*mine, places, all_positions, ring)

    results, rings = run_ranks(4, world_size, work)
    return (q, k, v), all_positions, results, rings


def check_todo4(script, monkeypatch):
    """The ring with this file's block attention and merge (TODO 4 checked apart from TODOs 2 and 3)."""
    monkeypatch.setattr(script, "block_attention", reference_block)
    monkeypatch.setattr(script, "merge", reference_merge)
    for world_size, split, seq_len in RING_CASES:
        where = f"TODO 4: {world_size} ranks, --cp-split {split}"
        (q, k, v), all_positions, results, rings = ring_forward_on_threads(script, world_size, split, seq_len)
        out = whole([r[0] for r in results], all_positions, seq_len)
        lse = whole([r[1] for r in results], all_positions, seq_len)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        _, want_lse = reference_block(q, k, v, torch.arange(seq_len), torch.arange(seq_len))
        for rank, ring in enumerate(rings):
            assert ring.starts == world_size - 1, (
                f"{where}: rank {rank} started {ring.starts} exchanges; N - 1 = {world_size - 1} bring every block"
            )
            assert ring.received_from == [(rank - 1) % world_size] * (world_size - 1), (
                f"{where}: rank {rank} received from ranks {ring.received_from}, not from {(rank - 1) % world_size}"
            )
            expected = reference_pairs(seq_len, rank, world_size, split)
            assert ring.pairs == expected, (
                f"{where}: rank {rank} computed {ring.pairs} (query piece, key piece) blocks, expected {expected}: "
                "skip exactly the blocks whose first key comes after their last query, and ring.count each other one"
            )
        assert torch.allclose(out, want, atol=1e-5), (
            f"{where}: the ring's output differs from F.scaled_dot_product_attention(is_causal=True) by "
            f"{(out - want).abs().max():.2e}"
        )
        assert torch.allclose(lse, want_lse, atol=1e-4), f"{where}: the log-sum-exp differs from the reference"
        if split == "zigzag":  # every rank computes at every step: each exchange must span some computation
            for rank, ring in enumerate(rings):
                overlapped = [done > began for began, done in zip(ring.blocks_at_start, ring.blocks_at_wait)]
                assert all(overlapped), (
                    f"{where}: rank {rank} computed no block between posting an exchange and waiting for it "
                    f"(blocks computed at each start {ring.blocks_at_start}, at each wait {ring.blocks_at_wait}): "
                    "post the next exchange first, compute on the block you hold, then wait"
                )


def ring_backward_on_threads(script, world_size, split, seq_len):
    """The learner's ring backward on threads, given the reference forward; and autograd's gradients."""
    q, k, v = (t.requires_grad_() for t in random_qkv(seq_len, seed=4))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    d_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    want = torch.autograd.grad(out, (q, k, v), d_out)
    places = torch.arange(seq_len)
    _, lse = reference_block(q.detach(), k.detach(), v.detach(), places, places)
    all_positions = [reference_positions(seq_len, r, world_size, split) for r in range(world_size)]

    def work(rank, ring):
        mine = all_positions[rank]
        pieces = [t.detach()[..., mine, :].contiguous() for t in (d_out, q, k, v, out)]
        return script.ring_attention_backward(*pieces, lse[..., mine].contiguous(), mine, all_positions, ring)

    results, rings = run_ranks(5, world_size, work)
    return want, all_positions, results, rings


def check_todo5(script):
    """The ring backward against autograd through F.scaled_dot_product_attention, given the reference forward."""
    for world_size, split, seq_len in RING_CASES:
        where = f"TODO 5: {world_size} ranks, --cp-split {split}"
        want, all_positions, results, rings = ring_backward_on_threads(script, world_size, split, seq_len)
        for name, index, reference in zip(("queries", "keys", "values"), range(3), want):
            got = whole([r[index] for r in results], all_positions, seq_len)
            assert torch.allclose(got, reference, atol=1e-5), (
                f"{where}: the gradient of the {name} differs from autograd's through F.scaled_dot_product_attention "
                f"by {(got - reference).abs().max():.2e}"
            )
        for rank, ring in enumerate(rings):
            expected = reference_pairs(seq_len, rank, world_size, split)
            assert ring.pairs == expected, f"{where}: rank {rank} computed {ring.pairs} blocks, expected {expected}"
            assert ring.starts == 2 * world_size - 1, (
                f"{where}: rank {rank} started {ring.starts} exchanges; expected N - 1 = {world_size - 1} for the keys "
                f"and values and N = {world_size} for their gradients (the last one brings the rank's own home)"
            )


CHECKS = {1: check_todo1, 2: check_todo2, 3: check_todo3}


@pytest.fixture(scope="module")
def needs(script):
    """needs(1, 3, ...): skip this test, naming them, while those TODOs fail their own checks."""
    outcome = {}

    def check(*todos):
        for todo in todos:
            if todo not in outcome:
                try:
                    if todo == 4:
                        with pytest.MonkeyPatch.context() as patch:
                            check_todo4(script, patch)
                    else:
                        {**CHECKS, 5: check_todo5}[todo](script)
                    outcome[todo] = True
                except BaseException:  # AssertionError, or pytest.fail's exception
                    outcome[todo] = False
        failing = [todo for todo in todos if not outcome[todo]]
        if failing:
            pytest.skip(f"needs TODO {', '.join(map(str, failing))} first (see its own test)")

    return check


# ---------------------------------------------------------------------------------------------------------------
# Each TODO in this process
# ---------------------------------------------------------------------------------------------------------------


def test_todo1_split_gives_each_rank_its_chunks_of_the_sequence(script):
    check_todo1(script)


def test_todo2_block_attention_and_its_log_sum_exp(script):
    check_todo2(script)


def test_todo3_online_softmax_merge_equals_attention_over_all_keys(script):
    check_todo3(script)


def test_todo4_ring_forward_equals_causal_sdpa_and_skips_future_blocks(script, monkeypatch):
    check_todo4(script, monkeypatch)


def test_todo5_ring_backward_equals_autograd_of_causal_sdpa(script):
    check_todo5(script)


def test_todo5_ring_attention_function_trains_like_causal_sdpa(script, needs):
    """The whole autograd Function (TODO 4's forward, TODO 5's backward) on 4 simulated ranks, through autograd:
    each rank's output and its q, k, v gradients against F.scaled_dot_product_attention's on the whole sequence."""
    needs(1, 2, 3, 4)
    world_size, seq_len = 4, 16
    q, k, v = (t.requires_grad_() for t in random_qkv(seq_len, seed=6))
    want_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    d_out = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(7))
    want = torch.autograd.grad(want_out, (q, k, v), d_out)
    all_positions = [reference_positions(seq_len, r, world_size, "zigzag") for r in range(world_size)]

    def work(rank, ring):
        mine = all_positions[rank]
        leaves = [t.detach()[..., mine, :].clone().requires_grad_() for t in (q, k, v)]
        out = script.RingAttention.apply(*leaves, mine, all_positions, ring)
        out.backward(d_out[..., mine, :])
        return out.detach(), *(leaf.grad for leaf in leaves)

    results, _ = run_ranks(5, world_size, work)
    got_out = whole([r[0] for r in results], all_positions, seq_len)
    assert torch.allclose(got_out, want_out, atol=1e-5), "TODO 5: RingAttention's output differs from causal SDPA"
    for name, index, reference in zip(("queries", "keys", "values"), (1, 2, 3), want):
        got = whole([r[index] for r in results], all_positions, seq_len)
        assert torch.allclose(got, reference, atol=1e-5), (
            f"TODO 5: through RingAttention, the gradient of the {name} differs from causal SDPA's by "
            f"{(got - reference).abs().max():.2e}"
        )


def test_refused_sequence_lengths(script):
    for seq_len, world_size, split, words in [
        (32, 3, "contiguous", "use --seq-len 33 (a multiple of 3)"),
        (32, 3, "zigzag", "use --seq-len 36 (a multiple of 6)"),
        (20, 4, "zigzag", "use --seq-len 24 (a multiple of 8)"),
    ]:
        with pytest.raises(CourseError, match=re.escape(words)) as refused:
            script.check_context_split(seq_len, world_size, split)
        assert "\n" not in str(refused.value), f"one line: {refused.value}"
    script.check_context_split(32, 4, "zigzag")
    script.check_context_split(12, 3, "contiguous")


def test_untouched_exercise_stops_at_todo1(tmp_path):
    solution = ROOT / "solutions" / "09_context_and_experts.py"
    exercise = tmp_path / "exercises" / solution.name
    exercise.parent.mkdir()
    exercise.write_text(make_exercise(solution.read_text(), solution.name)[0])
    result = python(exercise, [*COMMON, "--log-dir", tmp_path / "runs"], env=ENV, timeout=90)
    assert result.returncode == 2 and "ERROR: TODO 1: the split of the sequence is not done yet" in result.output, (
        result.tail()
    )


# ---------------------------------------------------------------------------------------------------------------
# Runs, against lesson 00's solution on one process
# ---------------------------------------------------------------------------------------------------------------


def with_seq_len(args: list, seq_len: int) -> list:
    """COMMON's arguments (or a part of them) with --seq-len set to seq_len."""
    at = args.index("--seq-len") + 1
    return [*args[:at], str(seq_len), *args[at + 1 :]]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """baseline(seq_len) -> lesson 00's solution on one process, the same global batch: the reference every run of
    that sequence length is compared with (launched the first time it is asked for)."""
    done = {}

    def launch(seq_len: int = SEQ_LEN):
        if seq_len not in done:
            folder = tmp_path_factory.mktemp(f"lesson00_{seq_len}")
            args = [*with_seq_len(COMMON[2:], seq_len), "--log-dir", folder / "runs"]
            args += ["--checkpoint", folder / "model.pt"]
            result = python(ROOT / "solutions" / "00_setup_and_baseline.py", args, tmp_path=folder).check()
            done[seq_len] = result.metrics, torch.load(folder / "model.pt", weights_only=True)["model"]
        return done[seq_len]

    return launch


@pytest.fixture(scope="module")
def run(lesson, tmp_path_factory):
    """run(name) -> (Run, folder): launches RUNS[name] the first time it is asked for."""
    tmp, done = tmp_path_factory.mktemp("lesson09_cp"), {}

    def launch(name):
        if name not in done:
            nproc, split, seq_len = RUNS[name]
            folder = tmp / name
            folder.mkdir()
            args = [*with_seq_len(COMMON, seq_len), "--cp-split", split, "--log-dir", folder / "runs"]
            args += ["--checkpoint", folder / "model.pt"]
            done[name] = torchrun(lesson("09"), nproc, args, tmp_path=folder, env=ENV, timeout=240), folder
        return done[name]

    return launch


@pytest.mark.parametrize("name", list(RUNS))
def test_todo5_training_matches_lesson_00_on_one_process(run, baseline, needs, name):
    needs(1, 2, 3, 4)
    nproc, split, seq_len = RUNS[name]
    reference, reference_weights = baseline(seq_len)
    result, folder = run(name)
    metrics = finished(result, 5)
    weights = torch.load(folder / "model.pt", weights_only=True)["model"]
    assert weights.keys() == reference_weights.keys(), "the parameters are not lesson 00's (names)"
    difference = max(float((weights[n] - reference_weights[n]).abs().max()) for n in weights)
    assert difference <= TOLERANCE, (
        f"TODO 5: after 3 SGD steps, {name} differs from lesson 00 on one process by {difference:.1e} on some parameter"
    )
    assert metrics["losses"] == pytest.approx(reference["losses"], abs=TOLERANCE), f"TODO 5: {metrics['losses']}"
    assert metrics["param_checksum"] == pytest.approx(reference["param_checksum"], rel=1e-9), "TODO 5: checksum"
    assert (metrics["world_size"], metrics["cp_split"], metrics["parallel"], metrics["impl"], metrics["seq_len"]) == (
        nproc, split, "cp", "scratch", seq_len,
    ), metrics  # fmt: skip
    assert metrics["positions"] == [reference_positions(seq_len, r, nproc, split).tolist() for r in range(nproc)]
    assert metrics["bytes_per_rank"] == [reference["bytes_per_rank"]] * nproc, "every rank holds the whole model"
    lines = result.output.rstrip().splitlines()
    noisy = [line for line in lines if re.search(r"warn|\[W\d{4}|unwaited", line, re.IGNORECASE)]
    assert not noisy, f"{name} printed warnings:\n" + "\n".join(noisy[:6])
    assert lines[-1].startswith("FINISHED") or lines[-1] == "done", lines[-3:]


def chunk_bytes(metrics) -> int:
    """One rank's keys (or values) of one layer: batch x tokens per rank x dim x 4 bytes (fp32)."""
    args = dict(zip(COMMON[::2], COMMON[1::2]))
    return int(args["--batch-size"]) * metrics["seq_len"] // metrics["world_size"] * int(args["--dim"]) * 4


def test_todo5_ring_bytes_per_step_match_the_formula(run, needs):
    """Per layer, forward: N - 1 hops of a rank's keys and values; backward: N - 1 again, plus N hops of their
    gradients (the last brings each rank's own home)."""
    needs(1, 2, 3, 4)
    layers = int(dict(zip(COMMON[::2], COMMON[1::2]))["--n-layers"])
    for name in RUNS:
        metrics = finished(run(name)[0], 5)
        n, chunk = metrics["world_size"], chunk_bytes(metrics)
        sent = metrics["ring_bytes_per_step"]
        assert sent["forward"] == [layers * 2 * (n - 1) * chunk] * n, f"{name}: forward bytes {sent['forward']}"
        assert sent["backward"] == [layers * (2 * (n - 1) + 2 * n) * chunk] * n, f"{name}: backward {sent['backward']}"


def test_todo5_the_ring_posts_each_exchange_before_computing(run, needs):
    """The last step's timeline of every zigzag run (utils/context_parallel.py records it on every rank): every
    layer's forward, then every layer's backward; in each, one computation per ring step (zigzag: every rank has
    work at every step), and at each step but the last an exchange was posted and not yet waited for when the
    computation began (the transfer runs during it); the last step has nothing left to receive."""
    needs(1, 2, 3, 4)
    layers = int(dict(zip(COMMON[::2], COMMON[1::2]))["--n-layers"])
    for name, (n, split, _) in RUNS.items():
        if split != "zigzag":
            continue
        metrics = finished(run(name)[0], 5)
        for rank, calls in enumerate(metrics["ring_timeline_per_rank"]):
            assert [call["phase"] for call in calls] == ["forward"] * layers + ["backward"] * layers, (name, rank)
            for call in calls:
                todo = 4 if call["phase"] == "forward" else 5
                found = in_flight(call["events"])
                assert [count > 0 for count in found] == [True] * (n - 1) + [False], (
                    f"TODO {todo}: {name}, rank {rank}, {call['phase']}: exchanges in flight when each step's "
                    f"computation began: {found}; post the next exchange first, then compute, then wait"
                )
                starts = [start for _, start, _ in call["events"]]
                assert starts == sorted(starts) and all(end >= start for _, start, end in call["events"]), call


def test_todo5_zigzag_balances_the_causal_work(run, needs):
    """Contiguous chunks: the last rank computes the most blocks (its queries see every key before them); zigzag:
    every rank the same, for the same total."""
    needs(1, 2, 3, 4)
    for n in (2, 4):
        seq_len = finished(run(f"{n}_zigzag")[0], 5)["seq_len"]
        # What "--cp-split" changes: which blocks of the causal attention each rank computes (not their total).
        work = {split: finished(run(f"{n}_{split}")[0], 5)["attention_pairs_per_rank"] for split in RUNS_SPLITS}
        for split, pairs in work.items():
            assert pairs == [reference_pairs(seq_len, r, n, split) for r in range(n)], (split, pairs)
        assert work["contiguous"] == sorted(work["contiguous"]) and work["contiguous"][0] < work["contiguous"][-1]
        assert len(set(work["zigzag"])) == 1, f"zigzag is not balanced on {n} ranks: {work['zigzag']}"
        assert sum(work["zigzag"]) == sum(work["contiguous"]), work
        assert max(work["zigzag"]) < max(work["contiguous"]), work


def test_todo5_attention_saves_one_nth_of_one_process_per_rank(run, needs):
    """What one attention layer keeps for backward on each rank: this rank's q, k, v, output (B x H x T/N x hd
    each) and log-sum-exp (B x H x T/N), in fp32; 1/N of F.scaled_dot_product_attention's on one process, at every
    sequence length (linear in T: no T x T score matrix is kept)."""
    needs(1, 2, 3, 4)
    args = dict(zip(COMMON[::2], COMMON[1::2]))
    heads, dim = int(args["--n-heads"]), int(args["--dim"])
    for name in RUNS:
        metrics = finished(run(name)[0], 5)
        n, batch = metrics["world_size"], metrics["attention_shape"][0]
        assert metrics["attention_shape"][1:] == [heads, dim // heads], metrics["attention_shape"]
        for at, seq_len in enumerate(metrics["attention_seq_lens"]):
            formula = 4 * (4 * batch * seq_len // n * dim + batch * heads * seq_len // n)
            per_rank = [measured[at] for measured in metrics["attention_saved_bytes_per_rank"]]
            assert per_rank == [formula] * n, f"{name}, --seq-len {seq_len}: saved bytes {per_rank}, formula {formula}"
            assert per_rank[0] * n <= metrics["attention_saved_bytes_one_process"][at], (name, seq_len)


def test_a_sequence_that_does_not_split_is_refused_on_3_ranks(lesson, tmp_path):
    """32 tokens do not cut into 2 x 3 zigzag chunks: every rank stops at once with the same line naming the fix."""
    result = torchrun(lesson("09"), 3, [*COMMON, "--log-dir", tmp_path / "runs"], env=ENV, timeout=120)
    errors = [line for line in result.output.splitlines() if "ERROR:" in line]
    assert result.returncode != 0 and errors, result.tail()
    message = "ERROR: --seq-len 32 does not cut into 6 equal chunks (--cp-split zigzag: 2 chunks per rank, 3 ranks): "
    assert all(message + "use --seq-len 36 (a multiple of 6)" in line for line in errors), result.tail()
    assert "Traceback" not in "\n".join(line for line in result.output.splitlines() if line.startswith("[rank")), (
        result.tail()
    )


def test_builtin_is_refused_on_cpu_in_one_line(lesson, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --impl builtin runs there (tests/gpu_check.py)")
    result = python(lesson("09"), [*COMMON, "--impl", "builtin", "--log-dir", tmp_path / "runs"], env=ENV, timeout=90)
    errors = [line for line in result.output.splitlines() if "ERROR:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.tail()
    assert "needs a GPU" in errors[0] and "use --impl scratch" in errors[0], errors[0]


@pytest.mark.parametrize("parallel, option, value", [("cp", "--experts", "8"), ("ep", "--cp-split", "contiguous")])
def test_the_other_parts_options_are_refused(lesson, tmp_path, parallel, option, value):
    """An option of expert parallelism would be ignored by --parallel cp (and the other way round): refused."""
    args = ["--parallel", parallel, option, value, "--steps", 1, "--log-dir", tmp_path / "runs"]
    result = python(lesson("09"), args, env=ENV, timeout=90)
    assert result.returncode == 2 and "Traceback" not in result.output, result.tail()
    other = "ep" if parallel == "cp" else "cp"
    assert f"argument {option}: an option of --parallel {other}, not of --parallel {parallel}" in result.output


def test_shared_options_change_the_run(lesson, tmp_path):
    """Every shared option but --autocast (refused), at a value other than its default, with --parallel cp on one
    process (a ring of one, --cp-split contiguous): the run trains like the same steps written out with PyTorch
    alone on lesson 00's batches (tests/option_effects.py), logged where it says."""
    fake_wikitext(tmp_path / "data")
    args = [
        "--parallel", "cp", "--cp-split", "contiguous", "--impl", "scratch",
        "--steps", 3, "--seed", 3, "--batch-size", 4, "--optimizer", "sgd", "--lr", 0.05, "--dataset", "wikitext",
        "--data-dir", tmp_path / "data", "--seq-len", 16, "--dim", 24, "--n-layers", 1, "--n-heads", 3,
        "--log-dir", tmp_path / "runs", "--log-every", 2, "--wandb", "--checkpoint", tmp_path / "model.pt",
        "--metrics-out", tmp_path / "metrics.json",
    ]  # fmt: skip
    result = python(lesson("09"), args, timeout=180, env=ENV)
    finished(result, 5)
    check_shared_options(result, order="generator")

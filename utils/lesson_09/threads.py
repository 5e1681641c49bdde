"""N ranks as N threads of one process, for lesson 09's ring and all-to-all without torchrun: the notebook's live
figures and the tests of the TODOs run the lesson's functions this way.

    results, rings, errors = run_on_threads(4, work)      # work(rank, ring, all_to_all) on 4 threads at once

`ring` has the methods of utils/lesson_09/ring.py's Ring (start, count, timed) and records what its rank did, in
order (`ring.log`); `all_to_all(blocks)` is a differentiable all-to-all of equal blocks (blocks [N, ...]: block j
goes to rank j, and block j of the result came from rank j), as the lesson's AllToAll is on a process group.
Messages wait in one queue per (sender, receiver) until the receiver takes them, in the order they were sent.
"""

import contextlib
import queue
import threading

import torch

WAIT_S = 15  # a simulated rank that waits longer than this for a message will never get it


class Mailbox:
    """One queue per (sender, receiver): what a rank sends to another waits there until that rank takes it."""

    def __init__(self, size: int):
        self.size = size
        self.queues = {(a, b): queue.Queue() for a in range(size) for b in range(size)}

    def take(self, sender: int, receiver: int, what: str) -> torch.Tensor:
        try:
            return self.queues[(sender, receiver)].get(timeout=WAIT_S)
        except queue.Empty:
            raise TimeoutError(
                f"rank {receiver} waited {WAIT_S} s for {what} from rank {sender}, which never sent it"
            ) from None


class ThreadRing:
    """The lesson's Ring for one simulated rank. `log` keeps, in order: ("post", tensor sent, send_to,
    receive_from), ("wait", sender, the index of its post in the log), ("block", q_positions, k_positions, phase,
    step); `step` counts the exchanges this rank has waited for (in the forward: the ring step of its blocks)."""

    def __init__(self, rank: int, mailbox: Mailbox):
        self.rank, self.size, self.mailbox = rank, mailbox.size, mailbox
        self.phase, self.step, self.log = "forward", 0, []
        self.posted = {sender: [] for sender in range(self.size)}  # receives not yet matched, in posting order

    def start(self, tensor: torch.Tensor, send_to: int, receive_from: int) -> "ThreadPending":
        if not (0 <= send_to < self.size and 0 <= receive_from < self.size):
            raise ValueError(f"rank {self.rank} sends to rank {send_to} and receives from rank {receive_from}: the "
                             f"ranks are 0..{self.size - 1}")  # fmt: skip
        self.log.append(("post", tensor.detach().clone(), send_to, receive_from))
        self.mailbox.queues[(self.rank, send_to)].put(tensor.detach().clone())
        return ThreadPending(self, receive_from, len(self.log) - 1)

    def count(self, q_positions: torch.Tensor, k_positions: torch.Tensor):
        self.log.append(("block", q_positions.clone(), k_positions.clone(), self.phase, self.step))

    @contextlib.contextmanager
    def timed(self, phase: str):  # RingAttention's forward and backward run inside it
        self.phase = phase
        yield self

    def events(self, kind: str) -> list:
        return [event for event in self.log if event[0] == kind]


class ThreadPending:
    """A posted receive. As with irecv, the receives from one sender get its messages in the order they were
    posted, whichever is waited for first."""

    def __init__(self, ring: ThreadRing, sender: int, post: int):
        self.ring, self.sender, self.post, self.received = ring, sender, post, None
        ring.posted[sender].append(self)

    def wait(self) -> torch.Tensor:
        while self.received is None:
            message = self.ring.mailbox.take(self.sender, self.ring.rank, "a block")
            self.ring.posted[self.sender].pop(0).received = message
        self.ring.log.append(("wait", self.sender, self.post))
        self.ring.step += 1
        return self.received


class _ThreadAllToAll(torch.autograd.Function):
    """The all-to-all on the mailbox, differentiable: its gradient takes the same exchange (the permutation of
    blocks it applies is its own transpose)."""

    @staticmethod
    def forward(ctx, blocks, mailbox, rank):
        ctx.mailbox, ctx.rank = mailbox, rank
        return _exchange(blocks, mailbox, rank)

    @staticmethod
    def backward(ctx, gradient):
        return _exchange(gradient, ctx.mailbox, ctx.rank), None, None


def _exchange(blocks: torch.Tensor, mailbox: Mailbox, rank: int) -> torch.Tensor:
    if blocks.shape[0] != mailbox.size:
        raise ValueError(f"rank {rank}: all_to_all takes one block per rank, [{mailbox.size}, ...], got "
                         f"{list(blocks.shape)}")  # fmt: skip
    for receiver in range(mailbox.size):
        mailbox.queues[(rank, receiver)].put(blocks[receiver].detach().clone())
    return torch.stack([mailbox.take(sender, rank, "an all-to-all block") for sender in range(mailbox.size)])


def run_on_threads(world_size: int, work) -> tuple[list, list, list]:
    """work(rank, ring, all_to_all) on world_size threads at once: ([results], [rings], [errors]) by rank (an
    error is None where the rank finished). The ring and the all-to-all use separate mailboxes."""
    ring_mail, all_to_all_mail = Mailbox(world_size), Mailbox(world_size)
    rings = [ThreadRing(rank, ring_mail) for rank in range(world_size)]
    results, errors = [None] * world_size, [None] * world_size

    def target(rank):
        def all_to_all(blocks):
            return _ThreadAllToAll.apply(blocks, all_to_all_mail, rank)

        try:
            results[rank] = work(rank, rings[rank], all_to_all)
        except BaseException as error:  # noqa: BLE001 (returned: the caller says which rank and why)
            errors[rank] = error

    threads = [threading.Thread(target=target, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=4 * WAIT_S)
    return results, rings, errors

# Exercise for lesson 08: complete the numbered TODOs. (This file is generated from
# solutions/08_fault_tolerance.py by `python -m utils.course.make_exercises`;
# course maintainers edit the solution.)
"""Lesson 08: fault tolerance. Checkpoints that survive any crash, and a resume that continues the exact same run.

The job dies at hour 30: a rank is killed, a node fails, the scheduler preempts it. This script trains the
course's model (FSDP2 on several ranks, a plain model on one) and every --checkpoint-every steps writes a
checkpoint that holds everything the run depends on: the model and optimizer state (each rank its shards, through
torch.distributed.checkpoint, DCP), the learning-rate schedule, the step, the data position and every rank's
random number generator. A checkpoint is written to a temporary folder and published with one rename, so a crash
during a save leaves the previous checkpoint intact. On start the script resumes from the newest complete
checkpoint, and the resumed run ends bit-identical to one that was never interrupted.

    # rank 0 SIGKILLed at step 25; torchrun restarts both ranks, which resume from step 20 (a fresh TCP store
    # per restart: without it, restarted workers can read the dead workers' addresses and fail to connect)
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=1 \\
        exercises/08_fault_tolerance.py --checkpoint-every 10 --crash-at-step 25
    torchrun --nproc_per_node=2 exercises/08_fault_tolerance.py --async-save           # DCP async_save
    sbatch slurm/08_fault_tolerance.sbatch solutions     # saves on SIGUSR1 (time limit) or SIGTERM (preemption)

SIGUSR1 or SIGTERM asks every rank to finish its step, save and stop. Under torchrun the ranks get it from
torchrun, which SIGKILLs them after its shutdown timeout (30 s by default): give a large model's save the time it
needs with TORCH_ELASTIC_SHUTDOWN_TIMEOUT or `torchrun --shutdown-timeout` (torch releases that have it).
"""

import errno
import io
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DistributedSampler

from utils.course.faults import crash, forget_kill, pause, seconds_since_kill
from utils.course.lessons import lesson
from utils.data import load_token_dataset
from utils.distributed_utils import CourseError, Refusal, destroy_process_group, print0, run_main, setup
from utils.metrics import param_checksum, state_bytes, write_metrics
from utils.model import build_model, count_parameters, loss_fn
from utils.training import (
    ROOT,
    Logger,
    Throughput,
    base_parser,
    build_optimizer,
    check_batches,
    model_config,
    non_negative_float,
    parse_args,
    positive_int,
)

# FSDP2 warns that the model's output is a view (the head's logits): this script never modifies it in place.
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")

POINTER = "latest"  # a one-line file naming the newest published checkpoint folder
META = "meta.json"  # written last into a checkpoint: the run's progress, and the size of every file in it
STAGING = "tmp-"  # a checkpoint being written lives in tmp-step-NNNNNNNN until it is published


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def default_checkpoint_dir() -> Path:
    """checkpoints/08_fault_tolerance: one folder per run name, not per job, so that a resubmitted job (a new job
    id) finds the checkpoints of the run it continues. Another run needs another --checkpoint-dir."""
    return ROOT / "checkpoints" / "08_fault_tolerance"


def attempt() -> int:
    """0 on the first attempt; torchrun counts its restarts, Slurm its requeues."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) + int(os.environ.get("SLURM_RESTART_COUNT") or 0)


def run_config(args, world_size: int) -> dict:
    """What the run's result depends on, stored in every checkpoint: resuming with another --steps, warm-up,
    learning rate, global batch, seed, data or model would silently continue another run, so it is refused."""
    return {
        "steps": args.steps, "warmup_steps": args.warmup_steps, "optimizer": args.optimizer, "lr": args.lr,
        "global_batch": args.batch_size * world_size, "seed": args.seed, "dataset": args.dataset,
        "token_noise": args.token_noise, **asdict(model_config(args)),
    }  # fmt: skip


def check_same_run(folder: Path, meta: dict, run: dict):
    """One line, before any training step, if the checkpoint in `folder` belongs to another run (or model)."""
    saved = meta.get("run")
    if not isinstance(saved, dict):
        raise CourseError(f"{folder} records no run configuration (another script's checkpoint?): start afresh "
                          "with another --checkpoint-dir")  # fmt: skip
    differ = [f"{k} {saved.get(k)!r}, now {v!r}" for k, v in run.items() if saved.get(k) != v]
    if differ:
        raise CourseError(
            f"{folder} was saved by another run ({'; '.join(differ)}): resume with the options it was saved with "
            "(global_batch = --batch-size x ranks), or start afresh with another --checkpoint-dir"
        )


def checkpoint_dir_problem(folder: Path) -> str | None:
    """Why checkpoints cannot be written into `folder` (created here if need be), or None."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file; name a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()  # a file of a unique name: every rank may try at once
    except OSError as error:
        return f"cannot write into {folder} ({error.strerror}); choose a folder you can write to"
    return None


@dataclass
class Progress:
    """Where the run is. `offset` counts the samples of the epoch's global order already trained on (all ranks
    together), so that it means the same thing at any world size."""

    step: int = 0
    epoch: int = 0
    offset: int = 0
    losses: list = field(default_factory=list)


def batches(dataset, sampler: DistributedSampler, batch_size: int, progress: Progress, world_size: int):
    """Endless (inputs, targets) batches of this rank, starting at the data position in `progress`.

    The order of an epoch is a function of (seed, epoch) alone: DistributedSampler shuffles the whole data set
    with that seed on every rank and gives rank r every world_size-th index. So the position needs no RNG
    state: (epoch, offset) is enough, and it advances here as batches are handed out.
    """
    while True:
        sampler.set_epoch(progress.epoch)
        mine = list(sampler)  # this rank's indices of the epoch, in order
        per_step = batch_size * world_size  # samples of the global order one step consumes
        if progress.offset % per_step:
            raise CourseError(
                f"the checkpoint's data position ({progress.offset} samples into epoch {progress.epoch}) is not a "
                f"whole number of global batches of {per_step}: keep --batch-size x ranks as in the run that saved it"
            )
        start = progress.offset // world_size  # the rank's share of the samples already consumed
        for first in range(start, len(mine) - batch_size + 1, batch_size):
            samples = [dataset[i] for i in mine[first : first + batch_size]]
            progress.offset += per_step
            yield torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])
        progress.epoch, progress.offset = progress.epoch + 1, 0
        print0(f"epoch {progress.epoch}: another pass over the data")


def add_token_noise(inputs: torch.Tensor, probability: float, vocab_size: int) -> torch.Tensor:
    """Replace each input token by a random one with `probability`: a data augmentation that draws from the
    rank's global RNG, as dropout would. (It is why a checkpoint must hold every rank's RNG state.)"""
    if probability == 0:
        return inputs
    noisy = torch.rand(inputs.shape) < probability
    return torch.where(noisy, torch.randint(0, vocab_size, inputs.shape), inputs)


def fsync_dir(path: Path):
    """Make a rename or a new file in `path` durable: the directory entry itself must reach the disk.

    Some file systems (some network and FUSE mounts) refuse fsync on a directory (EINVAL, ENOTSUP): there the
    rename is as durable as that file system makes it, and there is nothing more to do."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(descriptor)


def write_durably(path: Path, data: bytes):
    """Write a whole file and force it to the disk before returning."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


# --------------------------------------------------------------------------------------------------
# The checkpoint, from scratch: what it holds, how it is published, how the newest complete one is found
# --------------------------------------------------------------------------------------------------


def checkpoint_state(model, optimizer, scheduler, progress: Progress) -> tuple[dict, dict, dict]:
    """The three parts of a checkpoint: (sharded, per_rank, shared).

    sharded:  {"model", "optimizer"} state dicts, saved with DCP: each rank writes the shards it holds.
    per_rank: {"rng": {"torch": ..., "cuda": ... where present}}: this rank's own, saved as rank-R.pt.
    shared:   {"step", "epoch", "offset", "losses", "scheduler"}: the same on every rank, saved by rank 0.
    """
    # TODO 1: what a checkpoint must hold to resume bit-identically. Everything the next step depends on, in the
    #   three dicts above: model and optimizer state as DCP saves it, this rank's random generators, the LR
    #   schedule and the progress, copied.
    raise NotImplementedError("TODO 1: what a checkpoint must hold to resume bit-identically")


def publish(staging: Path, shared: dict, keep: int) -> Path:
    """Rank 0, once every rank has written its part into `staging`: make the checkpoint visible, atomically.

    Returns the published folder checkpoint_dir/step-NNNNNNNN and removes all but the newest `keep` of them.
    """
    checkpoint_dir = staging.parent
    final = checkpoint_dir / checkpoint_name(shared["step"])
    if final.exists():  # a damaged checkpoint of this step, which the resume skipped: make room
        shutil.rmtree(final)
    # TODO 2: the atomic publish. Whenever a crash strikes, the directory holds the old checkpoint or the new one,
    #   complete and vouched for by its record of sizes, and the pointer leads to a complete one. Each change
    #   reaches the disk before the next.
    raise NotImplementedError("TODO 2: the atomic publish")
    prune(checkpoint_dir, shared["step"], keep)
    return final


def prune(checkpoint_dir: Path, published_step: int, keep: int):
    """Keep the checkpoint just published and the `keep` - 1 newest before it; older ones only cost disk space.

    Only folders of earlier steps are candidates: a folder of a later step is a damaged one the resume skipped
    (else the run would not be here), and counting it among the newest `keep` could delete the one just published.
    """
    older = [f for f in checkpoint_dir.glob("step-*") if int(f.name.split("-")[-1]) < published_step]
    for old in sorted(older)[: max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)


def problem_with(folder: Path) -> str | None:
    """Why `folder` is not a complete checkpoint (its META missing or unreadable, a file missing or of the
    wrong size), or None if it is one."""
    try:
        meta = json.loads((folder / META).read_text())
        files = meta["files"]
    except FileNotFoundError:
        return f"no {META} (the save never finished)"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{META} is unreadable ({type(error).__name__})"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, not {size} (truncated or overwritten)"
    if ".metadata" not in files:
        return "no DCP .metadata"
    return None


def find_latest(checkpoint_dir: Path) -> Path | None:
    """The newest complete checkpoint in `checkpoint_dir`, or None; says why it skips any other."""
    if not checkpoint_dir.is_dir():
        return None
    # TODO 3: find the newest complete checkpoint. Return the newest published checkpoint that passes the
    #   completeness check above, or None; say in one line for every directory passed over which it is and why,
    #   unfinished saves included.
    raise NotImplementedError("TODO 3: find the newest complete checkpoint")


def restore(folder: Path, model, optimizer, scheduler, progress: Progress, rank: int) -> dict:
    """Load the checkpoint in `folder` into the model, optimizer, schedule, data position and RNG; return META."""
    meta = json.loads((folder / META).read_text())
    model_state, optimizer_state = get_state_dict(model, optimizer)  # the layout (and shards) DCP loads into
    sharded = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(sharded, checkpoint_id=str(folder))  # each rank reads the pieces it holds now, whoever wrote them
    set_state_dict(model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    rank_file = folder / f"rank-{rank}.pt"
    per_rank = torch.load(rank_file, weights_only=True) if rank_file.exists() else None
    if per_rank is None:
        print(f"rank {rank}: {folder.name} has no {rank_file.name} (saved by fewer ranks): a fresh RNG", flush=True)
    # TODO 4: put the run back where it was. What checkpoint_state saved outside DCP goes back in place: the LR
    #   schedule, the progress (batches() then resumes at that data position), and this rank's random generators
    #   where it saved them.
    raise NotImplementedError("TODO 4: put the run back where it was")
    return meta


# --------------------------------------------------------------------------------------------------
# Saving: synchronous, or asynchronous with DCP async_save
# --------------------------------------------------------------------------------------------------


class Checkpointer:
    """Saves checkpoints into `checkpoint_dir`: each rank its DCP shards and its rank-R.pt, rank 0 publishes.

    With `use_async`, dcp.async_save copies the state to memory and writes it in a background thread while
    training goes on; the checkpoint is published once every rank's write has finished (checked at each step)
    and is waited for before the next save and before exit. It runs its collectives on a gloo group of its own,
    so they never interleave with the training's collectives on the default group.
    """

    def __init__(self, checkpoint_dir: Path, keep: int, use_async: bool, rank: int, world_size: int, run: dict):
        self.dir, self.keep, self.use_async = checkpoint_dir, keep, use_async
        self.rank, self.world_size, self.run = rank, world_size, run
        self.slow_save_s = 0.0  # test only: stands in for the minutes a large model's save takes
        self.group = dist.new_group(backend="gloo") if use_async else None
        self.pending = None  # (future, staging folder, shared) of an async save not yet published
        self.saves = []  # {"step", "blocking_s", "total_s"} per save: what the learner measures

    def save(self, model, optimizer, scheduler, progress: Progress, crash_now: bool = False) -> float:
        """Save the current state; returns the seconds training was blocked."""
        self.wait()  # one save at a time: the previous async one is finished and published first
        started = time.perf_counter()
        staging = self.dir / (STAGING + checkpoint_name(progress.step))
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        dist.barrier()  # the staging folder exists before anyone writes into it
        sharded, per_rank, shared = checkpoint_state(model, optimizer, scheduler, progress)
        shared = {**shared, "world_size": self.world_size, "run": self.run}  # any world size can load it
        buffer = io.BytesIO()
        torch.save(per_rank, buffer)  # written durably: META will vouch for it once every rank has written it
        write_durably(staging / f"rank-{self.rank}.pt", buffer.getvalue())
        if self.use_async:
            future = dcp.async_save(sharded, checkpoint_id=str(staging), process_group=self.group)
            if crash_now:
                future.result()
                crash(self.rank, f"during the save of step {progress.step}", self.dir)
            self.pending = (future, staging, shared, started)
        else:
            dcp.save(sharded, checkpoint_id=str(staging))
            pause(self.slow_save_s)
            if crash_now:  # every shard is written, nothing is published yet: the worst moment to die
                crash(self.rank, f"during the save of step {progress.step}", self.dir)
            self._publish(staging, shared, started)
        blocking = time.perf_counter() - started
        if self.use_async:
            self.saves.append({"step": progress.step, "blocking_s": blocking})
        else:
            self.saves[-1]["blocking_s"] = blocking
        return blocking

    def _publish(self, staging: Path, shared: dict, started: float):
        dist.barrier()  # every rank's files are complete
        if self.rank == 0:
            final = publish(staging, shared, self.keep)
            print(f"checkpoint {final.name} published", flush=True)
        dist.barrier()  # nobody goes on (or exits) before the checkpoint is published
        if self.use_async:
            self.saves[-1]["total_s"] = time.perf_counter() - started
        else:
            self.saves.append({"step": shared["step"], "total_s": time.perf_counter() - started})

    def done_here(self) -> bool:
        """No async save in flight on this rank (the ranks agree through the step's all-reduce)."""
        return self.pending is None or self.pending[0].done()

    def wait(self):
        """Finish and publish the async save in flight, if any (every rank calls it at the same point)."""
        if self.pending is not None:
            future, staging, shared, started = self.pending
            self.pending = None
            future.result()  # raises here if the background write failed
            self._publish(staging, shared, started)


def main():
    parser = base_parser(__doc__.splitlines()[0], without=("--autocast", "--checkpoint"))  # fp32; its own saves
    parser.add_argument("--checkpoint-dir", type=Path, default=None, help="default: checkpoints/08_fault_tolerance")
    parser.add_argument("--checkpoint-every", type=positive_int, default=50, help="save every N steps (and at the end)")
    parser.add_argument("--keep", type=positive_int, default=2, help="keep the newest N checkpoints")
    parser.add_argument("--async-save", action="store_true", help="write checkpoints in the background (DCP)")
    parser.add_argument("--token-noise", type=non_negative_float, default=0.05, help="input token noise (uses RNG)")
    parser.add_argument("--warmup-steps", type=positive_int, default=10, help="linear LR warm-up, then cosine decay")
    parser.add_argument("--crash-at-step", type=positive_int, default=None, help="test only: SIGKILL at this step")
    parser.add_argument("--crash-rank", type=int, default=0, help="test only: the rank --crash-at-step kills")
    parser.add_argument(
        "--crash-during-save", action="store_true", help="test only: kill inside the save of --crash-at-step"
    )
    parser.add_argument("--slow-steps", type=non_negative_float, default=0, help="test only: seconds added per step")
    parser.add_argument("--slow-save", type=non_negative_float, default=0, help="test only: seconds added per save")
    args = parse_args(parser)
    checkpoint_dir = (args.checkpoint_dir or default_checkpoint_dir()).resolve()
    problem = checkpoint_dir_problem(checkpoint_dir)
    if problem:
        parser.error(f"argument --checkpoint-dir: {problem}")
    if args.crash_during_save and args.crash_at_step and args.crash_at_step % args.checkpoint_every:
        parser.error("argument --crash-during-save: --crash-at-step must be a multiple of --checkpoint-every")

    # A stop request only sets a flag: the step finishes, the ranks agree, and all of them save before they stop.
    # SIGUSR1: Slurm's warning before the time limit (--signal=B:USR1@...), passed on by the batch script, srun and
    # torchrun. SIGTERM: what Slurm sends on preemption or scancel, and what torchrun passes on when it is stopped.
    # torchrun SIGKILLs its workers when its shutdown timeout ends (30 s unless configured): the save must fit.
    stop_requested = []

    def request_stop(signum, frame):
        stop_requested.append(signal.Signals(signum).name)

    for stop_signal in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(stop_signal, request_stop)
    if torch.cuda.is_available():  # bit-identical on GPUs needs deterministic kernels, chosen before any CUDA work
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's reproducible workspace
        torch.use_deterministic_algorithms(True)

    process_started = time.time()
    local_rank, rank, device, world_size = setup(args.seed)
    if not 0 <= args.crash_rank < world_size:
        raise Refusal(f"--crash-rank {args.crash_rank}: choose a rank from 0 to {world_size - 1}")

    train = load_token_dataset(args.dataset, args.seq_len, "train", cache_dir=args.data_dir)
    check_batches(len(train), args, world_size)
    sampler = DistributedSampler(train, world_size, rank, shuffle=True, seed=args.seed, drop_last=True)

    config = model_config(args)
    model = build_model(config, seed=args.seed).to(device)
    if world_size > 1:
        lesson("03").apply_fsdp(model, init_device_mesh(device.type, (world_size,)))  # FSDP2 as lesson 03 shards it
    optimizer = build_optimizer(model.parameters(), args)
    warmup, total = args.warmup_steps, args.steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(  # the LR factor at step s: linear warm-up, then cosine decay
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / total))
    )
    layout = f"FSDP2 over {world_size} ranks" if world_size > 1 else "one process"
    print0(
        f"{count_parameters(config):,} parameters, {layout}"
        f" | checkpoints every {args.checkpoint_every} steps into {checkpoint_dir} (keep {args.keep}"
        f"{', async' if args.async_save else ''}) | attempt {attempt()}"
    )

    # Resume from the newest complete checkpoint, if there is one. Rank 0 decides, everyone follows.
    progress = Progress()
    choice = [find_latest(checkpoint_dir) if rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    resumed_from, restart_s = None, None
    run = run_config(args, world_size)
    if choice[0] is not None:
        meta = json.loads((choice[0] / META).read_text())
        check_same_run(choice[0], meta, run)
        try:
            restore(choice[0], model, optimizer, scheduler, progress, rank)
        except (RuntimeError, ValueError, KeyError, TypeError) as error:  # what does not fit this model
            raise CourseError(
                f"{choice[0]} does not fit this model ({type(error).__name__}: {str(error).splitlines()[0][:120]}); "
                "use the model options it was saved with, or another --checkpoint-dir"
            ) from error
        resumed_from = progress.step
        restart_s = seconds_since_kill(checkpoint_dir)  # after --crash-at-step: how long the restart took
        print0(
            f"resumed from {choice[0].name}: step {progress.step}, epoch {progress.epoch}, {progress.offset} samples"
            f" into it (saved by {meta.get('world_size', '?')} ranks, now {world_size})"
        )
        if restart_s is not None:
            print0(f"restart: training resumes {restart_s:.1f} s after the kill")
    else:
        print0("no checkpoint to resume from: starting at step 0")
    if rank == 0:  # what a crash left behind: partial saves (rewritten if needed) and the test's kill time
        for leftover in checkpoint_dir.glob(STAGING + "*"):
            shutil.rmtree(leftover, ignore_errors=True)
        forget_kill(checkpoint_dir)
    checkpointer = Checkpointer(checkpoint_dir, args.keep, args.async_save, rank, world_size, run)
    checkpointer.slow_save_s = args.slow_save
    dist.barrier()

    data = batches(train, sampler, args.batch_size, progress, world_size)
    logger = Logger(args, total_steps=args.steps - progress.step)
    throughput = Throughput(device)
    step_seconds, stopped = [], False
    first_step_s = time.time() - process_started
    while progress.step < args.steps:
        step_started = time.perf_counter()
        inputs, targets = next(data)
        inputs = add_token_noise(inputs, args.token_noise, config.vocab_size)
        inputs, targets = inputs.to(device), targets.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        pause(args.slow_steps)
        progress.step += 1
        step = progress.step
        # One small all-reduce carries the loss, whether any rank was asked to stop, and how many ranks have
        # finished writing their part of an async checkpoint.
        flags = torch.tensor([float(bool(stop_requested)), float(checkpointer.done_here())], device=device)
        shared = torch.cat([loss.detach().reshape(1), flags])
        dist.all_reduce(shared, op=dist.ReduceOp.SUM)
        progress.losses.append(shared[0].item() / world_size)
        if checkpointer.pending is not None and shared[2].item() == world_size:
            checkpointer.wait()  # every rank has finished writing: publish it now
        if args.crash_at_step == step and rank == args.crash_rank and attempt() == 0 and not args.crash_during_save:
            crash(rank, f"at step {step}, after its optimizer step", checkpoint_dir)
        stop = shared[1].item() > 0
        if stop:
            budget = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30 (the default)")
            print0(f"stop requested ({', '.join(stop_requested) or 'on another rank'}) at step {step}: saving now "
                   f"(under torchrun, its shutdown timeout must outlast the save: {budget} s)")  # fmt: skip
        if step % args.checkpoint_every == 0 or step == args.steps or stop:
            crash_now = args.crash_during_save and args.crash_at_step == step and rank == args.crash_rank
            checkpointer.save(model, optimizer, scheduler, progress, crash_now=crash_now and attempt() == 0)
        step_seconds.append(time.perf_counter() - step_started)
        throughput.step(inputs.numel() * world_size)
        logger.log(step, loss=progress.losses[-1], lr=scheduler.get_last_lr()[0])
        if step % args.log_every == 0 or step == args.steps:
            print0(f"step {step:5d}  loss {progress.losses[-1]:.4f}")
        if stop:
            print0(f"STOPPED at step {step}: checkpoint saved; run the same command again to resume")
            stopped = True
            break
    checkpointer.wait()  # an async save still in flight is finished and published before exit
    logger.close()

    if not stopped:
        lost = args.crash_at_step - resumed_from if resumed_from is not None and args.crash_at_step else None
        write_metrics(
            args.metrics_out,
            final_loss=progress.losses[-1],
            losses=progress.losses,
            steps=len(progress.losses),
            tokens_per_s=throughput.tokens_per_s,
            param_checksum=param_checksum(model),
            bytes_per_rank=state_bytes(model, optimizer),
            optimizer=args.optimizer,
            dataset=args.dataset,
            checkpoint_every=args.checkpoint_every,
            async_save=args.async_save,
            attempt=attempt(),
            resumed_from=resumed_from,
            steps_redone=lost,
            restart_s=restart_s,
            first_step_s=first_step_s,
            saves=checkpointer.saves,
            step_seconds=step_seconds,
            checkpoints=sorted(p.name for p in checkpoint_dir.glob("step-*")),
        )
        print0(f"FINISHED {len(progress.losses)} steps, final loss {progress.losses[-1]:.4f}")
    del model, optimizer, scheduler
    destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Debugging lab: a save that never ends (TODO 5; the notebook's last section, `make check LESSON=08`)
# --------------------------------------------------------------------------------------------------


def save_sharded(state: dict, folder: Path, rank: int):
    """Write `state` ({"model", "optimizer"} from get_state_dict: DTensor shards under FSDP2) into `folder`, which
    exists, as one DCP checkpoint that restore can load; every rank calls this at the same point.
    utils/lesson_08/lab.py runs it on two live FSDP2 ranks and loads the folder back."""
    # TODO 5: lab, a save that never ends. With the exercise's version the lab's first checkpoint does not finish:
    #   one rank raises gloo's timeout after 5 s, and the folder stays empty. Fix it so that every rank returns and
    #   loading the folder as restore does gives back the trained weights.
    if rank == 0:  # one copy of the checkpoint, as torch.save under DDP (where every rank holds the whole model)
        dcp.save(state, checkpoint_id=str(folder))


if __name__ == "__main__":
    run_main(main)

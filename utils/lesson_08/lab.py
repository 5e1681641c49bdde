"""Lesson 08's debugging lab (TODO 5): the first checkpoint of an FSDP2 job, a save that never ends.

Under DDP every rank holds the whole model, and `if rank == 0: torch.save(...)` writes it once. Under FSDP2 each rank
holds only its shards, and DCP's save is a collective: the ranks agree on a plan, each writes its own shards, the
coordinator writes the .metadata that ties them together. The lesson's `save_sharded(state, folder, rank)` is that
save. Here two ranks train the course's tiny model under FSDP2 (lesson 03's apply_fsdp) for two AdamW steps in a gloo
group with a 5 s timeout (a hang ends in seconds), then call the learner's save into a fresh folder; each rank notes
the save calls it made (dcp.save, dcp.async_save, torch.save: where to, and how), whether it returned and after how
long, and which files it wrote. Only if every rank returned (they meet in the store first, so that no rank's
next collective pairs with a stuck one) does every rank load the folder into a fresh model as the solution's restore
does (dcp.load into get_state_dict) and compare its weights with the trained ones, bit for bit. Rank 0 writes every
rank's outcome. The notebook and `make check` run the same file:

    torchrun --nproc_per_node=2 utils/lesson_08/lab.py exercises/08_fault_tolerance.py --metrics-out lab.json

    passed, lines = verdict(json.load(open("lab.json")))   # on one process: each rank's outcome, the cause

Why gloo even on a GPU node: a collective that never completes makes gloo raise after the timeout, which the lab
reports; NCCL's watchdog kills the process instead (utils/course/lab.py says more).
"""

import contextlib
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.distributed.checkpoint.state_dict_saver as dcp_saver  # noqa: E402
import torch.serialization  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from utils.course.lab import (  # noqa: E402
    describe_lab_error,
    failure_message,
    join_lab_group,
    outermost_calls,
    recent_collectives,
    record_collectives,
    start_rank,
    wait_for_everyone,
    write_outcomes,
)
from utils.course.lessons import lesson  # noqa: E402
from utils.distributed_utils import destroy_process_group  # noqa: E402
from utils.model import ModelConfig, build_model, loss_fn  # noqa: E402

RANKS, STEPS = 2, 2  # the live run: two FSDP2 ranks, two AdamW steps before the checkpoint
CONFIG = ModelConfig(seq_len=8, dim=16, n_heads=2, n_layers=2)  # each block its own FSDP2 unit, as lesson 03 shards
TIMEOUT_S = 5.0  # how long a rank waits in a collective before gloo gives up
STUCK = f"waited until gloo's {TIMEOUT_S:.0f} s timeout (or until a peer gave up)"
HINTS = {  # a question that leads to the cause, not the fix: the lab is the finding
    "hang": "take the rank that waited: in which call, and what did the other rank call (or not) at that moment",
    "load": "compare what the folder holds with what restore reads: every rank's shards, and the file that ties them",
}
SAVERS = {  # the functions whose calls the lab notes: (file they are defined in, name) -> what the lines call them
    (dcp_saver.__file__, "save"): "dcp.save",
    (dcp_saver.__file__, "async_save"): "dcp.async_save",
    (torch.serialization.__file__, "save"): "torch.save",
}


@contextlib.contextmanager
def recording(calls: list, folder: Path, writes: "Writes"):
    """Append {"name", "into", "no_dist"} to `calls` for each save call the code inside makes, as it makes it (before
    it can block). A profile hook sees every Python call with its arguments however the code spells it (dcp.save,
    a name imported from torch.distributed.checkpoint, a FileSystemWriter). Only the outermost call counts: DCP's
    own calls inside it are not the learner's."""

    def record(frame) -> bool:
        name = SAVERS.get((frame.f_code.co_filename, frame.f_code.co_name))
        if name is None:
            return False
        arguments = frame.f_locals
        if name == "torch.save":
            into = arguments.get("f")
            writes.named(into)  # torch.save writes a path from C++, where the audit hook does not see it
        else:  # a folder named by checkpoint_id or by the storage writer's path
            writer = arguments.get("storage_writer")
            into = arguments.get("checkpoint_id") or getattr(writer, "path", None)
        calls.append({"name": name, "into": where(into, folder), "no_dist": bool(arguments.get("no_dist"))})
        return True

    with outermost_calls(record):
        yield calls


class Writes:
    """The files under `folder` this process opens for writing (or renames into place) while `on`: an audit hook sees
    every open, from any thread (DCP's and async_save's writers included), whoever calls it. Hooks cannot be removed,
    so the one hook is switched on and off."""

    def __init__(self, folder: Path):
        self.folder, self.on, self.files = folder, False, set()
        sys.addaudithook(self.hook)

    def inside(self, path) -> str | None:
        if not isinstance(path, (str, os.PathLike)):
            return None  # a file descriptor or an in-memory buffer
        relative = os.path.relpath(os.path.abspath(path), self.folder)
        return None if relative.startswith("..") else relative

    def named(self, path):
        if self.inside(path):
            self.files.add(self.inside(path))

    def written(self) -> list[str]:
        return sorted(name for name in self.files if (self.folder / name).is_file())

    def hook(self, event, args):
        if not self.on:
            return
        if event == "open":
            path, mode, flags = args
            writes = any(c in mode for c in "wax+") if isinstance(mode, str) else flags & (os.O_WRONLY | os.O_RDWR)
            if writes:
                self.named(path)
        elif event in ("os.rename", "os.replace"):  # DCP writes .metadata.tmp, then renames it
            self.named(args[1])


def where(path, folder: Path) -> str:
    """`path` as the lines say it: "the folder", "the folder's rank1", or the path itself if it is elsewhere."""
    if not isinstance(path, (str, os.PathLike)):
        return f"a {type(path).__name__}"
    relative = os.path.relpath(os.path.abspath(path), folder)
    if relative == ".":
        return "the folder"
    return str(path) if relative.startswith("..") else f"the folder's {relative}"


def files_in(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def describe(error: BaseException) -> str:
    described = describe_lab_error(error, STUCK, width=160)
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if isinstance(error, CheckpointException) and lines and described != STUCK:  # DCP gathers every rank's error:
        if "metadata read failed" in lines[-1]:  # the last line is the cause
            return "found no .metadata in the folder, which it reads first"
        return f"raised {lines[-1][:160]}"
    return described


def sharded_model(seed: int, world_size: int):
    """The course's model sharded with FSDP2 as lesson 03 does it, and its AdamW."""
    model = build_model(CONFIG, seed=seed)
    lesson("03").apply_fsdp(model, init_device_mesh("cpu", (world_size,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def local_weights(model) -> dict:
    """This rank's shard of every weight, copied (a DTensor's local part; a plain tensor as it is)."""
    state = get_state_dict(model, [])[0]
    return {name: (t.to_local() if isinstance(t, DTensor) else t).detach().clone() for name, t in state.items()}


def load_back(folder: Path, trained: dict, world_size: int) -> dict:
    """Load `folder` into a fresh model as the solution's restore does; compare with this rank's trained shards."""
    model, optimizer = sharded_model(seed=1, world_size=world_size)  # another initialisation: a miss shows
    model_state, optimizer_state = get_state_dict(model, optimizer)
    sharded = {"model": model_state, "optimizer": optimizer_state}
    try:
        dcp.load(sharded, checkpoint_id=str(folder))
        set_state_dict(model, optimizer, model_state_dict=sharded["model"], optim_state_dict=sharded["optimizer"])
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - CheckpointException is a BaseException
        return {"error": describe(error)}
    loaded = local_weights(model)
    differ = [name for name in trained if not torch.equal(loaded[name], trained[name])]
    largest = max((float((loaded[n] - trained[n]).abs().max()) for n in differ), default=0.0)
    return {"error": None, "tensors": len(trained), "differ": len(differ), "largest": largest}


def run_rank(save_sharded, folder: Path, writes: Writes, store, rank: int, world_size: int) -> dict:
    """This rank's part of the lab: train under FSDP2, the learner's save, then (if every rank returned) the load."""
    model, optimizer = sharded_model(seed=0, world_size=world_size)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    for _ in range(STEPS):
        tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len + 1), generator=data)
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
    trained = local_weights(model)
    model_state, optimizer_state = get_state_dict(model, optimizer)  # what checkpoint_state (TODO 1) gives to DCP
    outcome = {"error": None, "calls": [], "load": None}
    started = time.perf_counter()
    writes.on = True
    try:
        with recording(outcome["calls"], folder, writes):
            save_sharded({"model": model_state, "optimizer": optimizer_state}, folder, rank)
    except NotImplementedError as error:
        outcome["error"] = f"not done: {error}"
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - a timeout, a peer that gave up, the code raising
        outcome["error"] = describe(error)
    writes.on = False
    outcome["save_s"] = time.perf_counter() - started
    outcome["wrote"] = writes.written()  # the files this rank wrote into the folder
    store.add("lab/returned", 0 if outcome["error"] else 1)
    wait_for_everyone(store, "lab/saved", world_size, timeout_s=60)  # outside the group: it may be broken
    if store.add("lab/returned", 0) == world_size:  # every rank is out of the save: the group is sound
        outcome["load"] = load_back(folder, trained, world_size)
    else:  # the save did not end everywhere: each rank's last collectives show where the ranks parted
        outcome["collectives"] = recent_collectives()
    return outcome


def main():
    lab = start_rank("08", "save_sharded")
    learner, store, rank, world_size = lab.learner, lab.store, lab.rank, lab.world_size
    folder = lab.metrics_out.resolve().with_name(lab.metrics_out.stem + "-checkpoint")  # beside the record
    if rank == 0:  # a fresh folder, made before any rank saves into it
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    wait_for_everyone(store, "lab/folder", world_size, timeout_s=60)
    started = time.perf_counter()
    record_collectives()  # before the group: torch sizes its flight recorder once
    join_lab_group(store, rank, world_size, TIMEOUT_S)
    writes = Writes(folder)
    try:
        outcome = run_rank(learner.save_sharded, folder, writes, store, rank, world_size)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - outside the save: a peer that gave up
        outcome = {"error": describe(error), "calls": [], "load": None, "wrote": writes.written(),
                   "save_s": time.perf_counter() - started}  # fmt: skip
    dist.destroy_process_group()  # no barrier: the group may be broken
    outcome["seconds"] = time.perf_counter() - started
    record = {"timeout_s": TIMEOUT_S, "folder": str(folder), "folder_files": files_in(folder)}
    write_outcomes(store, rank, world_size, outcome, record, lab.metrics_out)
    destroy_process_group()  # the course's: a barrier first, then gloo's threads let go before Python exits


# --------------------------------------------------------------------------------------------------
# Grading, on one process, from the run's record
# --------------------------------------------------------------------------------------------------


def in_words(calls: list) -> str:
    said = [f"{c['name']} into {c['into']}" + (" with no_dist=True" if c["no_dist"] else "") for c in calls]
    return "called " + ", then ".join(said) if said else "called no save function"


def rank_line(rank: int, outcome: dict, timed: bool) -> str:
    """What the rank called, how its save ended (with the seconds where not every rank returned), what it loaded."""
    head = f"rank {rank}: {in_words(outcome['calls'])} and "
    wrote = f"it wrote {', '.join(outcome['wrote']) or 'nothing'}"
    if outcome["error"] == STUCK:
        waited = "waited in it" if outcome["calls"] else "waited"
        return head + f"{waited} {outcome['save_s']:.1f} s, {STUCK.removeprefix('waited ')}; {wrote}"
    if outcome["error"]:
        return head + f"{outcome['error']}; {wrote}"
    head += f"returned after {outcome['save_s']:.1f} s; {wrote}; " if timed else f"returned; {wrote}; "
    load = outcome["load"]
    if load is None:
        return head + "nothing was loaded back: not every rank returned from the save"
    if load["error"]:
        return head + f"loading the folder as restore does: dcp.load {load['error']}"
    if load["differ"]:
        return head + (f"the folder loads without an error, but {load['differ']} of this rank's {load['tensors']} "
                       f"weight shards differ from the trained ones (by up to {load['largest']:.1e})")  # fmt: skip
    return head + "the folder loads back this rank's trained weights bit for bit (right)"


def saves_of(outcome: dict, name: str) -> list:
    return [call for call in outcome["calls"] if call["name"] == name]


def cause(ranks: list) -> str | None:
    """The mistake the ranks' outcomes point to, in the learner's terms; None when none is recognised."""
    dcp_calls = [saves_of(o, "dcp.save") + saves_of(o, "dcp.async_save") for o in ranks]
    waited = [r for r, o in enumerate(ranks) if o["error"] == STUCK and dcp_calls[r]]
    skipped = [r for r, o in enumerate(ranks) if not o["error"] and not dcp_calls[r]]
    if waited and skipped:
        return (f"rank {waited[0]} waited in {dcp_calls[waited[0]][0]['name']} for rank {skipped[0]}, which returned "
                "without calling it: dcp.save is a collective (the ranks plan the checkpoint together), every rank "
                "must call it")  # fmt: skip
    torch_saves = [r for r, o in enumerate(ranks) if saves_of(o, "torch.save")]
    if torch_saves:
        return (f"rank {torch_saves[0]} called torch.save: under FSDP2 the state holds DTensors, so its file keeps "
                f"rank {torch_saves[0]}'s shards only, and the folder gets no .metadata for dcp.load: every rank must "
                "call dcp.save")  # fmt: skip
    alone = [r for r, calls in enumerate(dcp_calls) if any(call["no_dist"] for call in calls)]
    if len(alone) == len(ranks):
        return (
            "every rank called dcp.save with no_dist=True: each saved as if it were the only rank, into the same file "
            "names (__0_0.distcp, .metadata), over one another: dcp.save must run as one collective"
        )
    if alone:
        missing = next(r for r in range(len(ranks)) if r not in alone)
        return (f"rank {alone[0]} called dcp.save with no_dist=True: it saved as if it were the only rank, so rank "
                f"{missing}'s shards are missing: every rank must call dcp.save, as one collective")  # fmt: skip
    places = {call["into"] for calls in dcp_calls for call in calls}
    if len(places) > 1 and all(dcp_calls):
        return (f"each rank saved into a place of its own ({', '.join(sorted(places))}): a folder of its own holds "
                "one rank's shards, and only rank 0's gets the .metadata; one checkpoint is one folder that every "
                "rank saves into")  # fmt: skip
    return None


def verdict(record: dict) -> tuple[bool, list[str]]:
    """(passed, one line per rank, then what the folder held, then the cause): what each rank called, whether it
    returned, and whether the folder gives its trained weights back."""
    ranks = record["ranks"]
    timed = any(outcome["error"] for outcome in ranks)  # a save that did not end: how long each rank was in it
    lines = [rank_line(r, outcome, timed).replace(record["folder"] + os.sep, "") for r, outcome in enumerate(ranks)]
    passed = all(line.endswith("(right)") for line in lines)
    held = ", ".join(record["folder_files"]) or "nothing"
    found = cause(ranks) if not passed else None
    return passed, [*lines, f"the folder holds: {held}" + (" (right)" if passed else "")] + (
        [f"why: {found}"] if found else []
    )


def failure(record: dict, todo: int) -> str | None:
    """None when the lab passed; else the test's message: the TODO, the cause, a hint, then every rank."""
    passed, lines = verdict(record)
    hung = any(outcome["error"] == STUCK for outcome in record["ranks"])
    return None if passed else failure_message(lines, todo, HINTS["hang" if hung else "load"])


if __name__ == "__main__":
    main()

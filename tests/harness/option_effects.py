"""Checks that the options every training script shares change the run, not only its command line.

A lesson's test launches its script once on one process with a value other than the default for each shared
option (its own test function lists them, so tests/test_options.py can see which options it passes), then calls
check_shared_options: the run must train like the same steps written out here, on the model, data and learning
rate those values ask for, and write its logs, metrics and checkpoint where they say. The written-out training
uses PyTorch alone (DataLoader or DistributedSampler, SGD), never the lesson's code: a script that ignored
--seed, --n-heads or --lr would train another model, and its losses would not match.
"""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tests.harness.launch import Run
from utils.data import load_token_dataset, token_file
from utils.metrics import param_checksum
from utils.model import ModelConfig, build_model, loss_fn

LOSS_TOLERANCE = 1e-5  # relative: fp32, the same operations in the same order, up to the summation order


REQUIRED = object()


def passed(run: Run, option: str, default=REQUIRED) -> str | bool:
    """The value `option` had on the run's command line (True for a flag); `default` if it was not passed
    (fails if no default is given)."""
    command = [str(part) for part in run.command]
    if option not in command and default is not REQUIRED:
        return default
    assert option in command, f"{option} was not passed to this run: {' '.join(command)}"
    at = command.index(option)
    value = command[at + 1] if at + 1 < len(command) else None
    return True if value is None or value.startswith("--") else value


def fake_wikitext(data_dir: Path, n_bytes: int = 6000) -> Path:
    """A prepared WikiText cache in `data_dir` (its token file), made of text that is not the generated corpus:
    a run with --dataset wikitext --data-dir data_dir trains on it, without a download."""
    path = token_file("wikitext", "train", 0, Path(data_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    words = ["= valkyria chronicles =", "the game", "was released", "in japan", "@-@", "on 27 january 2011 ."]
    generator = torch.Generator().manual_seed(7)
    text, size = [], 0
    while size < n_bytes:
        word = words[int(torch.randint(len(words), (1,), generator=generator))]
        text.append(word)
        size += len(word) + 1
    path.write_bytes(" ".join(text).encode("utf-8"))
    return path


def written_out_training(command: Run, order: str, samples_per_step: int, lr: float, lr_factor=None, momentum=0.0):
    """The run's steps on one process, written with PyTorch alone: the losses and the final parameters' checksum.

    order: "generator" (a DataLoader shuffled by a generator seeded with --seed, as lesson 00) or "sampler"
    (a DistributedSampler of one replica seeded with --seed, as the data-parallel lessons).
    lr_factor(s): the learning-rate factor of step s + 1 (a schedule), 1 if None. momentum: SGD's.
    """
    seed, steps = int(passed(command, "--seed", 0)), int(passed(command, "--steps"))
    config = ModelConfig(
        seq_len=int(passed(command, "--seq-len")),
        dim=int(passed(command, "--dim")),
        n_layers=int(passed(command, "--n-layers")),
        n_heads=int(passed(command, "--n-heads")),
    )
    dataset, data_dir = passed(command, "--dataset", "synthetic"), passed(command, "--data-dir", None)
    data = load_token_dataset(dataset, config.seq_len, "train", cache_dir=data_dir)
    if order == "generator":
        generator = torch.Generator().manual_seed(seed)
        loader = DataLoader(data, batch_size=samples_per_step, shuffle=True, drop_last=True, generator=generator)
    else:
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
        sampler.set_epoch(0)
        loader = DataLoader(data, batch_size=samples_per_step, sampler=sampler, drop_last=True)
    assert passed(command, "--optimizer") == "sgd", "the written-out training uses SGD: pass --optimizer sgd"
    model = build_model(config, seed=seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    losses = []
    for step, (inputs, targets) in zip(range(steps), loader):
        for group in optimizer.param_groups:
            group["lr"] = lr * (lr_factor(step) if lr_factor else 1.0)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert len(losses) == steps, f"the data gave {len(losses)} batches of {samples_per_step}, not {steps}"
    return losses, param_checksum(model), config


def check_shared_options(run: Run, order: str, samples_per_step: int | None = None, lr: float | None = None,
                         lr_factor=None, log_dir: Path | None = None) -> dict:  # fmt: skip
    """Each shared option's effect on `run` (one process), checked; returns the run's metrics.

    samples_per_step: sequences per optimizer step (default --batch-size); lr: the learning rate the run should
    train with (default --lr); log_dir: the folder the run logs into (default --log-dir; lesson 03 logs each
    strategy into a folder of its own inside it).
    """
    assert run.returncode == 0, f"the run failed. Its last lines:\n{run.tail()}"
    metrics = json.loads(Path(passed(run, "--metrics-out")).read_text())  # --metrics-out: written where it says
    steps = int(passed(run, "--steps"))
    assert metrics["steps"] == steps and len(metrics["losses"]) == steps, f"--steps {steps}: {metrics['losses']}"
    samples = samples_per_step or int(passed(run, "--batch-size"))
    rate = float(passed(run, "--lr")) if lr is None else lr
    losses, checksum, config = written_out_training(run, order, samples, rate, lr_factor)
    # The first loss depends on the model (--seed, --dim, --n-layers, --n-heads, --seq-len) and on the batch
    # (--dataset, --data-dir, --seed, --batch-size); the later ones on the update too (--optimizer, --lr).
    assert metrics["losses"] == pytest.approx(losses, rel=LOSS_TOLERANCE), (
        f"the losses {metrics['losses']} are not those of the same steps written out {losses}: some option among "
        "--seed, --batch-size, --dataset, --data-dir, --seq-len, --dim, --n-layers, --n-heads, --optimizer, --lr "
        "did not reach the model, the data or the optimizer"
    )
    assert math.isclose(metrics["param_checksum"], checksum, rel_tol=1e-6), (
        f"final parameters' checksum {metrics['param_checksum']}, written out {checksum}"
    )
    held = metrics["bytes_per_rank"]
    held = held[0] if isinstance(held, list) else held  # lesson 06 lists every rank's (one here)
    assert held["optimizer"] == 0, "--optimizer sgd (no momentum) keeps no optimizer state"
    every = int(passed(run, "--log-every"))
    # "step N  loss ...", or "ddp step N  loss ..." where a script names the strategy it trains
    printed = [int(n) for n in re.findall(r"^\s*(?:\w+ +)?step\s+(\d+)\s+loss", run.output, flags=re.MULTILINE)]
    assert printed == sorted({s for s in range(1, steps + 1) if s % every == 0} | {steps}), (
        f"--log-every {every}: the loss was printed at steps {printed}"
    )
    log_dir = Path(passed(run, "--log-dir")) if log_dir is None else log_dir
    assert list(log_dir.glob("events.out.tfevents.*")), f"--log-dir: no tensorboard event file in {log_dir}"
    if passed(run, "--wandb") is True:
        assert list((log_dir / "wandb").glob("offline-run-*")), f"--wandb: no offline wandb run in {log_dir}/wandb"
    if "--checkpoint" in map(str, run.command):
        path = Path(passed(run, "--checkpoint"))
        state = torch.load(path, weights_only=True)
        if "config" not in state:  # lesson 03 describes its checkpoints in a file beside them
            state["config"] = json.loads(path.with_name(path.name + ".json").read_text())["config"]
        model = build_model(ModelConfig(**state["config"]), seed=12345)
        model.load_state_dict(state["model"])
        assert ModelConfig(**state["config"]) == config, f"--checkpoint: saved config {state['config']}"
        assert math.isclose(param_checksum(model), checksum, rel_tol=1e-6), "--checkpoint: not the trained weights"
    return metrics

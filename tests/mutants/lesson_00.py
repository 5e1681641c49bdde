"""Lesson 00's mutants: plausible mistakes in each TODO of solutions/00_setup_and_baseline.py, each of which
`make check LESSON=00` must report as a failure of that TODO (run them with `make mutants LESSON=00`)."""

from tests.mutants import Mutant

# Names the TODO comments may use (tests/harness/todo_comments.py does not count them as given away).
COMMENT_MAY_NAME = {
    "loss_fn": "the course's loss (utils.model), imported at the top of the script: TODO 1 must call it",
    "autocast": "the course's precision switch (utils.training), imported at the top: TODO 1 must run under it",
    "log": "the one method of the course's Logger (utils.training), which TODO 3 must call; its title says it",
    "loss": "the name of the scalar TODO 3 logs: tensorboard shows it and the test reads it by that name",
    "tokens_per_s": "the name of the other scalar TODO 3 logs, fixed in the same way (and the meter's property)",
}

MUTANTS = [
    # TODO 1: the training step
    Mutant(
        todo=1,
        what="never clears the gradients: each step adds to the last one's",
        find="        optimizer.zero_grad(set_to_none=True)\n        with autocast",
        replace="        with autocast",
        shows=("accumulate",),
    ),
    Mutant(
        todo=1,
        what="clears the gradients between backward and the optimizer step: nothing is learned",
        find="        loss.backward()\n        optimizer.step()",
        replace="        loss.backward()\n        optimizer.zero_grad(set_to_none=True)\n        optimizer.step()",
        shows=("never moved",),
    ),
    Mutant(
        todo=1,
        what="forgets autocast: --autocast bf16 trains in fp32",
        find="with autocast(args, device):  # a no-op unless --autocast bf16",
        replace="if True:  # a no-op unless --autocast bf16",
        shows=("fp32", "autocast"),
    ),
    Mutant(
        todo=1,
        what="never steps the optimizer: the gradients are computed and cleared, the weights never move",
        find="        loss.backward()\n        optimizer.step()\n        losses.append",
        replace="        loss.backward()\n        losses.append",
        shows=("never moved",),
    ),
    # TODO 2: tokens per step
    Mutant(
        todo=2,
        what="counts sequences, not tokens",
        find="throughput.step(inputs.numel())",
        replace="throughput.step(inputs.shape[0])",
        shows=("number of sequences",),
    ),
    Mutant(
        todo=2,
        what="counts the sequence length once, not per sequence",
        find="throughput.step(inputs.numel())",
        replace="throughput.step(inputs.shape[1])",
        shows=("one sequence's length",),
    ),
    Mutant(
        todo=2,
        what="counts a block's seq_len + 1 tokens per sequence instead of its seq_len predictions",
        find="throughput.step(inputs.numel())",
        replace="throughput.step(inputs.shape[0] * (inputs.shape[1] + 1))",
        shows=("T + 1",),
    ),
    # TODO 3: logging
    Mutant(
        todo=3,
        what="logs the first loss at every step",
        find="logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
        replace="logger.log(step, loss=losses[0], tokens_per_s=throughput.tokens_per_s)",
        shows=("first step's loss",),
    ),
    Mutant(
        todo=3,
        what="logs the loss without the throughput",
        find="logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
        replace="logger.log(step, loss=losses[-1])",
        shows=("no scalar", "tokens_per_s"),
    ),
    Mutant(
        todo=3,
        what="logs with the step counted from 0",
        find="logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
        replace="logger.log(step - 1, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
        shows=("counted from 0",),
    ),
]

VARIANTS = [  # correct answers written another way: each TODO's check must accept them
    # TODO 1: the training step
    Mutant(
        todo=1,
        what="clears the gradients at the end of the step instead of the start (they start empty)",
        find="        optimizer.zero_grad(set_to_none=True)\n        with autocast(args, device):  # a no-op unless "
        "--autocast bf16\n            loss = loss_fn(model(inputs), targets)\n        loss.backward()\n"
        "        optimizer.step()\n",
        replace="        with autocast(args, device):\n            loss = loss_fn(model(inputs), targets)\n"
        "        loss.backward()\n        optimizer.step()\n        optimizer.zero_grad()\n",
    ),
    Mutant(
        todo=1,
        what="clears the gradients through the model, names the logits, records the loss with float()",
        find="        optimizer.zero_grad(set_to_none=True)\n        with autocast(args, device):  # a no-op unless "
        "--autocast bf16\n            loss = loss_fn(model(inputs), targets)\n        loss.backward()\n"
        "        optimizer.step()\n        losses.append(loss.item())\n",
        replace="        model.zero_grad()\n        with autocast(args, device):\n            logits = model(inputs)\n"
        "            loss = loss_fn(logits, targets)\n        losses.append(float(loss))\n        loss.backward()\n"
        "        optimizer.step()\n",
    ),
    Mutant(
        todo=1,
        what="backward inside the autocast block (same gradients: backward runs in the forward's dtypes)",
        find="        with autocast(args, device):  # a no-op unless --autocast bf16\n"
        "            loss = loss_fn(model(inputs), targets)\n        loss.backward()\n",
        replace="        with autocast(args, device):  # a no-op unless --autocast bf16\n"
        "            loss = loss_fn(model(inputs), targets)\n            loss.backward()\n",
    ),
    # TODO 2: tokens per step
    Mutant(
        todo=2,
        what="multiplies the batch's two dimensions",
        find="throughput.step(inputs.numel())",
        replace="throughput.step(inputs.shape[0] * inputs.shape[1])",
    ),
    Mutant(
        todo=2,
        what="counts the targets (one per prediction) from the options",
        find="throughput.step(inputs.numel())",
        replace="throughput.step(args.batch_size * targets.size(1))",
    ),
    # TODO 3: logging
    Mutant(
        todo=3,
        what="the scalars in the other order, the loss from the step's own tensor",
        find="logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
        replace="logger.log(step, tokens_per_s=throughput.tokens_per_s, loss=loss.item())",
    ),
    Mutant(
        todo=3,
        what="the loss by position in the list, the scalars as a dict",
        find="logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
        replace='logger.log(step, **{"loss": losses[step - 1], "tokens_per_s": throughput.tokens_per_s})',
    ),
]

"""Lesson 00's mutants: plausible mistakes in each TODO of solutions/00_setup_and_baseline.py, each of which
`make check LESSON=00` must report as a failure of that TODO (run them with `make mutants LESSON=00`)."""

from tests.mutants import Mutant

MUTANTS = [
    # TODO 1: the training step
    Mutant(
        todo=1,
        what="never clears the gradients: each step adds to the last one's",
        find="        optimizer.zero_grad(set_to_none=True)\n        with autocast",
        replace="        with autocast",
    ),
    Mutant(
        todo=1,
        what="clears the gradients between backward and the optimizer step: nothing is learned",
        find="        loss.backward()\n        optimizer.step()",
        replace="        loss.backward()\n        optimizer.zero_grad(set_to_none=True)\n        optimizer.step()",
    ),
    Mutant(
        todo=1,
        what="forgets autocast: --autocast bf16 trains in fp32",
        find="with autocast(args, device):  # a no-op unless --autocast bf16",
        replace="if True:  # a no-op unless --autocast bf16",
    ),
    # TODO 2: tokens per step
    Mutant(
        todo=2,
        what="counts sequences, not tokens",
        find="throughput.step(inputs.numel())",
        replace="throughput.step(inputs.shape[0])",
    ),
    Mutant(
        todo=2,
        what="counts the sequence length once, not per sequence",
        find="throughput.step(inputs.numel())",
        replace="throughput.step(inputs.shape[1])",
    ),
    # TODO 3: logging
    Mutant(
        todo=3,
        what="logs the first loss at every step",
        find="logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
        replace="logger.log(step, loss=losses[0], tokens_per_s=throughput.tokens_per_s)",
    ),
    Mutant(
        todo=3,
        what="logs the loss without the throughput",
        find="logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
        replace="logger.log(step, loss=losses[-1])",
    ),
    Mutant(
        todo=3,
        what="logs with the step counted from 0",
        find="logger.log(step, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
        replace="logger.log(step - 1, loss=losses[-1], tokens_per_s=throughput.tokens_per_s)",
    ),
]

"""What one step of a 3D run did: the bytes it saved for backward and the collectives it ran.

with measure_step(active) as seen: ...   # seen.activation_bytes, seen.collectives after the block
"""

import contextlib
from dataclasses import dataclass

from utils.collective_counter import CollectiveCounter
from utils.memory import ActivationFootprint


@dataclass
class StepSeen:
    """What one measured step left: the bytes saved for backward, and the collectives this rank ran
    ({kind: [calls, bytes]}, None when not counted)."""

    activation_bytes: int = 0
    collectives: dict | None = None


@contextlib.contextmanager
def measure_step(active: bool, count_collectives: bool = True):
    """Measure the step run inside the block (when `active`): the bytes it saves for backward
    (utils.memory.ActivationFootprint), and every collective with
    utils/collective_counter.py (FSDP2's all-gathers and reduce-scatters, TP's all-reduces; not the pipeline's
    sends). The counter sees every operation from Python, which slows the step: count_collectives=False where the
    step's times matter (a recorded timeline). Yields a StepSeen filled in when the block ends, or None."""
    if not active:
        yield None
        return
    seen = StepSeen()
    counter = CollectiveCounter() if count_collectives else contextlib.nullcontext()
    with ActivationFootprint() as saved, counter:
        yield seen
    seen.activation_bytes = saved.bytes
    if count_collectives:
        seen.collectives = counter.table().get("all", {})

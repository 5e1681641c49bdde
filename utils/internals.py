"""The internal PyTorch APIs the course relies on: where, why, and what public alternative exists.

A lesson sometimes needs what PyTorch keeps private: DDP and FSDP do these things in their own code, and a
from-scratch version has to do them too. Each one can change or vanish in a release without notice, so they
are listed here, in one place, and `tests/test_internals.py` checks on every run that each still exists,
failing with a line that names it and where the course uses it.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    name: str  # a dotted path from `torch`; "expr:..." an expression; "env:NAME" a variable torch reads
    where: str  # which course files use it
    why: str
    public_alternative: str


INTERNALS = [
    Internal(
        "torch.autograd.Variable._execution_engine.queue_callback",
        "solutions/02_data_parallel.py, solutions/03_zero_fsdp.py",
        "run the gradient synchronisation once, when the whole backward pass has finished (DDP does this in C++)",
        "torch.autograd.graph.register_multi_grad_hook over every parameter, or an explicit call after backward()",
    ),
    Internal(
        "torch.autograd._unsafe_preserve_version_counter",
        "solutions/03_zero_fsdp.py (ZeRO-3's gathered parameters)",
        "write gathered values into a parameter's storage without autograd seeing a modification (FSDP2 does the same)",
        "none: allocate a fresh tensor per gather (more memory traffic)",
    ),
    Internal(
        "expr:torch.nn.Linear(1, 1)._parameters",
        "solutions/03_zero_fsdp.py (ZeRO-3 replaces registered parameters by views of a gathered buffer)",
        "a module must compute with a plain tensor that is not its registered parameter (FSDP1 does the same)",
        "torch.nn.utils.parametrize, or torch.func.functional_call with the gathered tensors",
    ),
    Internal(
        "torch.utils._python_dispatch.TorchDispatchMode",
        "utils/collective_counter.py (lesson 04's count of collectives, with the c10d/_c10d_functional op names)",
        "see every collective DTensor issues, including functional ones that bypass torch.distributed's names",
        "torch.distributed.tensor.debug.CommDebugMode (DTensor only), or torch.profiler's collective events",
    ),
    Internal(
        "torch.ops._c10d_functional.all_gather_into_tensor",
        "utils/collective_counter.py",
        "the functional collectives' op names that the counter recognises",
        "CommDebugMode's counts",
    ),
    Internal(
        "torch.distributed.pipelining.stage._PipelineStageBase.forward_one_chunk",
        "utils/pipeline_timing.py (lesson 05's schedule chart: each micro-batch's F and B timed)",
        "time each forward and backward of the built-in schedules (with schedule._stages / ._stage)",
        "torch.profiler with record_function around step(), without per-micro-batch detail",
    ),
    Internal(
        "env:TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "solutions/08_fault_tolerance.py, slurm/08_fault_tolerance*.sbatch, tests (restarted workers)",
        "restarted workers get a fresh TCP store, not the dead workers' addresses (undocumented torchrun variable)",
        "--rdzv-backend c10d with a fresh --rdzv-id per attempt",
    ),
]


def resolve(name: str):
    """The object a dotted path names (AttributeError/ImportError when a release removed it)."""
    import importlib

    if name.startswith("expr:"):  # an attribute that only instances have
        return eval(name[5:], {"torch": importlib.import_module("torch")})

    parts = name.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    raise ImportError(name)

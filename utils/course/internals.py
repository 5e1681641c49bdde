"""The internal PyTorch APIs the course relies on: where, why, and what public alternative exists.

A lesson sometimes needs what PyTorch keeps private: DDP and FSDP do these things in their own code, and a
from-scratch version has to do them too. Each one can change or vanish in a release without notice, so they
are listed here, in one place, and `tests/test_internals.py` checks on every run that each still exists,
failing with a line that names it and where the course uses it.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    name: str  # a dotted path from `torch`; "expr:..." an expression; "env:NAME" a variable torch reads;
    # "source:module:identifier" an instance attribute the module's code still sets
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
        "utils/collective_counter.py (lesson 04's count of collectives, with the c10d/_c10d_functional op names); "
        "utils/lesson_09/measure.py (LiveBytes: the bytes alive at attention's peak, on a CPU)",
        "see every collective DTensor issues, including functional ones that bypass torch.distributed's names",
        "torch.distributed.tensor.debug.CommDebugMode (DTensor only), or torch.profiler's collective events",
    ),
    Internal(
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "utils/measure_at_scale.py (a 70B model's block run at real size without allocating)",
        "tensors with shapes and dtypes but no data: the bytes autograd saves, counted without the memory",
        "the meta device alone (no kernels run on it, so autograd saves nothing to count)",
    ),
    Internal(
        "torch.testing._internal.distributed.fake_pg.FakeStore",
        "utils/measure_at_scale.py (one rank of a 64-rank job in one process)",
        "importing it registers the 'fake' process-group backend, whose collectives return at once (torchtitan's "
        "memory estimation uses it the same way)",
        "none public: a real backend needs every rank's process",
    ),
    Internal(
        "torch.utils._pytree.tree_leaves",
        "utils/measure_at_scale.py (the tensors inside an operation's nested outputs)",
        "flatten whatever structure an operation returns",
        "a small recursive flatten over tuples, lists and dicts",
    ),
    Internal(
        "torch.ops._c10d_functional.all_gather_into_tensor",
        "utils/collective_counter.py",
        "the functional collectives' op names that the counter recognises",
        "CommDebugMode's counts",
    ),
    Internal(
        "torch.distributed.pipelining.stage._PipelineStageBase.forward_one_chunk",
        "utils/lesson_05/timing.py (lesson 05's schedule chart: each micro-batch's F and B timed)",
        "time each forward and backward of the built-in schedules (with schedule._stages / ._stage)",
        "torch.profiler with record_function around step(), without per-micro-batch detail",
    ),
    Internal(
        "torch.distributed.pipelining.stage._PipelineStageBase.backward_one_chunk",
        "utils/lesson_05/timing.py (lesson 05's schedule chart)",
        "time each backward of the built-in schedules, as forward_one_chunk above",
        "torch.profiler with record_function around step(), without per-micro-batch detail",
    ),
    Internal(
        "source:torch.distributed.pipelining.schedules:_stages",
        "utils/lesson_05/timing.py (schedule._stages, or schedule._stage for a single-stage schedule)",
        "find the stages a built-in schedule runs, to time them",
        "keep the PipelineStage objects given to the schedule and wrap those",
    ),
    Internal(
        "torch._ops.HigherOrderOperator",
        "utils/collective_counter.py",
        "let higher-order operators (which call other ops) pass through the counting mode",
        "CommDebugMode's counts",
    ),
    Internal(
        "expr:torch.ops.aten.add.Tensor._overloadpacket.__name__",
        "utils/collective_counter.py",
        "an op's name without its overload (all_reduce_.default -> all_reduce_), to look it up in KINDS",
        "str(func).split('.') on the op's printed name",
    ),
    Internal(
        "source:torch.distributed.tensor._api:_local_tensor",
        "utils/memory.py (ActivationFootprint: is a DTensor's local shard a view of a larger buffer?)",
        "read a DTensor's local shard without the autograd wrapper that to_local() adds",
        "DTensor.to_local() under torch.no_grad()",
    ),
    Internal(
        "expr:torch.ones(1)._base",
        "utils/lesson_06/placements.py, utils/memory.py (lesson 06: a view's base buffer)",
        "tell a view from a tensor that owns its storage",
        "tensor.untyped_storage().data_ptr() compared with the tensor's own data_ptr()",
    ),
    Internal(
        "torch.distributed.tensor.experimental._attention._cp_options",
        "utils/course/compat.py (configure_context_parallel), called by solutions/09_context_parallelism.py",
        "choose the causal load balancing of context_parallel (the public API has no switch for it)",
        "none in torch 2.11-2.13: the default options",
    ),
    Internal(
        "torch.distributed.tensor.experimental._attention.set_rotate_method",
        "utils/course/compat.py (configure_context_parallel), called by solutions/09_context_parallelism.py",
        "pass keys and values around the ring (the from-scratch lesson's method) instead of all-gathering them",
        "none in torch 2.11-2.13: the default (all-gather)",
    ),
    Internal(
        "torch.distributed._functional_collectives",
        "tests/workers/collective_counter_check.py (the counter's self-check)",
        "issue a functional collective as DTensor and FSDP2 do, to check that the counter sees it",
        "a DTensor redistribute, which issues one (less direct)",
    ),
    Internal(
        "env:TORCHELASTIC_USE_AGENT_STORE",
        "utils/course/warm_ranks.py (the test suite's warm ranks set what torchrun sets)",
        "ranks connect to the store their launcher hosts, as under torchrun's agent",
        "run the tests cold (COURSE_COLD_RANKS=1): torchrun sets it itself",
    ),
    Internal(
        "env:TORCHELASTIC_SIGNALS_TO_HANDLE",
        "utils/course/warm_ranks.py (the test suite's warm ranks set what torchrun sets)",
        "the signals a worker forwards, as torchrun passes them",
        "run the tests cold (COURSE_COLD_RANKS=1): torchrun sets it itself",
    ),
    Internal(
        "env:TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "solutions/08_fault_tolerance.py, slurm/08_fault_tolerance*.sbatch, tests (restarted workers)",
        "restarted workers get a fresh TCP store, not the dead workers' addresses (undocumented torchrun variable)",
        "--rdzv-backend c10d with a fresh --rdzv-id per attempt",
    ),
    Internal(
        "torch._C._distributed_c10d._dump_fr_trace",
        "utils/course/lab.py (recent_collectives: each rank's last collectives in lesson 08's lab)",
        "read the flight recorder's record in the rank's own process: on gloo torch writes no file on a timeout",
        "none on gloo; on NCCL, TORCH_NCCL_DUMP_ON_TIMEOUT=1 writes files that torchfrtrace reads",
    ),
]


def resolve(name: str):
    """The object a dotted path names (AttributeError/ImportError when a release removed it)."""
    import importlib
    import importlib.util

    if name.startswith("expr:"):  # an attribute that only instances have
        return eval(name[5:], {"torch": importlib.import_module("torch")})
    if name.startswith("source:"):  # an instance attribute set in a module's code: its name must still be there
        module_name, identifier = name[7:].split(":")
        source = importlib.util.find_spec(module_name).origin
        if identifier not in open(source).read():
            raise AttributeError(f"{module_name} no longer mentions {identifier}")
        return identifier

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

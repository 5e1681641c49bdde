"""DistributedDataParallel's options and Join, each tried on a tiny model at 2 ranks (notebook 02, section 5).

torchrun --nproc_per_node=2 utils/lesson_02/ddp_options.py --metrics-out RESULTS.json
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(nn.Module):
    """A body and two heads; a forward with one head leaves the other head's parameters without a gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x, head="a"):  # head "a", "b" or "ab" (both)
        h = torch.relu(self.body(x))
        return sum(getattr(self, name)(h) for name in head)


def train(model, heads, rank):
    """One SGD step per entry of `heads` (which head each step uses); returns the steps taken."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, head in enumerate(heads):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x, head).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return len(heads)


def same_on_all_ranks(model) -> bool:
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {}

    # find_unused_parameters: DDP waits for every parameter's gradient before it can finish a step. A head that
    # a step does not use never reports one: the default DDP stops at the next step with an error.
    try:
        train(DDP(TwoHeads()), ["a", "a"], rank)
        result["default, one head unused"] = "trained"
    except RuntimeError as error:
        result["default, one head unused"] = "error: " + str(error).split(".")[0]
    model = DDP(TwoHeads(), find_unused_parameters=True)  # after forward, it walks the graph to find them
    train(model, ["a", "b", "a"], rank)
    result["find_unused_parameters=True, heads a b a"] = f"trained, ranks equal: {same_on_all_ranks(model)}"
    # static_graph: the same parameters are used (and unused) in every step, so DDP learns the set in the first
    # step and then skips the search; it also allows a few things the default forbids (e.g. re-entrant checkpoints).
    model = DDP(TwoHeads(), static_graph=True)
    train(model, ["a", "a", "a"], rank)
    result["static_graph=True, heads a a a"] = f"trained, ranks equal: {same_on_all_ranks(model)}"

    # gradient_as_bucket_view: .grad becomes a view into DDP's flat bucket instead of a tensor of its own, which
    # saves one gradient-sized copy in memory (and the copies between the two).
    for as_view in (False, True):
        model = DDP(TwoHeads(), gradient_as_bucket_view=as_view)
        model(torch.ones(2, 16), "ab").square().mean().backward()  # both heads: every parameter gets a .grad
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        result[f"gradient_as_bucket_view={as_view}"] = f"{len(grads)} gradients in {len(storages)} storage(s)"

    # Join: uneven inputs. Rank r has 3 + 2r batches. Without Join, rank 0 would leave the loop after 3 steps while
    # rank 1 waits in the all-reduce of its 4th: a hang, then a timeout. Under Join, a rank that ran out of data
    # joins the others' all-reduces with zeros ("shadowing" them) until every rank is done.
    model = DDP(TwoHeads())
    with Join([model]):
        steps = train(model, ["ab"] * (3 + 2 * rank), rank)
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, steps)
    result["Join, steps per rank"] = per_rank
    result["Join, ranks equal at the end"] = same_on_all_ranks(model)

    if rank == 0:
        for key, value in result.items():
            print(f"{key:42s} {value}")
        with open(sys.argv[sys.argv.index("--metrics-out") + 1], "w") as f:
            json.dump(result, f)
    del model
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

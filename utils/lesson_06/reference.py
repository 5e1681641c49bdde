"""One process's run, written with PyTorch alone, that lesson 06's grid runs are compared with.

reference_gradient_norms(config, batch, steps)   # one process's clip_grad_norm_ totals on lesson 00's batches
"""

import torch


def reference_gradient_norms(config, batch_size: int, steps: int, seed: int = 0) -> tuple[list[float], float]:
    """Lesson 00's training on one process (its batches of `batch_size` synthetic sequences, SGD at the course's
    learning rate), written out with PyTorch alone: the total gradient norm clip_grad_norm_ returns at each step,
    and the final parameters' checksum (utils.metrics.param_checksum) to show that it is lesson 00's run."""
    from torch.utils.data import DataLoader

    from utils.data import load_token_dataset
    from utils.metrics import param_checksum
    from utils.model import build_model, loss_fn
    from utils.training import DEFAULT_LR

    model = build_model(config, seed=seed)
    data = load_token_dataset("synthetic", config.seq_len, "train")
    order = torch.Generator().manual_seed(seed)
    loader = DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=True, generator=order)
    optimizer = torch.optim.SGD(model.parameters(), lr=DEFAULT_LR["sgd"])
    norms = []
    for _, (inputs, targets) in zip(range(steps), loader):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        optimizer.step()
    return norms, param_checksum(model)

"""A stand-in for torch.distributed.GradBucket: what a communication hook reads of the bucket DDP hands it."""

import torch


class Bucket:
    """One flat tensor of gradients (`values`) and the parameters they belong to, in the same order."""

    def __init__(self, values, parameters: list[torch.nn.Parameter]):
        self.tensor, self._parameters = torch.tensor(values), parameters

    def buffer(self) -> torch.Tensor:
        return self.tensor

    def index(self) -> int:
        return 0

    def parameters(self) -> list[torch.nn.Parameter]:  # in the order of their gradients in buffer()
        return self._parameters

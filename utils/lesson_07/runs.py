"""The notebook's runs of solutions/07_communication_efficient.py: each method at 2 ranks, some at 4."""

from utils.course.notebook import torchrun

SCRIPT = "solutions/07_communication_efficient.py"
GLOBAL_BATCH = 8  # sequences per step, whatever the number of ranks


def launch_methods(methods: dict, at_4: list, common: list) -> dict:
    """{(label, ranks): metrics}: every method of `methods` ({label: its options}) at 2 ranks, those named in
    `at_4` at 4 as well; post-local SGD all-reduces its gradients within groups of half the ranks (two nodes)."""
    runs = {}
    for n in (2, 4):
        for label in methods if n == 2 else at_4:
            args = methods[label]
            groups = ["--local-group-size", n // 2] if "postlocal" in args else []
            command = [*common, "--batch-size", GLOBAL_BATCH // n, *args, *groups]
            runs[label, n] = torchrun(SCRIPT, n, command, show=False)
    return runs

"""An earlier lesson's solution as a module, so that a later lesson composes its technique instead of copying it.

    from utils.course.lessons import lesson, load_script
    tensor_parallel = lesson("04")                       # solutions/04_tensor_parallel.py, imported once
    tensor_parallel.parallelize_scratch(model, group)    # lesson 04's hand-written f/g layers
    learner = load_script("exercises/04_tensor_parallel.py", "learner")  # any script by path, fresh each call

Always the reference solution, never exercises/: lesson 06 must run whether or not a learner has finished the
earlier exercises, and a mistake there must not show up as a mistake in lesson 06. Importing a solution runs its
top level only (imports and definitions); its main() runs only when it is the script torchrun starts.
"""

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

SOLUTIONS = Path(__file__).resolve().parents[2] / "solutions"


@cache
def lesson(number: str) -> ModuleType:
    """solutions/NN_*.py as the module `lessonNN` (registered in sys.modules, so pickling and dataclasses that look
    their module up by name work as for any import)."""
    matches = sorted(SOLUTIONS.glob(f"{number}_*.py"))
    if not matches:
        raise ModuleNotFoundError(f"no lesson {number}: no {SOLUTIONS}/{number}_*.py")
    name = f"lesson{number}"
    spec = importlib.util.spec_from_file_location(name, matches[0])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_script(path, name: str) -> ModuleType:
    """The script at `path` as a fresh module named `name` (not registered in sys.modules): how the labs load a
    learner's exercise beside the reference solution, each its own copy."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

"""Run a lesson script in this process and record what its training loop feeds the throughput meter.

    python tests/workers/throughput_probe.py OUT.json SCRIPT.py [script arguments...]

utils.training.Throughput.step is wrapped (the script imports the class, so the wrapper is what it calls),
and the token counts of every step are written to OUT.json when the script ends, as {"tokens": [...]}.
Used by tests/test_00_setup_and_baseline.py to check TODO 2 against the batch's shape.
"""

import json
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from utils.training import Throughput  # noqa: E402

counted = []
original_step = Throughput.step


def recording_step(self, tokens):
    counted.append(int(tokens))
    return original_step(self, tokens)


Throughput.step = recording_step
out, script, *arguments = sys.argv[1:]
sys.argv = [script, *arguments]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as stop:
    if stop.code not in (None, 0):
        raise
finally:
    Path(out).write_text(json.dumps({"tokens": counted}))

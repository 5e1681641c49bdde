"""utils/ddp_scratch.py and DistributedDataParallel against one process, at 2 and 4 ranks.

One torchrun launch per world size runs every check (tests/workers/ddp_parity.py): the hand-written
wrapper with one bucket and with many small ones, and the built-in DDP, each with and without
gradient accumulation (no_sync), each compared parameter by parameter with a single process that
trained on the whole global batch.
"""

import json

import pytest

from tests.launch import ROOT, torchrun
from utils.ddp_scratch import bus_bytes

TOLERANCE = 1e-6
WRAPPERS = ["scratch_one_bucket", "scratch_small_buckets", "builtin"]


@pytest.fixture(scope="module", params=[2, 4])
def results(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"ddp{request.param}") / "results.json"
    torchrun(ROOT / "tests/workers/ddp_parity.py", request.param, [path], timeout=180).check()
    return json.loads(path.read_text())


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_data_parallel_matches_one_process(results, wrapper):
    """N ranks with batch b take the same SGD steps as one process with batch N*b (and start equal)."""
    diff = results[f"max_diff_{wrapper}_accum1"]
    assert diff <= TOLERANCE, f"{wrapper} at {results['world_size']} ranks differs from one process by {diff:.2e}"


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_gradient_accumulation_matches_one_larger_batch(results, wrapper):
    """2 micro-batches under no_sync, then one synchronising backward = one batch twice as large."""
    diff = results[f"max_diff_{wrapper}_accum2"]
    assert diff <= TOLERANCE, f"{wrapper} with accumulation differs from one process by {diff:.2e}"


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("wrapper", ["scratch_one_bucket", "scratch_small_buckets"])
def test_bytes_on_the_wire(results, wrapper, accum):
    """Each optimizer step all-reduces every gradient exactly once: parameter count x 4 bytes (fp32).

    Under no_sync the inner micro-steps send nothing, so accumulation does not change the count.
    """
    sent = results[f"allreduce_bytes_{wrapper}_accum{accum}"]
    assert sent == results["param_count"] * 4 == results["param_bytes"]
    n = results["world_size"]
    assert results["bus_bytes"] == pytest.approx(2 * (n - 1) / n * results["param_bytes"])
    assert bus_bytes(1000, 4) == 1500


def test_small_buckets_overlap_with_backward(results):
    """With small buckets, every bucket is launched from a hook: on the wire while backward still computes."""
    buckets = results["buckets_scratch_small_buckets_accum1"]
    assert buckets >= 3, f"only {buckets} buckets: the bucket cap did not split the gradients"
    assert results["overlapped_scratch_small_buckets_accum1"] == buckets
    assert results["buckets_scratch_one_bucket_accum1"] == 1

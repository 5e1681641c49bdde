"""utils/collective_counter.py counts each collective once, with the bytes of the whole tensor it works on."""

import json

import pytest

from tests.harness.launch import ROOT, torchrun

WORKER = ROOT / "tests" / "workers" / "collective_counter_check.py"
F = 4  # bytes per float32
EXPECTED = {  # phase: {kind: [calls, bytes of the whole tensor]} on 2 ranks, with 4-float tensors per rank
    "all_reduce": {"all_reduce": [1, 4 * F]},
    "all_reduce_coalesced": {"all_reduce": [1, 8 * F]},
    "all_gather_into_tensor": {"all_gather": [1, 8 * F]},
    "all_gather": {"all_gather": [1, 8 * F]},
    "reduce_scatter_tensor": {"reduce_scatter": [1, 8 * F]},
    "all_to_all_single": {"all_to_all": [1, 8 * F]},
    "all_to_all": {"all_to_all": [1, 8 * F]},
    "broadcast": {"broadcast": [1, 4 * F]},
    "functional all_reduce": {"all_reduce": [1, 4 * F]},
    "functional all_gather": {"all_gather": [1, 8 * F]},
    "functional all_gather (autograd)": {"all_gather": [1, 8 * F]},
    "functional reduce_scatter": {"reduce_scatter": [1, 8 * F]},
    "functional all_to_all": {"all_to_all": [1, 8 * F]},
    "functional all_reduce_coalesced": {"all_reduce": [1, 8 * F]},
    "functional all_gather_coalesced": {"all_gather": [1, 16 * F]},
    "functional reduce_scatter_coalesced": {"reduce_scatter": [1, 16 * F]},
    "DTensor Shard(0) -> Replicate()": {"all_gather": [1, 32 * F]},
}


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("counter") / "out.json"
    run = torchrun(WORKER, 2, [out], timeout=120)
    assert run.returncode == 0 and out.exists(), f"the counter's checks did not finish:\n{run.tail()}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("phase", [*EXPECTED, "no collective"])
def test_each_collective_is_counted_once_with_its_whole_bytes(result, phase):
    assert phase in result["phases"], phase
    assert result["table"].get(phase, {}) == EXPECTED.get(phase, {}), f"{phase}: counted {result['table'].get(phase)}"


def test_self_check_passes_and_notices_a_renamed_op(result):
    assert result["self_check"] == "passed"
    assert "counted nothing for one dist.all_reduce" in result["self_check_without_name"], result


def test_a_collective_on_another_device_is_refused_by_name(result):
    assert "got a tensor on cpu, but this rank's collectives run on meta" in result["wrong_device"], result

"""utils/distributed_utils.py under torchrun with 2 and 4 processes, under srun-style variables, and alone."""

import json

import pytest
import torch

from tests.harness.launch import ROOT, course_env, python, srun_like_env, srun_tasks, torchrun
from tests.workers.utils_check import batch, small_model
from utils.distributed_utils import free_port

WORKER = ROOT / "tests" / "workers" / "utils_check.py"


@pytest.mark.parametrize("nproc", [2, 4])
def test_setup_print0_save0_under_torchrun(nproc, tmp_path):
    run = torchrun(WORKER, nproc, ["basics", tmp_path]).check()
    ranks = json.loads((tmp_path / "basics.json").read_text())
    assert [r["rank"] for r in ranks] == list(range(nproc))
    assert [r["local_rank"] for r in ranks] == list(range(nproc))
    assert {(r["world_size"], r["device"], r["backend"]) for r in ranks} == {(nproc, "cpu", "gloo")}
    # is_root_process: right on every rank, and still right when answered from the cache.
    assert [r["is_root"] for r in ranks] == [r["is_root_again"] for r in ranks] == [True] + [False] * (nproc - 1)
    # Asked before setup(), it falls back to RANK and must not freeze that answer in the cache.
    assert [r["root_before_setup"] for r in ranks] == [True] + [False] * (nproc - 1)
    # Per-rank seed: rank r draws what torch.manual_seed(3 + r) draws.
    for r in ranks:
        torch.manual_seed(3 + r["rank"])
        assert r["draw"] == torch.rand(3).tolist()
    assert len({tuple(r["draw"]) for r in ranks}) == nproc
    # print0 printed once; save0 wrote rank 0's object.
    assert run.output.count("print0 says hello") == 1 and "from rank 0" in run.output
    assert torch.load(tmp_path / "save0.pt") == {"written_by": 0}


def test_setup_as_plain_python_is_a_world_of_one(tmp_path):
    env = {k: v for k, v in course_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID")}
    python(WORKER, ["basics", tmp_path], env=env).check()
    (only,) = json.loads((tmp_path / "basics.json").read_text())
    assert (only["rank"], only["world_size"], only["is_root"]) == (0, 1, True)


def test_setup_under_srun_without_torchrun(tmp_path):
    tasks = srun_tasks(WORKER, 2, ["basics", tmp_path])
    assert [task.returncode for task in tasks] == [0, 0], "\n".join(task.tail() for task in tasks)
    ranks = json.loads((tmp_path / "basics.json").read_text())
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]


def test_a_missing_rank_fails_with_a_clear_message_not_a_hang(tmp_path):
    """srun asked for 2 tasks but only one started: setup() names the cause after the timeout."""
    env = srun_like_env(0, 2, free_port(), course_env(COURSE_TIMEOUT_S=5))
    run = python(WORKER, ["basics", tmp_path], env=env, timeout=60)
    assert run.returncode == 2, run.tail()
    assert "only some of the 2 processes joined" in run.output, run.tail()
    assert "Traceback" not in run.output, "the learner should see one line, not a traceback"


@pytest.fixture(scope="module")
def saved_at_4_ranks(tmp_path_factory):
    """An FSDP2 model and AdamW after one step at 4 ranks, saved both sharded and full."""
    out = tmp_path_factory.mktemp("checkpoints")
    torchrun(WORKER, 4, ["save", out]).check()
    return out


def test_sharded_checkpoint_saved_at_4_ranks_loads_at_2_with_identical_values(saved_at_4_ranks):
    tmp_path = saved_at_4_ranks
    torchrun(WORKER, 2, ["load", tmp_path]).check()
    saved = torch.load(tmp_path / "full.pt")
    reloaded = torch.load(tmp_path / "reloaded-2.pt")
    assert saved["model"].keys() == reloaded["model"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, tensor in saved["model"].items():
        assert torch.equal(tensor, reloaded["model"][name]), name
    assert saved["optimizer"]["state"].keys() == reloaded["optimizer"]["state"].keys()
    for name, state in saved["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(state[key], reloaded["optimizer"]["state"][name][key]), (name, key)


def test_full_checkpoint_of_a_sharded_model_equals_one_process_training(saved_at_4_ranks):
    """save_full_model gathers FSDP shards into the model one process would have trained."""
    saved = torch.load(saved_at_4_ranks / "full.pt")

    model = small_model(seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    inputs, targets = batch()
    torch.nn.functional.mse_loss(model(inputs), targets).backward()
    optimizer.step()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(saved["model"][name], tensor, rtol=0, atol=1e-6)
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in saved["model"].values())


def test_load_sharded_model_without_a_checkpoint_says_so(tmp_path):
    env = course_env(COURSE_TIMEOUT_S="20")
    env.pop("RANK", None)
    run = python(WORKER, ["load", tmp_path], env=env)
    assert run.returncode == 2 and "no distributed checkpoint" in run.output, run.tail()


def test_device_check_names_a_tensor_on_the_wrong_device(monkeypatch):
    """COURSE_CHECK_DEVICE=1 (what `make test-gpu` sets): a collective given a tensor that is not on the
    rank's device stops with a line naming the collective and the device, before NCCL or gloo see it."""
    import torch.distributed as dist

    import utils.distributed_utils as du

    for name in [*du.CHECKED_COLLECTIVES, "P2POp"]:  # restored after the test: the check wraps torch's functions
        monkeypatch.setattr(dist, name, getattr(dist, name))
    du._check_collective_devices(torch.device("cpu"))
    with pytest.raises(du.CourseError, match=r"dist.all_reduce got a tensor on meta, but this rank's collectives"):
        dist.all_reduce(torch.empty(3, device="meta"))
    with pytest.raises(du.CourseError, match=r"dist.all_gather got a tensor on meta"):
        dist.all_gather([torch.empty(3, device="meta")], torch.empty(3, device="meta"))
    # Batched send/recv (lesson 05, torch.distributed.pipelining): P2POp accepts the checked isend/irecv, and
    # batch_isend_irecv checks each op's tensor. (P2POp refused the wrappers once: lesson 05 could not run on a GPU.)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ops = [dist.P2POp(dist.isend, torch.empty(3, device="meta"), 0)]
        with pytest.raises(du.CourseError, match=r"dist.batch_isend_irecv got a tensor on meta"):
            dist.batch_isend_irecv(ops)
    finally:
        dist.destroy_process_group()


def test_library_names_of_newer_torch_exist():
    """utils/course/compat.py gives an older torch the 2.13 names the lessons call."""
    import torch.distributed as dist

    from utils.course.compat import TORCH_RENAMES

    for new in TORCH_RENAMES:
        assert callable(getattr(dist, new)), new

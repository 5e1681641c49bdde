"""utils/memory.py: the model-state estimator that lesson 03 checks against measured bytes and lesson 06 plans with."""

import subprocess
import sys

import pytest

from tests.harness.launch import ROOT
from utils.memory import bytes_per_param, model_state_bytes, padded_numel, peak_model_state_bytes


def test_zero_paper_worked_example():
    """ZeRO paper, Figure 1: 7.5 B parameters, 64 GPUs, mixed precision Adam (K = 12)."""
    totals = [sum(model_state_bytes(7.5e9, 64, stage, "mixed", "adam").values()) for stage in range(4)]
    assert totals[0] == 16 * 7.5e9  # 2 + 2 + 12 bytes per parameter, replicated
    assert totals[1] == (2 + 2) * 7.5e9 + 12 * 7.5e9 / 64
    assert totals[2] == 2 * 7.5e9 + (2 + 12) * 7.5e9 / 64
    assert totals[3] == 16 * 7.5e9 / 64
    assert [round(t / 1e9, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]  # the paper's figures, in GB


def test_bytes_per_parameter():
    assert bytes_per_param("fp32", "adam") == {"params": 4, "grads": 4, "optimizer": 8}
    assert bytes_per_param("mixed", "adam") == {"params": 2, "grads": 2, "optimizer": 12}
    assert bytes_per_param("fp32", "sgd") == {"params": 4, "grads": 4, "optimizer": 0}
    assert bytes_per_param("fp32", "momentum")["optimizer"] == 4
    with pytest.raises(ValueError):
        bytes_per_param("fp8", "adam")


def test_each_stage_shards_one_more_kind_of_state():
    n, dp, full, shard = 1000, 4, 1000, 250

    def state(stage):
        return tuple(model_state_bytes(n, dp, stage, "fp32", "adam").values())

    assert state(0) == (4 * full, 4 * full, 8 * full)
    assert state(1) == (4 * full, 4 * full, 8 * shard)
    assert state(2) == (4 * full, 4 * shard, 8 * shard)
    assert state(3) == (4 * shard, 4 * shard, 8 * shard)


def test_padding_rounds_each_shard_up():
    assert padded_numel([10], 4) == 12
    assert padded_numel([10, 5, 8], 4) == 12 + 8 + 8
    assert model_state_bytes(10, 4, 3, "fp32", "sgd") == {"params": 12, "grads": 12, "optimizer": 0}  # 3 per rank
    assert model_state_bytes(10, 4, 3, "fp32", "sgd", padded_params=28)["params"] == 4 * 7
    assert model_state_bytes(10, 1, 3, "fp32", "sgd") == model_state_bytes(10, 1, 0, "fp32", "sgd")
    with pytest.raises(ValueError):
        model_state_bytes(10, 4, 3, padded_params=14)  # not a multiple of dp


def test_command_line_prints_human_units():
    command = [sys.executable, "-m", "utils.memory", "--params", "7.5e9", "--dp", "64", "--stage", "2"]
    output = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "16.6 GB" in output and "2 + 2 + 12 bytes per parameter" in output
    assert len(output.strip().splitlines()) == 3  # the heading, the table's header, stage 2


def test_peak_adds_what_exists_only_during_backward():
    held = model_state_bytes(1000, 4, 2, "fp32", "adam")
    assert peak_model_state_bytes(1000, 4, 1, "fp32", "adam", bucket_params=100) == model_state_bytes(1000, 4, 1)
    assert peak_model_state_bytes(1000, 4, 2, "fp32", "adam", bucket_params=100) == {**held, "grads": 4 * 250 + 400}
    peak3 = peak_model_state_bytes(1000, 4, 3, "fp32", "adam", gathered_params=300, gathered_bytes=2)
    assert peak3 == {"params": 4 * 250 + 2 * 300, "grads": 4 * 250, "optimizer": 8 * 250}  # gathered in bf16


def test_command_line_says_which_precision_fits_a_run():
    command = [sys.executable, "-m", "utils.memory", "--help"]
    output = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "mixed (default" in output and "autocast" in output

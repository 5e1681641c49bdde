"""The course's data: byte tokens, the generated corpus through `datasets`, blocks, the offline message."""

import os
import subprocess
import sys
import time

import pytest
import torch

from tests.launch import ROOT
from utils.data import TokenBlocks, decode, encode, generate_corpus, load_text, load_token_dataset
from utils.distributed_utils import CourseError


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("course-data")


def test_byte_tokenizer_round_trip():
    text = "3 plus 4 is 7. Grüße, ranks!"
    tokens = encode(text)
    assert all(0 <= t < 256 for t in tokens) and len(tokens) == len(text.encode("utf-8"))
    assert decode(tokens) == text


def test_generated_corpus_is_deterministic_and_fast():
    start = time.perf_counter()
    text = generate_corpus(seed=0, n_chars=400_000)
    assert time.perf_counter() - start < 1.0
    assert text == generate_corpus(seed=0, n_chars=400_000)
    assert text != generate_corpus(seed=1, n_chars=400_000)


def test_synthetic_corpus_loads_through_datasets(cache_dir):
    text = load_text("synthetic", "train", seed=0, cache_dir=cache_dir)
    assert text.startswith(generate_corpus(seed=0, n_chars=400_000).split("\n")[0])
    assert any((cache_dir / "hf").rglob("*.arrow")), "the text should come from datasets' Arrow cache"
    assert load_text("synthetic", "validation", cache_dir=cache_dir) not in text


def test_blocks_shape_shift_and_determinism(cache_dir):
    blocks = load_token_dataset("synthetic", seq_len=64, cache_dir=cache_dir)
    assert isinstance(blocks, TokenBlocks) and len(blocks) > 1000
    inputs, targets = blocks[5]
    assert inputs.shape == targets.shape == (64,) and inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[1:], targets[:-1])  # targets are the inputs shifted by one token
    assert targets[-1] == blocks[6][0][0]  # consecutive blocks share one token
    again = load_token_dataset("synthetic", seq_len=64, cache_dir=cache_dir)
    assert torch.equal(again[5][0], inputs)
    other = load_token_dataset("synthetic", seq_len=64, seed=1, cache_dir=cache_dir)
    assert not torch.equal(other[5][0], inputs)
    with pytest.raises(IndexError):
        blocks[len(blocks)]


def test_every_block_is_distinct_enough(cache_dir):
    blocks = load_token_dataset("synthetic", seq_len=64, cache_dir=cache_dir)
    distinct = {tuple(blocks[i][0].tolist()) for i in range(500)}
    assert len(distinct) == 500


def test_missing_wikitext_fails_at_once_in_process(tmp_path):
    start = time.perf_counter()
    with pytest.raises(CourseError, match="python -m utils.data prepare --dataset wikitext"):
        load_token_dataset("wikitext", seq_len=64, cache_dir=tmp_path)
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("offline_variable", [True, False], ids=["HF_DATASETS_OFFLINE=1", "no-offline-variable"])
def test_missing_wikitext_fails_at_once_without_internet(tmp_path, offline_variable):
    """No retries against the Hub (about 23 s): the check comes before any network call, with or without
    the variable. The bound leaves room for starting Python and importing torch on a busy machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "COURSE_DATA"))}
    if offline_variable:
        env["HF_DATASETS_OFFLINE"] = "1"
    env["COURSE_DATA"] = str(tmp_path / "empty")
    code = "from utils.data import load_token_dataset; load_token_dataset('wikitext', 64)"
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert result.returncode != 0
    assert "CourseError" in result.stderr and "prepare --dataset wikitext" in result.stderr, result.stderr[-2000:]
    assert elapsed < 20, f"took {elapsed:.0f} s: the missing cache must be detected before any download attempt"


def test_prepared_wikitext_loads_from_disk_without_network(tmp_path):
    """What the prepare step leaves behind (a DatasetDict saved with save_to_disk) is what training reads.

    A stand-in with WikiText's layout: this machine, like a compute node, cannot download the real one.
    """
    import datasets

    lines = ["", " = Valkyria Chronicles = ", "", " The game was released in 2011 . "] * 100
    stand_in = datasets.DatasetDict(
        {split: datasets.Dataset.from_dict({"text": lines}) for split in ("train", "validation")}
    )
    stand_in.save_to_disk(str(tmp_path / "wikitext-2-raw-v1"))
    blocks = load_token_dataset("wikitext", seq_len=32, split="validation", cache_dir=tmp_path)
    n_tokens = len("\n".join(lines).encode())
    assert len(blocks) == (n_tokens - 1) // 32
    assert "Valkyria" in decode(torch.cat([blocks[i][0] for i in range(4)]))

"""The course's data: byte tokens, the generated corpus through `datasets`, blocks, the offline message."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness.launch import ROOT
from utils.data import (
    TokenBlocks,
    decode,
    encode,
    generate_corpus,
    load_text,
    load_token_dataset,
    map_tokens,
    token_file,
    write_token_file,
)
from utils.distributed_utils import CourseError


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("course-data")


def test_byte_tokenizer_round_trip():
    text = "3 plus 4 is 7. Grüße, ranks!"
    tokens = encode(text)
    assert all(0 <= t < 256 for t in tokens) and len(tokens) == len(text.encode("utf-8"))
    assert decode(tokens) == text


def test_generated_corpus_is_deterministic():
    text = generate_corpus(seed=0, n_chars=400_000)
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


def test_missing_wikitext_fails_at_once_in_process(tmp_path, monkeypatch):
    import datasets

    def no_network(*args, **kwargs):
        raise AssertionError("load_dataset was called: the missing copy must be detected before any download")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    with pytest.raises(CourseError, match="python -m utils.data prepare --dataset wikitext"):
        load_token_dataset("wikitext", seq_len=64, cache_dir=tmp_path)


@pytest.mark.parametrize("offline_variable", [True, False], ids=["HF_DATASETS_OFFLINE=1", "no-offline-variable"])
def test_missing_wikitext_fails_at_once_without_internet(tmp_path, offline_variable):
    """No retries against the Hub (about 23 s): the check comes before any network call, with or without
    the variable. Any network call would go to a proxy that refuses it (and fail with a ConnectionError,
    not the CourseError), so the test does not depend on how busy the machine is."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "COURSE_DATA"))}
    if offline_variable:
        env["HF_DATASETS_OFFLINE"] = "1"
    env.update(COURSE_DATA=str(tmp_path / "empty"), HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    code = "from utils.data import load_token_dataset; load_token_dataset('wikitext', 64)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=90)
    assert result.returncode != 0
    assert "CourseError" in result.stderr and "prepare --dataset wikitext" in result.stderr, result.stderr[-2000:]
    assert "ConnectionError" not in result.stderr and "proxy" not in result.stderr.lower(), result.stderr[-2000:]


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


def test_tokens_are_memory_mapped_from_a_token_file(cache_dir):
    """The encoded corpus is written once beside its text and mapped, not copied, by every process that loads it
    (so the ranks of a node share one copy in the page cache: tests/test_sharding.py measures it)."""
    blocks = load_token_dataset("synthetic", seq_len=64, cache_dir=cache_dir)
    path = token_file("synthetic", "train", 0, cache_dir)
    assert path.read_bytes() == load_text("synthetic", "train", cache_dir=cache_dir).encode("utf-8")
    assert len(blocks.tokens) == path.stat().st_size
    assert not list(path.parent.glob("*.tmp-*")), "a partial file was left behind"
    maps = Path("/proc/self/maps")
    if maps.exists():  # Linux: the file appears among this process's memory mappings
        assert str(path.resolve()) in maps.read_text()


def test_token_file_is_written_atomically(tmp_path):
    path = tmp_path / "deep" / "train.tokens.u8"
    write_token_file(path, b"first")
    write_token_file(path, bytes(range(256)))  # replaced whole, never appended or half-written
    assert path.read_bytes() == bytes(range(256)) and [p.name for p in path.parent.iterdir()] == [path.name]
    assert map_tokens(path).tolist() == list(range(256))

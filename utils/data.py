"""Text for the course's language model: byte-level tokens from a generated corpus or from WikiText-2.

    train = load_token_dataset("synthetic", seq_len=64)   # or "wikitext", after the prepare step
    inputs, targets = train[0]                            # two LongTensors of seq_len tokens

Both corpora go through Hugging Face `datasets`, the way real projects load text: the generated one is
written as plain text files and read with `load_dataset("text", ...)`; WikiText-2 comes from the Hub.

Compute nodes have no internet. Download WikiText-2 once, on the login node:

    python -m utils.data prepare --dataset wikitext [--cache-dir DIR]

It is saved with `save_to_disk` under DIR (default: $COURSE_DATA, else `data/` in the course folder): a
few Arrow files. The first run encodes each split once into a token file beside them (one byte per token),
which every rank then memory-maps: the ranks of a node share one copy of it in the page cache.
Keep that folder on the project or scratch file system,
not in your small home quota. Arrow files are a handful of large files, which a parallel file system
serves well; millions of small files (one per sample) exhaust the inode quota and make every `open`
a round trip to the metadata server.
"""

import argparse
import functools
import os
import random
import socket
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

from utils.distributed_utils import CourseError

ROOT = Path(__file__).resolve().parents[1]
DATASETS = ("synthetic", "wikitext")
WIKITEXT = ("wikitext", "wikitext-2-raw-v1")  # the Hub name and configuration
VOCAB_SIZE = 256  # one token per byte: no tokenizer to download, any text encodes


def default_cache_dir() -> Path:
    return Path(os.environ.get("COURSE_DATA") or ROOT / "data")


# --------------------------------------------------------------------------------------------------
# Tokenizer: UTF-8 bytes
# --------------------------------------------------------------------------------------------------


def encode(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------------
# The generated corpus: sentences from a small grammar, with patterns a tiny model can learn quickly
# --------------------------------------------------------------------------------------------------

NAMES = ["ada", "alan", "grace", "linus", "barbara", "edsger", "margaret", "dennis"]
ADJECTIVES = ["small", "large", "red", "green", "quiet", "fast", "old", "bright"]
NOUNS = ["cat", "dog", "bird", "node", "rank", "tensor", "model", "cluster"]
VERBS = ["sees", "finds", "sends", "trains", "waits for", "talks to"]
PLACES = ["on the login node", "in the queue", "near the river", "in the garden", "on the GPU"]


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        return (
            f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(VERBS)} "
            f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {rng.choice(PLACES)}."
        )
    if kind == 1:
        a, b = rng.randrange(50), rng.randrange(50)
        return f"{a} plus {b} is {a + b}."
    if kind == 2:
        start, step = rng.randrange(90), rng.randrange(1, 4)
        return "count " + " ".join(str(start + step * i) for i in range(rng.randrange(4, 8))) + "."
    if kind == 3:
        return f"{rng.choice(NAMES)} has {rng.randrange(2, 10)} {rng.choice(NOUNS)}s {rng.choice(PLACES)}."
    word = rng.choice(NOUNS)
    return f"{rng.choice(NAMES)} says {word}, {word}, {word}."


def generate_corpus(seed: int, n_chars: int) -> str:
    """About n_chars characters of text, one paragraph of a few sentences a line; same seed, same text."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < n_chars:
        line = " ".join(_sentence(rng) for _ in range(rng.randrange(2, 6)))
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines) + "\n"


# Big enough for thousands of distinct 65-token blocks, small enough to write in a few milliseconds.
SYNTHETIC_CHARS = {"train": 400_000, "validation": 40_000, "test": 40_000}


def _synthetic_files(cache_dir: Path, seed: int) -> dict[str, str]:
    """Write the generated corpus as text files (once) and return {split: path}."""
    folder = cache_dir / f"synthetic-v1-seed{seed}"  # bump v1 when the grammar changes
    files = {}
    for offset, (split, n_chars) in enumerate(SYNTHETIC_CHARS.items()):
        path = folder / f"{split}.txt"
        if not path.exists():
            folder.mkdir(parents=True, exist_ok=True)
            text = generate_corpus(seed * len(SYNTHETIC_CHARS) + offset, n_chars)  # a different text per split
            partial = path.with_suffix(f".tmp{os.getpid()}")
            partial.write_text(text)
            partial.replace(path)  # atomic: ranks writing at once never read a half-written file
        files[split] = str(path)
    return files


# --------------------------------------------------------------------------------------------------
# Loading text through `datasets`
# --------------------------------------------------------------------------------------------------


def wikitext_path(cache_dir: Path) -> Path:
    return cache_dir / WIKITEXT[1]


def prepare(name: str, cache_dir: Path) -> Path:
    """Download (WikiText-2) or generate (synthetic) a corpus into cache_dir. Run it on the login node."""
    import datasets

    if name == "synthetic":
        return Path(_synthetic_files(cache_dir, seed=0)["train"]).parent
    target = wikitext_path(cache_dir)
    corpus = datasets.load_dataset(*WIKITEXT, cache_dir=str(cache_dir / "hf"))
    corpus.save_to_disk(str(target))  # plain Arrow files: load_from_disk needs no network and no Hub cache
    return target


def _shown(path: Path) -> str:
    """A path as the learner would type it: relative to the course folder where it lies inside it."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def load_text(name: str, split: str = "train", seed: int = 0, cache_dir=None) -> str:
    """The whole split as one string."""
    if name not in DATASETS:
        raise CourseError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    cache_dir = Path(cache_dir or default_cache_dir())
    if name == "synthetic":
        import datasets

        datasets.disable_progress_bars()  # keep the scripts' output to what they print themselves
        files = _synthetic_files(cache_dir, seed)
        corpus = datasets.load_dataset("text", data_files={split: files[split]}, cache_dir=str(cache_dir / "hf"))
    else:
        # Decide before touching the network. Without the saved copy, load_dataset would try to download:
        # on a compute node that means ~20 s of retries and a ConnectionError that does not say what to do.
        # Downloading here is never right anyway: every rank would fetch the same files at once.
        target = wikitext_path(cache_dir)
        if not (target / "dataset_dict.json").exists():
            option = "" if cache_dir == default_cache_dir() else f" --cache-dir {_shown(cache_dir)}"
            raise CourseError(
                f"WikiText-2 is not prepared in {_shown(cache_dir)}/ (compute nodes have no internet). "
                f"On the login node run `python -m utils.data prepare --dataset wikitext{option}`, "
                "or train on --dataset synthetic."
            )
        import datasets

        corpus = datasets.load_from_disk(str(target))
    return "\n".join(corpus[split]["text"])


class TokenBlocks(Dataset):
    """Fixed-length training samples: block i is tokens [i * seq_len, (i + 1) * seq_len + 1).

    inputs are its first seq_len tokens, targets the last seq_len (the next token at each position).
    Consecutive blocks overlap by one token, so every token of the corpus is a target exactly once.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        if len(tokens) < seq_len + 1:
            raise CourseError(
                f"the corpus has {len(tokens)} tokens: too few for one block of {seq_len + 1}; "
                f"use --seq-len {max(len(tokens) - 1, 1)} or less"
            )

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        block = self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return block[:-1], block[1:]


def token_file(name: str, split: str, seed: int, cache_dir: Path) -> Path:
    """Where the encoded split lives: one byte per token, beside the text it was encoded from."""
    folder = cache_dir / f"synthetic-v1-seed{seed}" if name == "synthetic" else wikitext_path(cache_dir)
    return folder / f"{split}.tokens.u8"


def write_token_file(path: Path, data: bytes):
    """Write `data` to `path` atomically: ranks (of any node) writing at once never read a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    partial.write_bytes(data)
    partial.replace(path)


def map_tokens(path: Path) -> torch.Tensor:
    """The token file as a uint8 tensor backed by the file itself (mmap), not by a copy in this process.

    The pages come from the operating system's page cache, which every process on the node shares: 8 ranks
    reading the same file hold one copy of it in memory, not 8. The mapping is private (shared=False):
    nothing this process does changes the file.
    """
    size = path.stat().st_size
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


@functools.lru_cache(maxsize=8)
def _tokens(name: str, split: str, seed: int, cache_dir: str) -> torch.Tensor:
    path = token_file(name, split, seed, Path(cache_dir))
    if not path.exists():  # encode once; later runs (and the other ranks) map the file
        write_token_file(path, load_text(name, split, seed, cache_dir).encode("utf-8"))
    return map_tokens(path)


def load_token_dataset(name: str, seq_len: int, split: str = "train", seed: int = 0, cache_dir=None) -> TokenBlocks:
    """The corpus `name` ("synthetic" or "wikitext") as blocks of seq_len + 1 tokens.

    `seed` picks the generated corpus (WikiText ignores it). The first call encodes the text into a token
    file beside it (`token_file`); every call after that, in any process, memory-maps that file.
    """
    return TokenBlocks(_tokens(name, split, seed, str(Path(cache_dir or default_cache_dir()))), seq_len)


def main() -> int:
    parser = argparse.ArgumentParser(description="Prepare the course's data sets (run on a node with internet).")
    parser.add_argument("command", choices=["prepare"])
    parser.add_argument("--dataset", choices=DATASETS, default="wikitext")
    parser.add_argument("--cache-dir", type=Path, default=None, help="default: $COURSE_DATA, else data/")
    args = parser.parse_args()
    cache_dir = args.cache_dir or default_cache_dir()
    path = prepare(args.dataset, cache_dir)
    for split in ("train", "validation"):
        print(f"{args.dataset} {split}: {len(load_token_dataset(args.dataset, 64, split, cache_dir=cache_dir))} blocks")
    print(f"ready in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

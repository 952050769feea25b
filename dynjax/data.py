"""Token data: byte-level text or pre-tokenized arrays, cut into fixed windows with stable indices.

A *sample* is window ``i`` of the token stream: tokens ``[i*L, i*L + L + 1)`` for sequence length L
(inputs and next-token targets). Its index ``i`` never changes, so per-sample state (cached expert
assignments, DynaMoE seed 001 §4.2) can be keyed by it. Training order is a fresh permutation per
epoch drawn from the seed, and the batch at step t is a pure function of (seed, t): the iterator's
whole state is the number of batches consumed, which checkpoints save.
"""

from __future__ import annotations

import dataclasses
import logging
import sysconfig
from pathlib import Path

import numpy as np

from dynjax.config import ConfigError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv", ".tsv", ".html", ".xml", ".c", ".h")
SCAN_CHUNK = 1 << 22  # tokens the vocabulary check reads at once (a memory-mapped corpus is larger)


class DataError(ConfigError):
    """The data at ``data.path`` cannot train; the message names the path and the fix."""


def embedded_corpus_root() -> Path:
    """The default corpus: this interpreter's standard library sources (real text, no download)."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_tokens(path: str, max_tokens: int) -> np.ndarray:
    """Read a non-empty token stream (uint8 bytes for text, the stored dtype for arrays).

    ``path`` may be a text file, a directory of text files (read in sorted order), a ``.npy``
    array, or a raw ``.bin`` of uint16 tokens; empty means the embedded corpus. Arrays are
    memory-mapped, not read.
    """
    if not path:
        files = [
            f
            for f in _text_files(embedded_corpus_root(), (".py",))
            if "site-packages" not in f.parts  # installed packages differ between machines
        ]
        return _read_text_files(files, max_tokens)
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"data.path={path!r} does not exist")
    if p.is_dir():
        files = _text_files(p, TEXT_SUFFIXES)
        if not files:
            raise DataError(f"data.path={path!r} holds no text files ({', '.join(TEXT_SUFFIXES)})")
        tokens = _read_text_files(files, max_tokens)
    elif p.suffix == ".npy":
        tokens = _as_tokens(_load_npy(p, path), path)
    elif p.suffix == ".bin":
        tokens = _load_bin(p, path)
    else:
        tokens = _read_text_files([p], max_tokens)
    if len(tokens) == 0:
        raise DataError(f"data.path={path!r} holds no tokens: point it at a non-empty corpus")
    return tokens


def _text_files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in suffixes)


def _read_text_files(files: list[Path], max_tokens: int) -> np.ndarray:
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes()
        chunks.append(data[: max_tokens - total])
        total += len(chunks[-1])
        if total >= max_tokens:
            break
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def _load_npy(p: Path, path: str) -> np.ndarray:
    try:
        return np.load(p, mmap_mode="r")
    except (ValueError, EOFError, OSError) as e:  # empty, truncated or pickled
        raise DataError(
            f"data.path={path!r} is not a readable .npy array ({e}): write it with numpy.save"
        ) from e


def _load_bin(p: Path, path: str) -> np.ndarray:
    """A raw uint16 stream; NumPy cannot memory-map an empty file nor an odd-sized one."""
    size = p.stat().st_size
    if size % 2:
        raise DataError(
            f"data.path={path!r} has {size} bytes, not a whole number of 2-byte tokens: a .bin "
            "holds raw uint16 tokens; write it with array.astype(numpy.uint16).tofile(...)"
        )
    return np.memmap(p, dtype=np.uint16, mode="r") if size else np.empty(0, np.uint16)


def _as_tokens(array: np.ndarray, path: str) -> np.ndarray:
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise DataError(
            f"data.path={path!r}: a token array must be 1-D integers, "
            f"got {array.dtype}{array.shape}"
        )
    return array


def check_token_ids(tokens: np.ndarray, vocab_size: int, path: str) -> None:
    """Refuse ids outside ``[0, vocab_size)``: the embedding and the loss would wrap them.

    Reads ``SCAN_CHUNK`` tokens at a time, so a memory-mapped corpus is never loaded whole.
    """
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = np.asarray(tokens[start : start + SCAN_CHUNK])
        if chunk.min() >= 0 and chunk.max() < vocab_size:
            continue
        i = start + int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
        value = int(tokens[i])
        fix = "ids must be >= 0" if value < 0 else f"raise model.vocab_size to at least {value + 1}"
        raise DataError(
            f"data.path={path!r}: token id {value} at index {i} of the token stream is outside "
            f"[0, model.vocab_size={vocab_size}): {fix} or re-tokenize the data"
        )


@dataclasses.dataclass(frozen=True)
class Batch:
    """One global batch. Shapes: inputs/targets [B, L] int32, sample_ids [B] int64."""

    inputs: np.ndarray
    targets: np.ndarray
    sample_ids: np.ndarray


class TokenWindows:
    """Fixed-length windows of a token stream with a train/validation split by window index.

    The last ``val_fraction`` of windows is validation, so the two never share text.
    """

    def __init__(
        self, tokens: np.ndarray, seq_len: int, val_fraction: float, vocab_size: int, path: str
    ):
        num_windows = max(len(tokens) - 1, 0) // seq_len
        num_val = int(num_windows * val_fraction)
        if num_windows - num_val < 1 or (val_fraction > 0 and num_val < 1):
            raise DataError(
                f"data.path={path!r}: {len(tokens)} tokens give {num_windows} windows of "
                f"data.seq_len={seq_len}, {num_val} of them for validation "
                f"(data.val_fraction={val_fraction}): too few for a train/validation split; use "
                "more data (data.max_tokens) or a shorter data.seq_len"
            )
        check_token_ids(tokens[: num_windows * seq_len + 1], vocab_size, path)
        self.tokens, self.seq_len, self.val_fraction = tokens, seq_len, val_fraction
        self.num_train = num_windows - num_val
        self.num_val = num_val

    def window(self, ids: np.ndarray) -> Batch:
        starts = ids * self.seq_len
        rows = np.stack([np.asarray(self.tokens[s : s + self.seq_len + 1]) for s in starts])
        rows = rows.astype(np.int32)
        return Batch(rows[:, :-1], rows[:, 1:], ids.astype(np.int64))


class TrainOrder:
    """Deterministic, resumable batch order: batch t is a pure function of (seed, t)."""

    def __init__(self, windows: TokenWindows, batch_size: int, seed: int):
        if batch_size > windows.num_train:
            raise ConfigError(
                f"train.batch_size={batch_size} exceeds the {windows.num_train} training windows: "
                "lower it, or use more data (data.max_tokens) or a shorter data.seq_len"
            )
        self.windows, self.batch_size, self.seed = windows, batch_size, seed
        self._epoch, self._perm = -1, np.empty(0, np.int64)

    def batch(self, step: int) -> Batch:
        n = self.windows.num_train
        first = step * self.batch_size
        ids = np.empty(self.batch_size, np.int64)
        for j in range(self.batch_size):
            epoch, pos = divmod(first + j, n)
            ids[j] = self._permutation(epoch)[pos]
        return self.windows.window(ids)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch, self._perm = epoch, rng.permutation(self.windows.num_train)
        return self._perm


def validation_batches(
    windows: TokenWindows, batch_size: int, num_batches: int, batch_shards: int
) -> list[Batch]:
    """The first ``num_batches`` validation batches (the same every evaluation).

    With fewer validation windows than one batch, one smaller batch of as many as split evenly
    over the ``batch_shards`` devices a batch is spread over (``mesh.data x mesh.expert``), with
    a warning: a small validation set still gets evaluated, and says so.
    """
    base, available = windows.num_train, windows.num_val
    if not available or not num_batches:  # no validation set, or no evaluation asked for
        return []
    if available >= batch_size:
        return [
            windows.window(np.arange(base + i * batch_size, base + (i + 1) * batch_size))
            for i in range(min(num_batches, available // batch_size))
        ]
    size = available // batch_shards * batch_shards
    short = (
        f"data.val_fraction={windows.val_fraction} gives {available} validation windows, fewer "
        f"than train.batch_size={batch_size}"
    )
    if not size:
        log.warning(
            "%s, and too few to split over the %d batch shards (mesh.data x mesh.expert): "
            "evaluation is off; raise data.val_fraction",
            short,
            batch_shards,
        )
        return []
    log.warning(
        "%s: evaluating on one batch of %d (the most that split over the %d batch shards, "
        "mesh.data x mesh.expert); raise data.val_fraction to evaluate on full batches",
        short,
        size,
        batch_shards,
    )
    return [windows.window(np.arange(base, base + size))]

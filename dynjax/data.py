"""Token data: byte-level text or pre-tokenized arrays, cut into fixed windows with stable indices.

A *sample* is window ``i`` of the token stream: tokens ``[i*L, i*L + L + 1)`` for sequence length L
(inputs and next-token targets). Its index ``i`` never changes, so per-sample state (cached expert
assignments, DynaMoE seed 001 §4.2) can be keyed by it. Training order is a fresh permutation per
epoch drawn from the seed, and the batch at step t is a pure function of (seed, t): the iterator's
whole state is the number of batches consumed, which checkpoints save.

Each process reads only the rows of a batch its own devices consume (`TrainOrder.batch` with
``rows``, `dynjax.parallel.feed` says which), and a `Prefetcher` builds them ahead on a
background thread, so the step does not wait on data (issue 15 §5).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dynjax.corpus import eos_id, load_tokenizer, tokenized_corpus
from dynjax.errors import ConfigError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".json", ".csv", ".tsv", ".html", ".xml", ".c", ".h")
SCAN_CHUNK = 1 << 22  # tokens the vocabulary check reads at once (a memory-mapped corpus is larger)


class DataError(ConfigError):
    """The data at ``data.path`` cannot train; the message names the path and the fix."""


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """``data.tokenizer`` and the keys beside it: empty ``path`` is the byte-level default."""

    path: str = ""
    eos_token: str = ""
    cache: str = ""


@dataclasses.dataclass(frozen=True)
class TextCodec:
    """How a run's text becomes its tokens and back: its ``tokenizer`` (a ``tokenizers``
    Tokenizer, documents ending in ``eos``) or, without one, UTF-8 bytes, as `load_tokens`
    reads a text corpus."""

    tokenizer: Any = None
    eos: int | None = None

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``; a byte-level id past 255 (a vocabulary wider than bytes) or a
        cut UTF-8 sequence reads as U+FFFD."""
        if self.tokenizer is None:
            return b"".join(
                bytes([i]) if i < 256 else "\ufffd".encode() for i in ids
            ).decode("utf-8", errors="replace")
        return self.tokenizer.decode(ids)


def text_codec(path: str, tokenizer: TokenizerSpec) -> TextCodec:
    """The `TextCodec` of a run reading ``data.path`` = ``path`` with ``tokenizer``."""
    if tokenizer.path:
        tok = load_tokenizer(tokenizer.path)
        return TextCodec(tok, eos_id(tok, tokenizer.path, tokenizer.eos_token))
    if Path(path).suffix in (".npy", ".bin"):
        raise DataError(
            f"data.path={path!r} holds token ids and data.tokenizer is empty, so nothing says "
            "how text becomes those ids: set data.tokenizer to the tokenizer.json that made them"
        )
    return TextCodec()


def embedded_corpus_root() -> Path:
    """The default corpus: this interpreter's standard library sources (real text, no download)."""
    return Path(sysconfig.get_paths()["stdlib"])


def load_tokens(path: str, max_tokens: int, tokenizer: TokenizerSpec | None = None) -> np.ndarray:
    """Read a non-empty token stream (uint8 bytes for text, the stored dtype for arrays).

    ``path`` may be a text file, a directory of text files (read in sorted order), a ``.npy``
    array, or a raw ``.bin`` of uint16 tokens; empty means the embedded corpus. Arrays are
    memory-mapped, not read. With a ``tokenizer``, ``path`` is a corpus it tokenizes once into a
    cached token array (`dynjax.corpus`).
    """
    if tokenizer is not None and tokenizer.path:
        array = tokenized_corpus(path, tokenizer.path, tokenizer.cache, tokenizer.eos_token)
        return _as_tokens(_load_npy(array, path), path)
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
    """Rows of one global batch of B rows: ``rows`` [R] ascending (all B unless a process reads
    only its devices' share), inputs/targets [R, L] int32 of those rows, sample_ids [B] int64 of
    the whole batch (every process knows the order; reading the windows is the cost)."""

    inputs: np.ndarray
    targets: np.ndarray
    sample_ids: np.ndarray
    rows: np.ndarray


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

    def window(self, ids: np.ndarray, rows: np.ndarray | None = None) -> Batch:
        """The batch of samples ``ids``, reading only its ``rows`` (default: all)."""
        rows = np.arange(len(ids)) if rows is None else np.asarray(rows, np.int64)
        offsets = np.arange(self.seq_len + 1)
        # One gather: a memory-mapped stream reads only these windows.
        tokens = np.asarray(self.tokens[ids[rows, None] * self.seq_len + offsets])
        tokens = tokens.astype(np.int32).reshape(len(rows), self.seq_len + 1)
        return Batch(tokens[:, :-1], tokens[:, 1:], ids.astype(np.int64), rows)


class TrainOrder:
    """Deterministic, resumable batch order: batch t is a pure function of (seed, t), the same
    whichever rows of it a process reads, so resumes and process-count changes see the same
    global batches."""

    def __init__(self, windows: TokenWindows, batch_size: int, seed: int):
        if batch_size > windows.num_train:
            raise ConfigError(
                f"train.batch_size={batch_size} exceeds the {windows.num_train} training windows: "
                "lower it, or use more data (data.max_tokens) or a shorter data.seq_len"
            )
        self.windows, self.batch_size, self.seed = windows, batch_size, seed
        # (epoch, its permutation), one tuple: a prefetch thread and the loop may both read it.
        self._cached: tuple[int, np.ndarray] = (-1, np.empty(0, np.int64))

    def sample_ids(self, step: int) -> np.ndarray:
        """[B] window indices of batch ``step``."""
        n = self.windows.num_train
        epochs, pos = np.divmod(step * self.batch_size + np.arange(self.batch_size), n)
        ids = np.empty(self.batch_size, np.int64)
        for epoch in np.unique(epochs):  # a batch spans at most two epochs unless B > n
            ids[epochs == epoch] = self._permutation(int(epoch))[pos[epochs == epoch]]
        return ids

    def batch(self, step: int, rows: np.ndarray | None = None) -> Batch:
        """Batch ``step``, reading only its ``rows`` (default: all)."""
        return self.windows.window(self.sample_ids(step), rows)

    def _permutation(self, epoch: int) -> np.ndarray:
        cached_epoch, perm = self._cached
        if epoch != cached_epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.windows.num_train)
            self._cached = (epoch, perm)
        return perm


class Prefetcher:
    """Batches ``start, start + 1, ... stop - 1`` built ``depth`` ahead on a background thread.

    Reading windows (page faults on a memory-mapped corpus) then overlaps the dispatched steps,
    so the training thread only waits when the reader falls behind; ``depth=0`` builds each
    batch on the calling thread. A build error (`DataError`) is raised by the `get` of its step;
    `close` stops the thread without waiting for the queue to drain (end of run, exception).

    Grain (issue 15 §5) did not fit: its ``IndexSampler`` splits the records into one contiguous
    range per process (``ShardOptions``, ``even_split``) and shuffles within each, so the global
    batch at a step changes with the process count, and every process gets an equal share,
    where a pipeline's first-stage process needs whole batches and the others none. The order
    here is already a pure function of (seed, step) over memory-mapped windows: what is left is
    a bounded queue and one thread, not worth Grain's dependencies (array-record, etils, ...).
    """

    def __init__(self, build: Callable[[int], Batch], start: int, stop: int, depth: int):
        self.stop, self.depth = stop, depth
        self.build_seconds = 0.0  # spent building batches, on whichever thread
        self.wait_seconds = 0.0  # the caller spent in `get` (building, with depth 0)
        self._thread = None
        self._begin(build, start)

    def _begin(self, build: Callable[[int], Batch], start: int) -> None:
        self.build, self.next_step = build, start
        self._queue: queue.Queue = queue.Queue(maxsize=max(self.depth, 1))
        self._closed = threading.Event()
        if self.depth > 0:
            self._thread = threading.Thread(
                target=self._work, args=(start,), name="dynjax-prefetch", daemon=True
            )
            self._thread.start()

    def restart(self, start: int, build: Callable[[int], Batch] | None = None) -> None:
        """Read from ``start`` on, with ``build`` if given: after a rollback to an earlier
        step, or when the rows this process reads change. The batches read ahead are dropped;
        the time counters go on."""
        self.close()
        self._begin(build or self.build, start)

    def _timed_build(self, step: int) -> Batch:
        began = time.perf_counter()
        batch = self.build(step)
        self.build_seconds += time.perf_counter() - began
        return batch

    def _work(self, start: int) -> None:
        for step in range(start, self.stop):
            if self._closed.is_set():
                return
            try:
                item = self._timed_build(step)
            except BaseException as err:  # raised on the training thread by `get`
                item = err
            self._queue.put(item)  # blocks while the queue is full; `close` empties it
            if isinstance(item, BaseException):
                return

    def get(self, step: int) -> Batch:
        """Batch ``step``: the steps must be asked for in order."""
        if step != self.next_step or step >= self.stop or self._closed.is_set():
            raise ValueError(
                f"prefetcher asked for step {step}, expected {self.next_step} of "
                f"[.., {self.stop}){' (closed)' if self._closed.is_set() else ''}"
            )
        self.next_step += 1
        began = time.perf_counter()
        item = self._timed_build(step) if self._thread is None else self._queue.get()
        self.wait_seconds += time.perf_counter() - began
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        """Stop the thread and wait for it: at most the batch it is reading."""
        self._closed.set()
        while self._thread is not None and self._thread.is_alive():
            try:  # unblock a put on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.01)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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

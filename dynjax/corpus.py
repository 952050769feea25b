"""Corpora tokenized once with a Hugging Face tokenizer into a memory-mapped token file.

docs/running.md#tokenizers: with ``data.tokenizer`` set to a ``tokenizer.json``, the corpus at
``data.path`` (text files, JSONL with a ``text`` field per line, or Parquet with a ``text``
column) is tokenized in batches (the ``tokenizers`` package encodes each batch on all cores),
with the tokenizer's end-of-text id after every document, into one ``.npy`` token stream that
`dynjax.data` memory-maps like any other. The file is cached under ``data.token_cache`` by the
hash of the corpus's bytes, the tokenizer's and this format's version, and written atomically,
so a second run, or every process of a multi-process run, reads it instead of tokenizing again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from dynjax.errors import ConfigError

FORMAT = 1  # bump when the token file's content for the same inputs changes
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")
BATCH_DOCUMENTS = 256  # documents encoded per call (the tokenizer spreads one call over cores)


class TokenizerError(ConfigError):
    """The tokenizer or the corpus it reads cannot make a token stream; the message names the key
    and the fix."""


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dynjax" / "tokens"


def load_tokenizer(path: str) -> Any:
    """The ``tokenizers.Tokenizer`` of ``path`` (a ``tokenizer.json`` or the directory holding
    it), with a clear error when the package is missing or the file is not a tokenizer."""
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise TokenizerError(
            f"data.tokenizer={path!r} needs the tokenizers package: pip install 'dynjax[hf]'"
        ) from e
    file = _tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust parser raises its own exception type
        raise TokenizerError(
            f"data.tokenizer={path!r} is not a Hugging Face tokenizer.json ({e}): point it at "
            "the tokenizer.json a model directory holds"
        ) from e


def eos_id(tokenizer: Any, path: str, eos_token: str = "") -> int:
    """The id separating documents: ``eos_token`` if given, else the ``eos_token`` of the
    ``tokenizer_config.json`` beside the tokenizer, else the first of `EOS_NAMES` it knows."""
    names = [eos_token] if eos_token else [*_config_eos(path), *EOS_NAMES]
    for name in names:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return int(token_id)
    if eos_token:
        raise TokenizerError(
            f"data.eos_token={eos_token!r} is not a token of data.tokenizer={path!r}: name one "
            "of its special tokens"
        )
    raise TokenizerError(
        f"data.tokenizer={path!r} has none of the end-of-text tokens {EOS_NAMES} and no "
        "tokenizer_config.json naming one: set data.eos_token to the token that ends a document"
    )


def tokenized_corpus(
    corpus: str, tokenizer_path: str, cache: str = "", eos_token: str = "", progress: bool = True
) -> Path:
    """The ``.npy`` token stream of ``corpus`` under the tokenizer, tokenizing it on the first
    call (cached by content; see the module docstring)."""
    tokenizer = load_tokenizer(tokenizer_path)
    eos = eos_id(tokenizer, tokenizer_path, eos_token)
    files = corpus_files(corpus)
    digest = hashlib.sha256(f"dynjax tokens {FORMAT} eos {eos}\n".encode())
    digest.update(_tokenizer_file(tokenizer_path).read_bytes())
    for f in files:
        digest.update(f"{f.name}\n".encode())
        with f.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    root = Path(cache).expanduser() if cache else default_cache()
    target = root / f"{digest.hexdigest()[:32]}.npy"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with (root / f"{target.stem}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the processes of a run tokenize it once between them
        if not target.exists():
            _write(target, files, tokenizer, eos, corpus, progress)
    return target


def _write(
    target: Path, files: list[Path], tokenizer: Any, eos: int, corpus: str, progress: bool
) -> None:
    root = target.parent
    dtype = np.uint16 if tokenizer.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.uint32
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        raw, count = Path(tmp) / "tokens.raw", 0
        with raw.open("wb") as out:
            bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
                       desc="tokenizing", disable=not progress)
            for batch, size in _batches(files):
                for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                    ids = np.asarray(encoding.ids + [eos], dtype=dtype)
                    out.write(ids.tobytes())
                    count += ids.size
                bar.update(size)
            bar.close()
        if count == 0:
            raise TokenizerError(f"data.path={corpus!r} holds no documents to tokenize")
        tokens = np.lib.format.open_memmap(Path(tmp) / "tokens.npy", "w+", dtype, (count,))
        tokens[:] = np.memmap(raw, dtype=dtype, mode="r")
        tokens.flush()
        del tokens
        os.replace(Path(tmp) / "tokens.npy", target)  # atomic: a reader sees all or nothing


def corpus_files(corpus: str) -> list[Path]:
    """The corpus's files in reading order: one file, or a directory's sorted files of the
    formats this module reads."""
    p = Path(corpus).expanduser()
    if not corpus or not p.exists():
        raise TokenizerError(
            f"data.path={corpus!r} does not exist: data.tokenizer tokenizes the corpus at "
            "data.path (text, .jsonl or .parquet files, or a directory of them)"
        )
    suffixes = (*TEXT_SUFFIXES, ".jsonl", ".parquet")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in suffixes) if p.is_dir() \
        else [p]
    if not files or any(f.suffix not in suffixes for f in files):
        raise TokenizerError(
            f"data.path={corpus!r} holds no file data.tokenizer reads: text "
            f"({', '.join(TEXT_SUFFIXES)}), .jsonl (a 'text' field per line) or .parquet (a "
            "'text' column)"
        )
    return files


def _batches(files: list[Path]) -> Iterator[tuple[list[str], int]]:
    """Documents in order, ``BATCH_DOCUMENTS`` at a time, with the bytes of input they finish."""
    batch: list[str] = []
    for f in files:
        for doc in _documents(f):
            batch.append(doc)
            if len(batch) == BATCH_DOCUMENTS:
                yield batch, 0
                batch = []
        yield batch, f.stat().st_size
        batch = []


def _documents(f: Path) -> Iterator[str]:
    if f.suffix == ".jsonl":
        with f.open(encoding="utf-8") as lines:
            for n, line in enumerate(lines, 1):
                if line.strip():
                    yield _text_field(line, f, n)
    elif f.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise TokenizerError(
                f"{f} is Parquet, which needs the pyarrow package: pip install 'dynjax[hf]'"
            ) from e
        table = pq.ParquetFile(f)
        if "text" not in table.schema_arrow.names:
            raise TokenizerError(f"{f} has no 'text' column (it has {table.schema_arrow.names})")
        for group in table.iter_batches(columns=["text"]):
            yield from (t for t in group.column(0).to_pylist() if t)
    else:
        text = f.read_text(encoding="utf-8", errors="replace")
        if text:
            yield text


def _text_field(line: str, f: Path, number: int) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise TokenizerError(
            f"{f} line {number} is not a JSON object with a string 'text' field: each line of a "
            ".jsonl corpus is one document, {{\"text\": ...}}"
        )
    return record["text"]


def _tokenizer_file(path: str) -> Path:
    p = Path(path).expanduser()
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise TokenizerError(
            f"data.tokenizer={path!r} does not exist: give a tokenizer.json or the model "
            "directory holding one"
        )
    return file


def _config_eos(path: str) -> list[str]:
    config = _tokenizer_file(path).parent / "tokenizer_config.json"
    if not config.is_file():
        return []
    eos = json.loads(config.read_text()).get("eos_token")
    if isinstance(eos, dict):  # an AddedToken record
        eos = eos.get("content")
    return [eos] if isinstance(eos, str) else []

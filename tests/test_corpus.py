"""Corpora tokenized with a Hugging Face tokenizer: content, formats, cache and errors."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from dynjax.config import validate_config
from dynjax.corpus import TokenizerError, tokenized_corpus
from dynjax.data import TokenizerSpec, load_tokens
from dynjax.errors import ConfigError
from dynjax.train import train
from tests.helpers import losses
from tests.tiny import CORPUS, tiny_config

DOCS = ["the cat sat on the mat", "a dog ran", "the dog sat on a cat and the mat"]
EOS = "<|endoftext|>"


def make_tokenizer(path, specials=(EOS,)):
    """A word-level tokenizer trained on the spot on `DOCS` (no download)."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["<unk>", *specials]))
    tok.save(str(path))
    return tok


def expected(tok, docs):
    eos = tok.token_to_id(EOS)
    return np.array([i for d in docs for i in tok.encode(d).ids + [eos]])


@pytest.fixture
def tok(tmp_path):
    return make_tokenizer(tmp_path / "tokenizer.json")


def test_text_jsonl_and_parquet_corpora_give_each_document_then_eos(tmp_path, tok):
    spec = str(tmp_path / "tokenizer.json")
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, d in enumerate(DOCS):
        (texts / f"{i}.txt").write_text(d)
    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(DOCS)]
    jsonl.write_text("\n".join(lines) + "\n\n")  # a blank line is no document
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": DOCS}), parquet, row_group_size=2)
    want = expected(tok, DOCS)
    for corpus in (texts, jsonl, parquet):
        got = np.load(tokenized_corpus(str(corpus), spec, str(tmp_path / "cache"), progress=False))
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.uint16
    tokens = load_tokens(str(jsonl), 10, TokenizerSpec(spec, cache=str(tmp_path / "cache")))
    np.testing.assert_array_equal(tokens, want)  # memory-mapped whole: max_tokens is byte-level


def test_the_cache_is_keyed_by_corpus_and_tokenizer(tmp_path, tok):
    spec, cache = str(tmp_path / "tokenizer.json"), str(tmp_path / "cache")
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    first = tokenized_corpus(str(corpus), spec, cache, progress=False)
    stamp = first.stat().st_mtime_ns
    assert tokenized_corpus(str(corpus), spec, cache, progress=False) == first
    assert first.stat().st_mtime_ns == stamp  # read, not tokenized again
    corpus.write_text(json.dumps({"text": DOCS[0]}) + "\n")
    changed = tokenized_corpus(str(corpus), spec, cache, progress=False)
    assert changed != first
    np.testing.assert_array_equal(np.load(changed), expected(tok, DOCS[:1]))
    make_tokenizer(tmp_path / "other.json", specials=(EOS, "<pad>"))
    assert tokenized_corpus(str(corpus), str(tmp_path / "other.json"), cache, False) != changed
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir() if p.suffix == ".npy") == [
        ".npy"
    ] * 3
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]  # no partial files


def test_the_end_of_text_token_comes_from_the_config_or_the_tokenizer(tmp_path):
    make_tokenizer(tmp_path / "tokenizer.json", specials=("<s>", "</s>"))
    spec, corpus = str(tmp_path / "tokenizer.json"), tmp_path / "a.txt"
    corpus.write_text(DOCS[0])
    tok = Tokenizer.from_file(spec)
    got = np.load(tokenized_corpus(str(corpus), spec, str(tmp_path / "c"), progress=False))
    assert got[-1] == tok.token_to_id("</s>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>"}}))
    got = np.load(tokenized_corpus(str(corpus), spec, str(tmp_path / "c"), progress=False))
    assert got[-1] == tok.token_to_id("<s>")
    got = np.load(tokenized_corpus(str(corpus), spec, str(tmp_path / "c"), "mat", False))
    assert got[-1] == tok.token_to_id("mat")
    with pytest.raises(TokenizerError, match="data.eos_token='<eot>' is not a token"):
        tokenized_corpus(str(corpus), spec, str(tmp_path / "c"), "<eot>", False)
    make_tokenizer(tmp_path / "none.json", specials=())
    with pytest.raises(TokenizerError, match="set data.eos_token"):
        tokenized_corpus(str(corpus), str(tmp_path / "none.json"), str(tmp_path / "c"))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing", "data.path=.*does not exist"),
        (lambda d: _write(d / "a.csv", "x"), "holds no file data.tokenizer reads"),
        (lambda d: _write(d / "a.jsonl", '{"text": "a"}\n[1]\n'), "a.jsonl line 2 is not a JSON"),
        (lambda d: _write(d / "b.jsonl", '{"txt": "a"}\n'), "line 1 .* 'text' field"),
        (lambda d: _parquet(d / "a.parquet", {"body": ["a"]}), "has no 'text' column"),
        (lambda d: _write(d / "e.txt", ""), "holds no documents"),
    ],
)
def test_bad_corpora_are_refused_by_name(tmp_path, tok, make, message):
    with pytest.raises(TokenizerError, match=message):
        tokenized_corpus(str(make(tmp_path)), str(tmp_path / "tokenizer.json"),
                         str(tmp_path / "c"), progress=False)


def test_the_config_checks_the_tokenizer_before_any_corpus_is_read(tmp_path, tok):
    spec = str(tmp_path / "tokenizer.json")
    with pytest.raises(ConfigError, match=r"has \d+ tokens but model.vocab_size=4: raise"):
        validate_config(tiny_config(data__tokenizer=spec, model__vocab_size=4), 1)
    with pytest.raises(ConfigError, match="data.path, which is empty"):
        validate_config(tiny_config(data__tokenizer=spec, data__path=""), 1)
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json"):
        validate_config(tiny_config(data__tokenizer=str(CORPUS)), 1)
    with pytest.raises(ConfigError, match="data.tokenizer=.*does not exist"):
        validate_config(tiny_config(data__tokenizer=str(tmp_path / "nope.json")), 1)


def test_a_run_trains_on_the_tokenized_corpus(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS * 40))
    cfg = tiny_config(
        data__path=str(corpus), data__tokenizer=str(tmp_path / "tokenizer.json"),
        data__seq_len=8, data__val_fraction=0.2, train__steps=3, train__eval_every=100,
        train__checkpoint_every=100, model__vocab_size=32, model__num_layers=1,
    )
    train(cfg, str(tmp_path / "run"))
    curve = losses(tmp_path / "run")
    assert sorted(curve) == [1, 2, 3] and all(np.isfinite(list(curve.values())))
    assert len(os.listdir(tmp_path / "xdg" / "dynjax" / "tokens")) == 2  # the array and its lock


def _write(path, text):
    path.write_text(text)
    return path


def _parquet(path, columns):
    pq.write_table(pa.table(columns), path)
    return path

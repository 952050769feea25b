"""`python -m dynjax.hf import` and `export` around `python -m dynjax.train --workdir`."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from dynjax.checkpoint.huggingface import SafeTensors
from dynjax.hf.__main__ import main as hf_main
from dynjax.train import main as train_main

FIXTURES = Path(__file__).parents[1] / "data" / "hf"
WORDS = ["the cat sat on the mat", "a dog ran far", "the dog sat on a cat and the mat"]
RUN = [  # a tiny fine-tuning run on two CPU cores
    "--config.train.steps=2", "--config.train.batch_size=4", "--config.train.log_every=1",
    "--config.train.eval_every=2", "--config.train.checkpoint_every=2",
    "--config.data.seq_len=12", "--config.data.val_fraction=0.2",
    "--config.checkpoint.async_save=False", "--config.moe.dispatch=static",
]


def model_dir(tmp_path: Path, name: str) -> Path:
    """Fixture ``name`` with a word-level tokenizer of fewer tokens than its vocabulary."""
    d = tmp_path / name
    shutil.copytree(FIXTURES / name, d)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(WORDS, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    tok.save(str(d / "tokenizer.json"))
    return d


def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": w}) + "\n" for w in WORDS * 30))
    return path


def tensors(directory: Path) -> dict[str, np.ndarray]:
    src = SafeTensors(directory)
    return {n: src.read(n, (slice(None),) * len(src.shape(n))) for n in src.files}


# Two architectures in the quick suite (one dense and tied, one MoE with a shared expert); every
# other fixture in the slow stage, so that each listed architecture imports, trains and exports.
QUICK = ("llama_tied_rope_scaled", "qwen2_moe")
ALL = sorted(p.name for p in FIXTURES.iterdir() if (p / "logits.npy").exists())


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in ALL]
)
def test_import_then_export_gives_back_the_weights_and_training_changes_them(tmp_path, name):
    source, work = model_dir(tmp_path, name), tmp_path / "run"
    data = f"--config.data.path={corpus(tmp_path)}"
    assert hf_main(["import", str(source), "--workdir", str(work), data, *RUN]) == 0
    assert (work / "checkpoints" / "0").is_dir()
    assert hf_main(["export", "--workdir", str(work), "--out", str(tmp_path / "untrained")]) == 0
    original, untrained = tensors(source), tensors(tmp_path / "untrained")
    if "lm_head.weight" not in original:  # tied: exported untied, the head a copy
        original["lm_head.weight"] = original["model.embed_tokens.weight"]
    assert set(untrained) == set(original)
    for key, value in original.items():
        np.testing.assert_array_equal(untrained[key], value, err_msg=key)
    config = json.loads((tmp_path / "untrained" / "config.json").read_text())
    assert config["model_type"] == json.loads((source / "config.json").read_text())["model_type"]
    assert not config["tie_word_embeddings"]
    assert (tmp_path / "untrained" / "tokenizer.json").is_file()

    assert train_main(["--workdir", str(work)]) == 0  # the workdir's config.py, from step 0
    assert hf_main(["export", "--workdir", str(work), "--out", str(tmp_path / "trained")]) == 0
    trained = tensors(tmp_path / "trained")
    changed = [k for k in original if not np.array_equal(trained[k], original[k])]
    assert "model.layers.1.self_attn.o_proj.weight" in changed
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


def test_bad_imports_stop_with_an_error(tmp_path, capsys):
    source = model_dir(tmp_path, "llama")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    assert hf_main(["import", str(source), "--workdir", str(tmp_path / "w")]) == 2
    assert "error: llama with hidden_act='gelu' is not supported" in capsys.readouterr().err
    assert hf_main(["import", str(tmp_path / "nope"), "--workdir", str(tmp_path / "w")]) == 2
    assert "has no config.json" in capsys.readouterr().err
    assert hf_main(["export", "--workdir", str(tmp_path / "nope"), "--out", "x"]) == 2
    assert "error:" in capsys.readouterr().err


def test_a_model_trained_here_exports_as_llama_and_imports_back(tmp_path):
    """A dense llama-family run (its config.json, no import) exports a Llama directory whose
    import holds the same weights: exported again, every tensor is equal."""
    from dynjax.train import train
    from tests.tiny import tiny_config

    cfg = tiny_config(model__family="llama", model__num_kv_heads=1, train__steps=2,
                      train__eval_every=2, train__checkpoint_every=2)
    train(cfg, tmp_path / "base", progress=False)
    assert hf_main(["export", "--workdir", str(tmp_path / "base"), "--out",
                    str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["model_type"], config["num_key_value_heads"]) == ("llama", 1)
    tiny = [f"--config.data.path={cfg.data.path}", f"--config.data.seq_len={cfg.data.seq_len}",
            "--config.checkpoint.async_save=False"]
    assert hf_main(["import", str(tmp_path / "hf"), "--workdir", str(tmp_path / "ft"),
                    *tiny]) == 0
    assert hf_main(["export", "--workdir", str(tmp_path / "ft"), "--out",
                    str(tmp_path / "again")]) == 0
    first, again = tensors(tmp_path / "hf"), tensors(tmp_path / "again")
    assert set(first) == set(again)
    for key in first:
        np.testing.assert_array_equal(again[key], first[key], err_msg=key)
    cfg.model.family = "gpt"  # GPT has no Hugging Face architecture to export as
    train(cfg, tmp_path / "gpt", progress=False)
    assert hf_main(["export", "--workdir", str(tmp_path / "gpt"), "--out", "x"]) == 2

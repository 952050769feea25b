"""Every Hugging Face fixture imported, then decoded: the KV-cached greedy decoder of
`dynjax.model.decode` continues each fixture's tokens as the reference implementation's logits
say (their argmax at every position), and the generate command runs on the imported workdir."""

import jax
import numpy as np
import pytest

from dynjax.generate import main as generate_main
from dynjax.hf.__main__ import main as hf_main
from dynjax.hf.convert import workdir_config
from dynjax.model.decode import Decoder
from dynjax.train import main as train_main
from dynjax.train import newest_checkpoint

from .test_convert import ALL as NAMES
from .test_convert import FIXTURES, RUN, corpus, model_dir


@pytest.mark.parametrize("name", NAMES)
def test_an_imported_checkpoint_decodes_as_its_reference(tmp_path, name):
    source, work = model_dir(tmp_path, name), tmp_path / "work"
    data = f"--config.data.path={corpus(tmp_path)}"
    assert hf_main(["import", str(source), "--workdir", str(work), data, *RUN]) == 0
    cfg, schemes = workdir_config(work)
    params, plan, exp = newest_checkpoint(cfg, work, schemes)
    tokens = np.load(FIXTURES / name / "tokens.npy")  # [B, T]
    want = np.load(FIXTURES / name / "logits.npy").argmax(-1)  # [B, T] the reference's argmax
    decoder = Decoder(exp.model_cfg, exp.layer_options(plan))
    for p in (1, tokens.shape[1] // 2, tokens.shape[1] - 1):  # prompts of 1, T/2 and T-1 tokens
        out = decoder.generate(jax.device_get(params), tokens[:, :p], max_new_tokens=1)
        np.testing.assert_array_equal(out.tokens[:, 0], want[:, p - 1], err_msg=f"prompt {p}")


def test_the_generate_command_continues_an_imported_model(tmp_path, capsys):
    source, work = model_dir(tmp_path, "llama"), tmp_path / "work"
    data = f"--config.data.path={corpus(tmp_path)}"
    assert hf_main(["import", str(source), "--workdir", str(work), data, *RUN]) == 0
    capsys.readouterr()
    assert generate_main(["--workdir", str(work), "--prompt", "the cat sat",
                          "--max-new-tokens", "4"]) == 0
    # the continuation (empty if the first new token is the tokenizer's end of text) and the
    # timing line
    _, err = capsys.readouterr()
    assert "4 new tokens in" in err and "tokens/s" in err


def test_export_then_import_generates_the_same_greedy_text(tmp_path, capsys):
    """A fine-tuned model exported and imported back continues a prompt as it did before."""
    source, work = model_dir(tmp_path, "mixtral"), tmp_path / "work"
    data = f"--config.data.path={corpus(tmp_path)}"
    assert hf_main(["import", str(source), "--workdir", str(work), data, *RUN]) == 0
    assert train_main(["--workdir", str(work)]) == 0
    assert hf_main(["export", "--workdir", str(work), "--out", str(tmp_path / "hf")]) == 0
    again = tmp_path / "again"
    assert hf_main(["import", str(tmp_path / "hf"), "--workdir", str(again), data, *RUN]) == 0
    texts, tokens = [], []
    for w in (work, again):
        capsys.readouterr()
        assert generate_main(["--workdir", str(w), "--prompt", "the dog sat on",
                              "--max-new-tokens", "6"]) == 0
        texts.append(capsys.readouterr().out)
        cfg, schemes = workdir_config(w)  # the new token ids themselves (the text stops at EOS)
        params, plan, exp = newest_checkpoint(cfg, w, schemes)
        decoder = Decoder(exp.model_cfg, exp.layer_options(plan))
        prompt = np.load(FIXTURES / "mixtral" / "tokens.npy")[:1, :5]
        tokens.append(decoder.generate(jax.device_get(params), prompt, max_new_tokens=6).tokens)
    assert texts[0] == texts[1]
    np.testing.assert_array_equal(tokens[0], tokens[1])

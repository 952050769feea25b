"""benchmarks/pipeline.py's MaxText comparison (issue 33 §3): both sides of each shape describe
one model, mesh and batch, and dynjax's side is a run the config accepts."""

import json

import pytest

from dynjax.config import check_run, load_config

from .helpers import ROOT, benchmark_script

benchmark_script("real_pipeline")  # pipeline.py imports it as a sibling script
bench = benchmark_script("pipeline")


def _maxtext(shape: dict[str, int]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in bench.maxtext_overrides(shape))


@pytest.mark.parametrize("name", sorted(bench.COMPARE_SHAPES))
def test_both_sides_train_the_same_model_on_the_same_mesh(name):
    shape = bench.COMPARE_SHAPES[name]
    overrides = [o.removeprefix("--config.") for o in bench.train_overrides(shape, steps=16)]
    run = check_run(load_config(ROOT / "configs/quickstart.py", overrides), 8)
    theirs = _maxtext(shape)
    m, t = run.model, run.train
    assert m.family == "llama"  # RMSNorm, SwiGLU, RoPE: MaxText's llama2 decoder block
    assert (m.num_layers, m.d_model, m.num_heads, m.mlp_dim, m.vocab_size) == (
        int(theirs["base_num_decoder_layers"]),
        int(theirs["base_emb_dim"]),
        int(theirs["base_num_query_heads"]),
        int(theirs["base_mlp_dim"]),
        int(theirs["vocab_size"]),
    )
    assert int(theirs["head_dim"]) * m.num_heads == m.d_model
    assert run.data.seq_len == int(theirs["max_target_length"])
    devices = int(theirs["ici_pipeline_parallelism"]) * int(theirs["ici_data_parallelism"])
    assert t.batch_size == int(theirs["per_device_batch_size"]) * devices
    assert (run.mesh.stage, run.mesh.data) == (
        int(theirs["ici_pipeline_parallelism"]),
        int(theirs["ici_data_parallelism"]),
    )
    assert t.microbatches == int(theirs["num_pipeline_microbatches"])
    layers_per_stage = int(theirs["num_layers_per_pipeline_stage"])
    assert layers_per_stage * run.mesh.stage == m.num_layers
    assert t.dtype == theirs["dtype"] == "float32"


def test_the_quoted_maxtext_figures_cover_every_shape():
    quoted = json.loads(bench.MAXTEXT_RESULTS.read_text())
    assert set(quoted["shapes"]) == set(bench.COMPARE_SHAPES)
    for figures in quoted["shapes"].values():
        assert figures["tokens_per_sec"] > 0 and figures["compile_seconds"] > 0


@pytest.mark.parametrize(
    ("names", "steps", "named"),
    [(["A", "Z"], 16, "no shape ['Z']; the shapes are A, B, C"), (["A"], 4, "at least 5")],
)
def test_bad_arguments_exit_2_naming_the_fix(capsys, names, steps, named):
    with pytest.raises(SystemExit) as exit_:
        bench.check_compare_args(names, steps)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --maxtext") and named in err

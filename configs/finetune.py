"""Fine-tuning an imported Hugging Face model (docs/models.md#fine-tuning-a-hugging-face-model):
the base config `python -m dynjax.hf import` writes the model's own keys into.

A short run at a small, constant learning rate, with layer freezing on (AutoFreeze, seed 000
§2.3: fine-tuning is where its converged front layers pay off) and the data the import names
(`--config.data.path=CORPUS`; with the model's tokenizer.json, `data.tokenizer` is set to it).
The model's sizes and options come from its config.json, not from here.

    python -m dynjax.hf import MODEL_DIR --workdir runs/ft --config.data.path=corpus.jsonl
    python -m dynjax.train --workdir runs/ft
"""

from dynjax.config import default_config


def get_config():
    c = default_config()
    c.train.steps = 200
    c.train.learning_rate = 1e-4
    c.train.warmup_steps = 10
    c.train.min_lr_ratio = 1.0  # constant after warm-up
    c.train.weight_decay = 0.0
    c.train.log_every = 10
    c.train.eval_every = 50
    c.train.checkpoint_every = 50
    c.freezing.enabled = True
    c.freezing.every = 20
    c.freezing.start_step = 40
    c.freezing.max_fraction = 0.5
    return c

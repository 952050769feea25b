"""Tokens/s of the dynjax training step against a minimal hand-written jax/flax step.

Both train the same model on the same batches with the same optimizer in the same process. The
dynjax side runs what ``dynjax.train`` runs per step: the AOT-compiled Plan executable, the
resumable batch order, sharded device placement, the Monitor (metrics read Δ steps late) and the
Controller's poll/observe. The baseline is the ten-line loop a user would write. Rounds alternate
A, B, A, B... and the table reports medians (the machine is shared and noisy).

    python benchmarks/step_throughput.py [--config configs/moe.py] [--steps 30] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import optax
from flax import nnx

from dynjax.config import load_config
from dynjax.dynamism.moe.part import capacities_of
from dynjax.experiment import Experiment
from dynjax.model import GPT, lm_loss
from dynjax.model.moe import static_options
from dynjax.recompile import Budget, Compiler, Controller, Monitor


def hand_written(exp: Experiment, plan):
    """The minimal loop: jit(value_and_grad + optax) over numpy batches."""
    model = GPT(exp.model_cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    params = nnx.to_pure_dict(params)
    opt = exp.optimizer
    opt_state = opt.init(params)

    cfg = exp.model_cfg
    options = static_options(cfg.num_layers, cfg.moe_layers, capacities_of(plan))

    def loss_fn(p, x, y):
        logits, _ = nnx.merge(graphdef, p)(x, options=options)
        return lm_loss(logits, y)

    @jax.jit
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    def run(steps: int, start: int) -> float:
        nonlocal params, opt_state
        t0 = time.perf_counter()
        for t in range(start, start + steps):
            b = exp.order.batch(t)
            params, opt_state, loss = step(params, opt_state, b.inputs, b.targets)
        jax.block_until_ready(loss)
        return time.perf_counter() - t0

    return run


def dynjax_loop(exp: Experiment, plan):
    """The per-step work of dynjax.train, minus logging to disk."""
    compiler = Compiler(exp.lower_train_step)
    executable = compiler.get(plan).executable
    controller = Controller(
        plan,
        compiler,
        [],
        emit=lambda e: None,
        validate=lambda p: p.validate(exp.ctx),
        budget=Budget(1, 1),
    )
    monitor = Monitor(2)
    state = exp.init_state()

    def run(steps: int, start: int) -> float:
        t0 = time.perf_counter()
        for t in range(start, start + steps):
            controller.poll(t)
            batch = exp.order.batch(t)
            state["params"], state["opt_state"], metrics = executable(
                state["params"], state["opt_state"], exp.device_batch(batch, plan=plan)
            )
            monitor.push(t, metrics)
            for s, m in monitor.pop_ready(t):
                controller.observe(s, m)
        for s, m in monitor.drain():
            controller.observe(s, m)
        return time.perf_counter() - t0

    controller.start()
    return run, controller


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/quickstart.py")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    configs = [args.config] if args.config != "all" else ["configs/quickstart.py", "configs/moe.py"]
    print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}, jax {jax.__version__}")
    print(
        f"{'config':<22}{'baseline tok/s':>16}{'dynjax tok/s':>14}{'ratio':>8}  (median of "
        f"{args.rounds} rounds x {args.steps} steps)"
    )
    for path in configs:
        exp = Experiment.from_config(load_config(path))
        plan = exp.initial_plan()
        base, (ours, controller) = hand_written(exp, plan), dynjax_loop(exp, plan)
        base(3, 0), ours(3, 0)  # compile and warm up both
        tokens = args.steps * exp.settings.train.batch_size * exp.settings.data.seq_len
        rates = {"base": [], "ours": []}
        for r in range(args.rounds):
            start = 3 + r * args.steps
            rates["base"].append(tokens / base(args.steps, start))
            rates["ours"].append(tokens / ours(args.steps, start))
        controller.stop()
        ratios = [o / b for o, b in zip(rates["ours"], rates["base"], strict=True)]
        print(
            f"{path:<22}{statistics.median(rates['base']):>16,.0f}"
            f"{statistics.median(rates['ours']):>14,.0f}{statistics.median(ratios):>8.3f}"
            f"  (ratio min {min(ratios):.3f}, max {max(ratios):.3f})"
        )


if __name__ == "__main__":
    main()

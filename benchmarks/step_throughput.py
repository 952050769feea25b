"""Tokens/s of the dynjax training step against a minimal hand-written jax/flax step.

Both train the same model on the same batches with the same optimizer in the same process. The
dynjax side runs what ``dynjax.train`` runs per step: the AOT-compiled Plan executable, the
resumable batch order, sharded device placement, the Monitor (metrics read Δ steps late) and the
Controller's poll/observe. The baseline is the ten-line loop a user would write. Rounds alternate
A, B, A, B... and the table reports medians (the machine is shared and noisy).

``--remat`` instead times the single-program step under each `model.remat` policy (`remat_rows`:
step ms, its ratio to "none", and the compiled step's memory from ``memory_analysis()``), the
policies alternating round by round; benchmarks/gpu_suite.py's train section runs the same rows.

    python benchmarks/step_throughput.py [--config configs/moe.py] [--steps 30] [--rounds 5]
    python benchmarks/step_throughput.py --remat [--set model.num_layers=8 ...]
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
from dynjax.model.remat import REMAT, host_offload_available
from dynjax.parallel.memory_needs import device_bytes_needed
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


def remat_rows(exp: Experiment, *, steps: int, rounds: int) -> list[dict]:
    """One row per `model.remat` policy of ``exp``'s single-program step (every layer under
    it): ``step_ms`` (median over ``rounds`` of ``steps`` steps; the policies take turns each
    round, the machine being shared), ``vs_none`` (that over "none"'s: the recomputation's
    price), ``tokens_per_sec``, and the compiled step's ``peak_bytes`` (what one device needs
    while it runs, `device_bytes_needed`) and ``temp_bytes`` (its temporaries: where the kept
    activations live). A policy the backend cannot run is a row with its ``reason``."""
    layers, base = exp.settings.model.num_layers, exp.initial_plan()
    rows, runs = [], {}
    for remat in REMAT:
        if remat == "offload_proj" and not host_offload_available():
            rows.append({"remat": remat, "status": "skipped",
                         "reason": f"{jax.default_backend()}: device memory is host memory"})
            continue
        fn = exp.lower_train_step(base.replace(remat=(remat,) * layers)).compile()
        state = exp.init_state()
        runs[remat] = [fn, state["params"], state["opt_state"]]
        (peak,) = device_bytes_needed(fn).values()
        temp = fn.memory_analysis().temp_size_in_bytes
        rows.append({"remat": remat, "status": "ok", "peak_bytes": peak, "temp_bytes": temp})
    batches = [exp.device_batch(exp.order.batch(t)) for t in range(steps)]

    def run(remat: str) -> float:
        fn, params, opt = runs[remat]
        t0 = time.perf_counter()
        for b in batches:
            params, opt, metrics = fn(params, opt, b)
        jax.block_until_ready(metrics)
        runs[remat][1:] = params, opt
        return (time.perf_counter() - t0) / steps

    for remat in runs:
        run(remat)  # warm up
    seconds = {remat: [] for remat in runs}
    for _ in range(rounds):
        for remat in runs:
            seconds[remat].append(run(remat))
    tokens = exp.settings.train.batch_size * exp.settings.data.seq_len
    none = statistics.median(seconds["none"])
    for row in rows:
        if row["status"] == "ok":
            step = statistics.median(seconds[row["remat"]])
            row.update(step_ms=1e3 * step, vs_none=step / none, tokens_per_sec=tokens / step)
    return rows


def print_remat(args: argparse.Namespace) -> None:
    exp = Experiment.from_config(load_config(args.config, args.set))
    m = exp.settings.model
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; {args.config} "
          f"{' '.join(args.set)}: {m.num_layers} layers, d_model {m.d_model}, seq "
          f"{exp.settings.data.seq_len}, batch {exp.settings.train.batch_size}, "
          f"{exp.settings.train.dtype}, scan_layers={m.scan_layers}")
    print(f"{'model.remat':<14}{'step ms':>9}{'vs none':>9}{'tok/s':>10}{'peak MB':>9}"
          f"{'temp MB':>9}  (median of {args.rounds} rounds x {args.steps} steps)")
    for r in remat_rows(exp, steps=args.steps, rounds=args.rounds):
        if r["status"] != "ok":
            print(f"{r['remat']:<14}  skipped: {r['reason']}")
            continue
        print(f"{r['remat']:<14}{r['step_ms']:>9.1f}{r['vs_none']:>9.3f}"
              f"{r['tokens_per_sec']:>10,.0f}{r['peak_bytes'] / 1e6:>9.1f}"
              f"{r['temp_bytes'] / 1e6:>9.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/quickstart.py")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--remat", action="store_true", help="the model.remat policies' table")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="config overrides (with --remat)")
    args = parser.parse_args()
    if args.remat:
        print_remat(args)
        return
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

"""What FSDP saves per device: XLA's ``memory_analysis()`` of the compiled single-program train
step with the parameters and optimizer state replicated over the data devices against split over
them (``parallel.fsdp``), for 1, 2, 4 and 8 data devices (fake CPU devices: bytes, not speed).

Argument bytes are the parameters, the Adam moments and the batch each device holds; temporary
bytes what XLA allocates inside the step (the gathered parameters among them).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 PYTHONPATH=. \\
        python3 benchmarks/fsdp_memory.py [--d-model 256 --layers 4 --data 1,2,4,8]
"""

from __future__ import annotations

import argparse

from dynjax.config import default_config
from dynjax.experiment import Experiment


def analysis(d_model: int, layers: int, data: int, fsdp: bool):
    cfg = default_config()
    cfg.model.d_model, cfg.model.mlp_dim, cfg.model.num_layers = d_model, 4 * d_model, layers
    cfg.train.batch_size, cfg.data.seq_len = 8, 64
    cfg.mesh.data, cfg.parallel.fsdp = data, fsdp
    exp = Experiment.from_config(cfg)
    return exp.lower_train_step(exp.initial_plan()).compile().memory_analysis()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--data", default="1,2,4,8", help="data device counts, comma-separated")
    args = parser.parse_args()
    print(f"\nd_model {args.d_model}, {args.layers} layers: MB per device of the compiled step")
    print(f"{'data':>5}{'replicated args':>17}{'FSDP args':>11}{'ratio':>7}"
          f"{'replicated temp':>17}{'FSDP temp':>11}")
    for data in (int(d) for d in args.data.split(",")):
        rep, sharded = (analysis(args.d_model, args.layers, data, f) for f in (False, True))
        print(f"{data:>5}{rep.argument_size_in_bytes / 1e6:>17.2f}"
              f"{sharded.argument_size_in_bytes / 1e6:>11.2f}"
              f"{sharded.argument_size_in_bytes / rep.argument_size_in_bytes:>7.3f}"
              f"{rep.temp_size_in_bytes / 1e6:>17.2f}{sharded.temp_size_in_bytes / 1e6:>11.2f}")


if __name__ == "__main__":
    main()

"""What tracing a torch.compile'd model costs, and what arming it costs later.

    python benchmarks/compiled.py [--backend inductor|aot_eager] [--in-place] [--steps N]
                                  [--repeats R]

The MLP workload (overhead.py's) compiled, each row through the public API with garbage
collection on, interleaved in rounds (overhead.py's harness):

  untraced                 the compiled model's training step
  trace()                  armed: the compiled call is one op (its backward one node), the
                           loss and optimizer code around it traced as usual
  trace(eager_check=True)  ... and the compiled call run once more eagerly, compared

and, measured once: the first traced step of a model compiled before arming against an
untraced step (a recompile would show here as seconds), and the compiles Dynamo counted
while arming and disarming (0 is what a user must pay). ``--in-place``: the model compiled
with ``model.compile()`` instead of ``torch.compile(model)``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from overhead import Config, measure, table  # noqa: E402
from workloads import Workload, make_mlp  # noqa: E402

import torchscope  # noqa: E402


def compiled_mlp(backend: str, in_place: bool = False) -> Workload:
    w = make_mlp()
    if in_place:
        w.model.compile(backend=backend)
        compiled = w.model
    else:
        compiled = torch.compile(w.model, backend=backend)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    opt = w.optimizer

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()

    how = f"model.compile(backend={backend!r})" if in_place else f"torch.compile({backend})"
    return Workload("mlp", f"{w.description}, {how}", w.model, opt, step)


def rows() -> list[Config]:
    def as_run(config: Config) -> Config:
        config.controlled = False
        return config

    return [
        as_run(Config("base", "untraced", lambda w: contextlib.nullcontext())),
        as_run(Config("trace", "trace()", lambda w: torchscope.trace())),
        as_run(
            Config("check", "trace(eager_check=True)", lambda w: torchscope.trace(eager_check=True))
        ),
    ]


def arming_cost(w: Workload) -> tuple[float, float, int]:
    """(first traced step s, untraced step s, compiles while arming and disarming)."""
    counters = torch._dynamo.utils.counters["stats"]
    before = counters["unique_graphs"]
    t0 = time.perf_counter()
    w.step()
    plain = time.perf_counter() - t0
    with torchscope.trace():
        t0 = time.perf_counter()
        w.step()
        first = time.perf_counter() - t0
    w.step()
    return first, plain, counters["unique_graphs"] - before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--in-place", action="store_true", help="model.compile() instead")
    p.add_argument("--steps", type=int, default=5, help="timed steps per block (5)")
    p.add_argument("--repeats", type=int, default=10, help="rounds (10)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore", UserWarning)  # torch's note on global module hooks
    torch.set_num_threads(1)
    start = time.perf_counter()
    w = compiled_mlp(args.backend, args.in_place)
    for _ in range(3):
        w.step()  # compiled, untraced: as a job runs before anyone attaches
    compile_s = time.perf_counter() - start
    first, plain, compiles = arming_cost(w)
    configs = rows()
    results = measure([w], configs, args.steps, args.repeats, 2, record=None)
    gc.collect()
    print(f"## A compiled model traced: {w.description}\n")
    print(
        f"torch {torch.__version__}, 1 torch thread; {args.repeats} rounds x {args.steps} timed "
        f"steps per row, interleaved, wall clock, GC on; compile {compile_s:.1f} s, "
        f"total {time.perf_counter() - start:.0f} s.\n"
    )
    print("\n".join(table(w, configs, results, args.steps)))
    base = statistics.median(results[(w.name, "base")].times)
    print(
        f"\nfirst traced step after arming: {first * 1e3:.1f} ms against {plain * 1e3:.1f} ms "
        f"untraced ({first / plain:.2f}x; median untraced {base * 1e3:.2f} ms); Dynamo compiles "
        f"while arming and disarming: {compiles}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

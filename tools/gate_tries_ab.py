"""The drafting gate's tries side by side through the server: one request a try (the shipped gate: the one that
drafted least) against every running request at once (the rule before stop 50), with normal decoding, each
configuration at each concurrency level in turn (`specdecode bench serving`'s sweeps, in one process).

    python tools/gate_tries_ab.py --concurrency 4,16 --repeats 4 --name gate_tries_ab
"""

import argparse

from specdecode.drafters import Drafter, build_drafter
from specdecode.engine import continuous, drafting_gate
from specdecode.evaluation import serving_bench
from specdecode.models.target import Target

shipped_choose = drafting_gate.DraftingGate.choose
shipped_init = continuous.ContinuousEngine.__init__


def choose(gate: drafting_gate.DraftingGate, yields: list) -> list[bool]:
    """Every request drafts in a due try where the engine's drafter asks for it; otherwise the shipped choice."""
    if getattr(gate, "try_all", False) and yields and gate.exploration.due():
        gate.exploring = True
        return [True] * len(yields)
    return shipped_choose(gate, yields)


def engine_init(engine: continuous.ContinuousEngine, target, drafter, config, *args, **kwargs) -> None:
    shipped_init(engine, target, drafter, config, *args, **kwargs)
    if engine.gate is not None:
        engine.gate.try_all = getattr(drafter, "try_all", False)


def configurations(target: Target, spec: str) -> list:
    every, one = build_drafter(spec, target), build_drafter(spec, target)
    every.try_all = True
    return [
        ("none", Drafter(), "fixed", False),
        ("prefix-all", every, "prefix", True),
        ("prefix-one", one, "prefix", True),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="gate_tries_ab")
    args = parser.parse_args()
    drafting_gate.DraftingGate.choose = choose
    continuous.ContinuousEngine.__init__ = engine_init
    serving_bench._configurations = configurations
    serving_bench.run_serving_bench(
        Target.load("smollm2-135m"),
        args.drafter,
        [int(c) for c in args.concurrency.split(",")],
        requests=args.requests,
        max_tokens=args.max_tokens,
        time_limit_s=30,
        out=args.out,
        name=args.name,
        repeats=args.repeats,
    )


if __name__ == "__main__":
    main()

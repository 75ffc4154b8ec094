"""The drafting gate's tries side by side through the server: one request a try (`one`, the shipped gate: the one
that drafted least) against every running request at once (`all`, the rule before stop 50) or no tries at all
(`never`: not a product choice, its yield estimates would never change; it bounds what tries cost), with normal
decoding, each configuration at each concurrency level in turn (`specdecode bench serving`'s sweeps, one process).

    python tools/gate_tries_ab.py --concurrency 4,16 --repeats 4 --name gate_tries_ab
    python tools/gate_tries_ab.py --rules one,never --concurrency 16 --repeats 5 --name gate_no_tries_ab
"""

import argparse

from specdecode.drafters import Drafter, build_drafter
from specdecode.engine import continuous, drafting_gate
from specdecode.evaluation import serving_bench
from specdecode.models.target import Target

shipped_choose = drafting_gate.DraftingGate.choose
shipped_init = continuous.ContinuousEngine.__init__


def choose(gate: drafting_gate.DraftingGate, yields: list) -> list[bool]:
    """The shipped choice under the rule the engine's drafter names for a due try."""
    rule = getattr(gate, "tries", "one")
    if rule == "never":
        gate.exploration.without = 0  # never due
    elif rule == "all" and yields and gate.exploration.due():
        gate.exploring = True
        return [True] * len(yields)
    return shipped_choose(gate, yields)


def engine_init(engine: continuous.ContinuousEngine, target, drafter, config, *args, **kwargs) -> None:
    shipped_init(engine, target, drafter, config, *args, **kwargs)
    if engine.gate is not None:
        engine.gate.tries = getattr(drafter, "tries", "one")


def configurations_for(rules: list[str]):
    def configurations(target: Target, spec: str) -> list:
        configs = [("none", Drafter(), "fixed", False)]
        for rule in rules:
            drafter = build_drafter(spec, target)
            drafter.tries = rule
            configs.append((f"prefix-{rule}", drafter, "prefix", True))
        return configs

    return configurations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", default="default")
    parser.add_argument("--rules", default="all,one", help="comma-separated: one, all, never")
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="gate_tries_ab")
    args = parser.parse_args()
    drafting_gate.DraftingGate.choose = choose
    continuous.ContinuousEngine.__init__ = engine_init
    serving_bench._configurations = configurations_for(args.rules.split(","))
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

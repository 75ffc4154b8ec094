"""`specdecode bench sim-check`: does decoding reach the accepted length that training simulates?

Training logs a simulated accepted length: blocks open at random supervised positions and their outcomes
(greedy: does the draft's argmax match the target's; T = 1: the survival probability 1 - TV) are averaged
over positions. Decoding does not visit positions uniformly: a round starts where the previous one ended, so
where drafts fail it spends a round on every token and where they succeed it skips ahead. The uniform mean
therefore overstates what decoding sees (an arithmetic mean where decoding takes a harmonic-like one).

This check decodes prompts with a block drafter, then runs the training's simulation over the very text
that was decoded with a block at every position, and reports three accepted lengths: decoded; simulated as
decoding visits positions (expected rounds by dynamic programming over each position's survival
probabilities: at T = 0 exactly the greedy walk); simulated uniformly (what training logs). Decoded and
visited agree when training and decoding compute the same drafts; uniform / visited is the metric's bias.
At T = 1 the simulation's survival is token-by-token verification's; decoding keeps sampled chains by block
verification (`verify.py`), which keeps at least as many drafts, so decoded may run a few percent above it.
"""

from dataclasses import dataclass

import torch
from tqdm import tqdm

from specdecode.drafters import build_drafter
from specdecode.drafters.checkpoint import load_model
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.calibration_report import unseen_prompts
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams
from specdecode.training.block_losses import training_losses
from specdecode.training.data import Example
from specdecode.training.features import OnlineFeatures


def expected_rounds(survival: torch.Tensor) -> float:
    """Expected rounds to decode the n tokens after n successive anchors, when a round from anchor i keeps
    draft k with probability survival[i, k] given drafts before it survived (n, G), and commits the kept
    drafts plus the target's own token."""
    n, g = survival.shape
    at_least = torch.cat([torch.ones(n, 1, dtype=torch.float64), survival.double().cumprod(-1)], dim=1)
    exactly = (at_least - torch.cat([at_least[:, 1:], torch.zeros(n, 1, dtype=torch.float64)], dim=1)).tolist()
    rounds = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        rounds[i] = 1 + sum(p * rounds[min(i + 1 + kept, n)] for kept, p in enumerate(exactly[i]))
    return rounds[0]


def uniform_accepted_length(survival: torch.Tensor) -> float:
    """The training metric: 1 + the expected drafts kept, averaged over anchors."""
    return float(1 + survival.double().cumprod(-1).sum(-1).mean())


def simulated_survival(
    model: torch.nn.Module, features: OnlineFeatures, prompt: list[int], output: list[int], temperature: float
) -> torch.Tensor:
    """(len(output), G): each answer position's survival per draft, from the training losses with a block at
    every position of the decoded text."""
    ids = torch.tensor(prompt + output)
    example = Example("decoded", ids, torch.arange(len(ids)) >= len(prompt))
    with torch.no_grad():
        out = training_losses(
            model, features.batch([example]), torch.Generator().manual_seed(0), len(ids), outcomes=True
        )
    valid, greedy, alpha = (x[0] for x in out["outcomes"])
    opened = valid[:, 0]
    survival = (greedy.double() if temperature == 0 else alpha.double()) * valid
    return survival[opened]


@dataclass
class PromptCheck:
    tokens: int  # answer tokens decoded (and simulated)
    rounds: int  # rounds decoding took
    visited_rounds: float  # rounds the simulation expects, as decoding visits positions
    survival: torch.Tensor  # (tokens, G)


def check_prompt(
    decoder: SpeculativeDecoder,
    model: torch.nn.Module,
    features: OnlineFeatures,
    prompt: list[int],
    params: SamplingParams,
    max_new_tokens: int,
    seed: int,
) -> PromptCheck:
    """Decode `prompt` with `decoder` (whose drafter is `model`, loaded for inference), then simulate on its
    output."""
    completion = decoder.generate(prompt, params, max_new_tokens, seed=seed)[0]
    survival = simulated_survival(model, features, prompt, completion.token_ids, params.temperature)
    return PromptCheck(len(survival), len(completion.stats.accepted_lengths), expected_rounds(survival), survival)


def _prompt_sets(target: Target, data: str | None, benchmarks: list[str], limit: int) -> dict[str, list[str]]:
    sets = {}
    if data is not None:
        sets["unseen mix prompts"] = [m[0]["content"] for m in unseen_prompts(target, data, limit)]
    for name in benchmarks:
        sets[name] = [item.turns[0] for item in load_benchmark(name, limit)]
    if not sets:
        raise SpecDecodeError("give --data (prompts of the training mix it lacks) or --benchmarks, or both")
    return sets


def run_sim_check(
    target: Target,
    drafter: str,
    data: str | None,
    benchmarks: list[str],
    limit: int,
    temperatures: list[float],
    max_new_tokens: int,
    out_dir: str,
    name: str = "sim_check",
) -> list[dict]:
    if any(t not in (0.0, 1.0) for t in temperatures):
        raise SpecDecodeError("the training simulation covers T = 0 (greedy) and T = 1 only")
    kind, model = load_model(drafter, target)
    if kind not in ("dspark", "dflash"):
        raise SpecDecodeError(f"{drafter} is a {kind} drafter; the check covers the block drafters (dspark, dflash)")
    model.eval()
    decoder = SpeculativeDecoder(target, build_drafter(drafter, target), draft_length=model.config.draft_length)
    features = OnlineFeatures(target, list(model.config.target_layer_ids))
    sets = _prompt_sets(target, data, benchmarks, limit)
    rows = []
    bar = tqdm(total=sum(len(p) for p in sets.values()) * len(temperatures), desc="sim-check", unit="prompt")
    for set_name, prompts in sets.items():
        for temperature in temperatures:
            params = SamplingParams(temperature=temperature)
            checks = []
            for i, text in enumerate(prompts):
                prompt = target.encode_chat([{"role": "user", "content": text}])
                checks.append(check_prompt(decoder, model, features, prompt, params, max_new_tokens, seed=i))
                bar.update()
            tokens = sum(c.tokens for c in checks)
            decoded, visited = tokens / sum(c.rounds for c in checks), tokens / sum(c.visited_rounds for c in checks)
            rows.append(
                {
                    "prompts": set_name,
                    "temperature": temperature,
                    "count": len(prompts),
                    "tokens": tokens,
                    "decoded": round(decoded, 3),
                    "simulated_as_visited": round(visited, 3),
                    "simulated_uniform": round(uniform_accepted_length(torch.cat([c.survival for c in checks])), 3),
                }
            )
    bar.close()
    write_results(name, out_dir, target.name, rows, _table(rows), drafter=drafter, max_new_tokens=max_new_tokens)
    return rows


def _table(rows: list[dict]) -> str:
    lines = [
        "Mean accepted length per round (target's token included), pooled over the prompts' tokens: decoded, and "
        "the training's simulation on the same text weighted as decoding visits positions and uniformly (what "
        "training logs).",
        "",
        "| prompts | T | prompts decoded | tokens | decoded | simulated, as visited | simulated, uniform | uniform / "
        "visited |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        bias = r["simulated_uniform"] / r["simulated_as_visited"]
        lines.append(
            f"| {r['prompts']} | {r['temperature']:g} | {r['count']} | {r['tokens']} | {r['decoded']:.2f} | "
            f"{r['simulated_as_visited']:.2f} | {r['simulated_uniform']:.2f} | {bias:.2f} |"
        )
    return "\n".join(lines) + "\n"

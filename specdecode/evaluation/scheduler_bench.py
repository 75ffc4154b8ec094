"""`specdecode bench scheduler`: accepted tokens per second of a batch of R requests, prefix scheduler
(Algorithm 1) against every fixed verify length and a static threshold, on this machine's cost table.

The rounds are real: DSpark's calibrated confidences and the number of drafts the target accepted, from
decoding unseen prompts (`specdecode calibrate` records them). A batch step draws R recorded rounds; a
policy picks l_r per request; the step yields sum_r (1 + min(accepted_r, l_r)) tokens (a draft's
acceptance does not depend on later drafts) and costs one batched drafting call for the R requests (as
the continuous engine drafts) plus one verify pass over B = sum_r (1 + l_r) tokens, both measured here.
Normal decoding (no drafts) is listed too; it skips the drafting call.
"""

import copy
import random
import statistics
import time
from collections.abc import Callable

import torch

from specdecode.drafters.base import Drafter, TargetFeatures
from specdecode.drafters.checkpoint import load_drafter
from specdecode.drafters.dspark import calibrated_confidence
from specdecode.engine.scheduler import prefix_survival, schedule_prefix, schedule_threshold
from specdecode.evaluation.calibration_report import record_rounds, unseen_prompts
from specdecode.evaluation.results import write_results
from specdecode.machine import measure_quietly
from specdecode.models.sps import StepCostTable, profile_target
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams
from specdecode.training.calibration import Rounds

NORMAL = "normal decoding (no drafts, no drafting)"
PROFILE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def measure_draft_seconds(
    target: Target, drafter: Drafter, prompts: list[list[dict]], params: SamplingParams, requests: tuple[int, ...]
) -> dict[int, float]:
    """Seconds of one drafting call for R requests as the continuous engine makes it (`propose_batch`, each
    request at its own prompt), median of 5 quiet calls, for every R in `requests`."""
    target.set_capture_layers(drafter.target_layer_ids)
    states = []
    for i in range(max(requests)):
        ids = target.encode_chat(prompts[i % len(prompts)])
        out = target.features(torch.tensor(ids[:-1]))
        state = copy.copy(drafter)
        state.begin(ids, params, torch.Generator().manual_seed(i), TargetFeatures(out.layer_hidden, out.last_hidden))
        states.append((state, ids))
    gamma = drafter.config.draft_length

    def once(r: int) -> float:
        t0 = time.perf_counter()
        drafter.propose_batch([d for d, _ in states[:r]], [ids for _, ids in states[:r]], [gamma] * r)
        return time.perf_counter() - t0

    seconds = {}
    for r in requests:
        once(r)  # warm-up
        seconds[r], _ = measure_quietly(lambda r=r: statistics.median(once(r) for _ in range(5)))
    return seconds


def replay(
    rounds: Rounds,
    confidences: torch.Tensor,
    choose: Callable[[list[torch.Tensor], list[torch.Tensor]], list[int]],
    num_requests: int,
    costs: StepCostTable,
    draft_s: float,
    trials: int,
    seed: int = 0,
    drafting: bool = True,
) -> dict:
    """Mean tokens per step, mean verify tokens B and tokens/s of the policy `choose(survivals, confidences)`
    over `trials` batches of `num_requests` recorded rounds (calibrated `confidences` (N, gamma), 0 past a
    proposal's end). Every step pays `draft_s`, one batched drafting call for the R requests (the confidences
    a policy reads come from it), except with `drafting=False`: normal decoding."""
    rng = random.Random(seed)
    survivals = prefix_survival(confidences)
    tokens = seconds = verify_tokens = 0.0
    for _ in range(trials):
        rows = [rng.randrange(len(rounds.accepted)) for _ in range(num_requests)]
        lengths = choose([survivals[r] for r in rows], [confidences[r] for r in rows])
        b = sum(1 + n for n in lengths)
        tokens += sum(1 + min(int(rounds.accepted[r]), n) for r, n in zip(rows, lengths, strict=True))
        seconds += costs.step_seconds(b) + (draft_s if drafting else 0.0)
        verify_tokens += b
    return {
        "tokens_per_step": tokens / trials,
        "verify_tokens": verify_tokens / trials,
        "tokens_per_s": tokens / seconds,
    }


def run_scheduler_bench(
    target: Target,
    drafter_path: str,
    data_dir: str,
    out_dir: str = "docs/results",
    requests: tuple[int, ...] = (1, 4, 8, 16),
    num_prompts: int = 40,
    temperature: float = 1.0,
    max_new_tokens: int = 160,
    threshold: float = 0.5,
    trials: int = 2000,
) -> dict:
    params = SamplingParams(temperature=temperature)
    prompts = unseen_prompts(target, data_dir, num_prompts)
    rounds = record_rounds(target, drafter_path, prompts, params, max_new_tokens)
    drafter = load_drafter(drafter_path, target)
    gamma = drafter.config.draft_length
    temperatures = list(drafter.config.calibration_temperatures) or [1.0] * gamma
    biases = list(drafter.config.calibration_biases) or [0.0] * gamma
    costs = profile_target(target, sizes=PROFILE_SIZES)
    draft_s = measure_draft_seconds(target, drafter, prompts, params, requests)

    confidences = torch.nan_to_num(calibrated_confidence(rounds.logits, temperatures, biases), nan=0.0)
    runs = []
    for r in requests:

        def step_rate(b: int, r: int = r) -> float:  # a step drafts for all R requests, then verifies B tokens
            return 1.0 / (costs.step_seconds(b) + draft_s[r])

        policies = {
            "scheduler (Algorithm 1)": lambda s, c, rate=step_rate: schedule_prefix(s, rate),
            f"threshold {threshold}": lambda s, c: schedule_threshold(c, threshold),
        }
        policies.update({f"fixed {n}": lambda s, c, n=n: [n] * len(s) for n in range(1, gamma + 1)})
        policies[NORMAL] = lambda s, c: [0] * len(s)
        for name, choose in policies.items():
            result = replay(rounds, confidences, choose, r, costs, draft_s[r], trials, drafting=name != NORMAL)
            runs.append({"requests": r, "policy": name, **result})
    for r in requests:
        best_fixed = max(x["tokens_per_s"] for x in runs if x["requests"] == r and x["policy"].startswith("fixed "))
        for x in runs:
            if x["requests"] == r:
                x["relative_to_best_fixed"] = x["tokens_per_s"] / best_fixed
    table = _table(runs, costs, draft_s, len(rounds.accepted))
    write_results(
        "scheduler",
        out_dir,
        target.name,
        runs,
        table,
        drafter=drafter_path,
        draft_seconds_by_requests=draft_s,
        cost_table=costs.to_dict(),
        calibration_temperatures=temperatures,
        calibration_biases=biases,
        recorded_rounds=len(rounds.accepted),
        decoding_temperature=temperature,
    )
    return {"runs": runs}


def _table(runs: list[dict], costs: StepCostTable, draft_s: dict[int, float], num_rounds: int) -> str:
    profile = ", ".join(f"{t}: {1000 * s:.1f}" for t, s in zip(costs.tokens, costs.seconds, strict=True))
    lines = [
        f"Replay of {num_rounds} recorded DSpark rounds. Verify pass ms by tokens B (measured here): {profile}. "
        "Drafting (one batched call for R requests), ms by R: "
        + ", ".join(f"{r}: {1000 * t:.1f}" for r, t in draft_s.items())
        + ".",
        "",
        "| requests R | policy | tokens / step | verify tokens B | accepted tokens/s | vs best fixed length >= 1 |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for x in runs:
        lines.append(
            f"| {x['requests']} | {x['policy']} | {x['tokens_per_step']:.2f} | {x['verify_tokens']:.1f} | "
            f"{x['tokens_per_s']:.1f} | {x['relative_to_best_fixed']:.2f}x |"
        )
    return "\n".join(lines)

"""`specdecode demo`: normal and speculative decoding side by side, with the temperature-0 check visible."""

import sys

from specdecode.drafters import Drafter, build_drafter
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.engine.scheduler import AUTO, resolve_scheduler
from specdecode.evaluation.baselines import PROMPT_GROUPS
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams

# two answers that copy their input (where drafting pays off most) and one fresh answer (where it pays least)
DEMO_PROMPTS = (*PROMPT_GROUPS["repeat"][:2], PROMPT_GROUPS["chat"][1])


def run_demo(target: Target, drafter_spec: str, max_new_tokens: int) -> None:
    drafter = build_drafter(drafter_spec, target)
    normal = SpeculativeDecoder(target, Drafter(), draft_length=0)
    scheduler = resolve_scheduler(AUTO, drafter)  # DSpark verifies only the drafts that pay
    speculative = SpeculativeDecoder(target, drafter, draft_length=8, scheduler=scheduler)
    params = SamplingParams(temperature=0.0)
    rows = []
    shipped = shipped_drafter(target.name) if drafter_spec == "default" else None
    if shipped:
        drafter_spec = f"{drafter.name} (suffix decoding + the drafter shipped with specdecode)"
    else:
        drafter_spec = drafter.name
    print(f"target {target.name} on {target.device}, drafter {drafter_spec}, {scheduler} scheduler, temperature 0\n")
    for n, prompt in enumerate(DEMO_PROMPTS, 1):
        ids = target.encode(prompt)
        print(f"=== prompt {n}: {prompt.splitlines()[0][:90]}")
        base = normal.generate(ids, params, max_new_tokens=max_new_tokens)[0]
        print("--- speculative, streamed as rounds are accepted:")
        spec = speculative.generate(
            ids, params, max_new_tokens=max_new_tokens, on_text=lambda _i, t: print(t, end="", flush=True)
        )[0]
        same = spec.token_ids == base.token_ids
        print(
            f"\n--- normal {base.stats.tokens_per_s:.1f} tok/s | speculative {spec.stats.tokens_per_s:.1f} tok/s"
            f" | mean accepted length {spec.stats.mean_accepted_length:.2f}"
            f" | identical to normal decoding: {'yes' if same else 'NO'}"
        )
        if spec.stats.proposers:
            won = ", ".join(f"{name} {rounds}" for name, rounds in sorted(spec.stats.proposers.items()))
            print(f"--- rounds won by each proposer: {won} (of {len(spec.stats.accepted_lengths)})")
        print()
        rows.append((n, base.stats, spec.stats, same))
    print("| prompt | normal tok/s | speculative tok/s | speedup | mean accepted length | identical |")
    print("|---|---|---|---|---|---|")
    for n, b, s, same in rows:
        speedup = s.tokens_per_s / b.tokens_per_s if b.tokens_per_s else float("nan")
        print(
            f"| {n} | {b.tokens_per_s:.1f} | {s.tokens_per_s:.1f} | {speedup:.2f}x | "
            f"{s.mean_accepted_length:.2f} | {'yes' if same else 'NO'} |"
        )
    if not all(r[3] for r in rows):
        print("WARNING: a speculative output differed from normal greedy decoding", file=sys.stderr)

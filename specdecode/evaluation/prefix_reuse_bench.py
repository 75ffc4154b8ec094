"""`specdecode bench prefix-reuse`: what prefix reuse saves a chat's next turn, with it and without.

Two-turn conversations (MT-Bench's) go through the continuous engine one turn at a time, as a chat client sends
them: the second turn's prompt repeats the first turn and its answer. With prefix reuse (`engine/batch.py`) the
first answer's slot still holds all of that, so the second prefill covers only the new user turn; without it the
whole conversation is prefilled again. Each setting runs the same conversations, alternating `repeats` times;
the table gives medians of the time to first token of each turn, the prompt tokens and those reused, and whether
both settings wrote the same answers (greedy).
"""

import statistics

from specdecode.drafters.base import Drafter
from specdecode.engine.continuous import ContinuousEngine, EngineConfig
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target
from specdecode.sampling import SamplingParams


def run_prefix_reuse(
    target: Target,
    out_dir: str,
    conversations: int = 10,
    max_tokens: int = 128,
    repeats: int = 2,
    chats: list[list[str]] | None = None,
    name: str = "prefix_reuse",
) -> dict:
    """`chats` (user turns of each conversation) default to MT-Bench's first `conversations` two-turn ones."""
    if chats is None:
        chats = [item.turns for item in load_benchmark("mt-bench") if len(item.turns) >= 2][:conversations]
    turns: dict[bool, list[list[dict]]] = {True: [], False: []}  # reuse -> one list of turn records per repeat
    foreign = []
    for _ in range(repeats):
        for reuse in (True, False):
            with ForeignLoad() as load:
                turns[reuse].append(_converse(target, chats, max_tokens, reuse))
            foreign.append(load.cores)
    same = [turn["tokens"] for turn in turns[True][0]] == [turn["tokens"] for turn in turns[False][0]]
    runs = []
    for reuse, repeats_done in turns.items():
        records = [turn for done in repeats_done for turn in done]
        for index in sorted({turn["turn"] for turn in records}):
            mine = [turn for turn in records if turn["turn"] == index]
            runs.append(
                {
                    "prefix_caching": reuse,
                    "turn": index + 1,
                    "conversations": len(mine) // len(repeats_done),
                    "prompt_tokens": statistics.median(turn["prompt"] for turn in mine),
                    "reused_tokens": statistics.median(turn["reused"] for turn in mine),
                    "ttft_ms": round(statistics.median(turn["ttft_s"] for turn in mine) * 1e3, 2),
                    "same_answers": same,
                }
            )
    table = _table(runs)
    write_results(name, out_dir, target.name, runs, table, foreign_load_cores_max=round(max(foreign), 3))
    print(table)
    return {"runs": runs}


def _converse(target: Target, chats: list[list[str]], max_tokens: int, reuse: bool) -> list[dict]:
    """Every conversation, turn after turn, greedy through one engine; a record per turn."""
    config = EngineConfig(4, min(2048, target.max_context), 0, prefix_caching=reuse)
    engine = ContinuousEngine(target, Drafter(), config)
    records: list[dict] = []

    def talk() -> None:
        for user_turns in chats:
            messages: list[dict] = []
            for index, text in enumerate(user_turns):
                messages.append({"role": "user", "content": text})
                prompt = target.encode_chat(messages)
                room = min(max_tokens, engine.config.max_len - len(prompt))
                if room < 1:
                    break
                before = engine.metrics.prefix_cached_tokens
                handle = engine.submit(prompt, SamplingParams(), room)
                done = handle.result()
                messages.append({"role": "assistant", "content": done.text.strip()})
                reused = engine.metrics.prefix_cached_tokens - before
                record = {"turn": index, "prompt": len(prompt), "reused": reused, "tokens": done.token_ids}
                records.append({**record, "ttft_s": handle.time_to_first_token_s})

    engine.drive(talk)
    return records


def _table(runs: list[dict]) -> str:
    lines = [
        "| prefix reuse | turn | conversations | prompt tokens | reused | TTFT ms | vs whole prefill |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    whole = {r["turn"]: r["ttft_ms"] for r in runs if not r["prefix_caching"]}
    for r in runs:
        ratio = f"{r['ttft_ms'] / whole[r['turn']]:.2f}x" if r["prefix_caching"] and whole.get(r["turn"]) else ""
        lines.append(
            f"| {'on' if r['prefix_caching'] else 'off'} | {r['turn']} | {r['conversations']} | "
            f"{r['prompt_tokens']:.0f} | {r['reused_tokens']:.0f} | {r['ttft_ms']:.1f} | {ratio} |"
        )
    same = all(r["same_answers"] for r in runs)
    return (
        "Two-turn conversations through the continuous engine, one turn at a time (greedy, normal decoding): "
        "medians over conversations and repeats; with and without prefix reuse alternating. "
        f"Answers {'identical' if same else 'DIFFERENT'} in both settings.\n\n" + "\n".join(lines)
    )

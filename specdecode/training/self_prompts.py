"""`specdecode data self-prompts`: the target writes the user turns too (Magpie-style self-instruction).

An instruction-tuned model fed only its chat template's opening of a user turn continues with a user
request drawn from the distribution it was tuned on (Magpie, Xu et al. 2024): open questions, writing
tasks, coding and math requests, the shape of MT-Bench and of real chat, with far more variety than
templates or human small talk give. No data set is needed, so the prompt pool is as large as one wants.

Every attempt samples from its own seed (seed, attempt), so the samples depend neither on batching nor on
restarts. Raw samples are appended to `samples.jsonl` and fsynced as they finish (a restart resumes the
missing attempts); `prompts.jsonl` is then rewritten from them: finished (not cut at the length limit),
at least a few words, de-duplicated, and disjoint from every evaluation set by the 8-gram check.
"""

import json
import queue
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specdecode.drafters.base import Drafter
from specdecode.engine.continuous import ContinuousEngine, EngineConfig
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.paths import append_synced, resume_jsonl
from specdecode.sampling import SamplingParams
from specdecode.training.prompts import disjoint_from_evaluation_sets
from specdecode.training.regenerate import check_same_settings, sampling_settings
from specdecode.training.trainer import derived_seed

_SENTINEL = "\u2063SPECDECODE_USER_TURN\u2063"
MIN_WORDS = 4


@dataclass(frozen=True)
class SelfPromptSettings:
    """Magpie samples at temperature 1 so the pool spans the model's own distribution of requests."""

    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    max_new_tokens: int = 160
    batch_size: int = 64
    seed: int = 0


def user_turn_opening(target: Target) -> list[int]:
    """Token ids of the chat template up to where a user's words would start (its system prompt included)."""
    tokenizer = target.tokenizer
    if not tokenizer.chat_template:
        raise SpecDecodeError(f"{target.name} has no chat template; self-prompts need an instruction-tuned target")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False)
    if _SENTINEL not in text:
        raise SpecDecodeError(f"{target.name}'s chat template does not show the user's message; cannot self-prompt")
    return tokenizer.encode(text[: text.index(_SENTINEL)], add_special_tokens=False)


def kept_prompts(samples: list[dict]) -> list[dict]:
    """Usable user turns in attempt order: finished, long enough, first of their text, disjoint from eval sets."""
    seen: set[str] = set()
    kept = []
    for sample in sorted(samples, key=lambda s: s["attempt"]):
        text = sample["text"].strip()
        key = " ".join(text.lower().split())
        if sample["finish_reason"] != "stop" or len(text.split()) < MIN_WORDS or key in seen:
            continue
        seen.add(key)
        if disjoint_from_evaluation_sets((text,)):
            kept.append({"id": f"self-{sample['attempt']}", "source": "self", "turns": [text]})
    return kept


def write_self_prompts(target: Target, attempts: int, out_dir: str, settings: SelfPromptSettings) -> list[dict]:
    """Sample `attempts` user turns (resuming those already in `out_dir`) and write the kept ones."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_same_settings(out, sampling_settings(settings))
    samples_path = out / "samples.jsonl"
    samples = {r["attempt"]: r for r in resume_jsonl(samples_path)}
    todo = [i for i in range(attempts) if i not in samples]
    opening = user_turn_opening(target)
    params = SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)
    config = EngineConfig(max_batch=settings.batch_size, max_len=len(opening) + settings.max_new_tokens, draft_length=0)
    engine = ContinuousEngine(target, Drafter(), config)
    done: queue.Queue = queue.Queue()
    bar = tqdm(total=attempts, initial=attempts - len(todo), desc="self-prompts", unit="prompt")
    new_tokens, start = 0, time.perf_counter()

    def collect() -> None:
        """Queue every attempt and write each sample as it ends (beside the engine loop)."""
        nonlocal new_tokens
        with open(samples_path, "a", encoding="utf-8") as file:
            for attempt in todo:
                engine.submit(
                    opening,
                    params,
                    settings.max_new_tokens,
                    seed=derived_seed(settings.seed, attempt),
                    on_done=lambda outcome, attempt=attempt: done.put((attempt, outcome)),
                )
            for _ in todo:
                attempt, outcome = done.get()
                if isinstance(outcome, Exception):
                    raise outcome
                record = {"attempt": attempt, "text": outcome.text, "finish_reason": outcome.finish_reason}
                append_synced(file, record)
                samples[attempt] = record
                new_tokens += len(outcome.token_ids)
                bar.update(1)
                bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.1f}")

    try:
        engine.drive(collect)  # the engine steps on this thread, the model's (engine/continuous.py)
    finally:
        bar.close()
    kept = kept_prompts([s for i, s in samples.items() if i < attempts])
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as file:
        file.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in kept)
    return kept

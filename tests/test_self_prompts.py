"""Self-written prompts: the user-turn opening, what is kept, seeded samples that resume, and regeneration's use."""

import json

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.training.prompts import build_prompt_mix
from specdecode.training.self_prompts import SelfPromptSettings, kept_prompts, user_turn_opening, write_self_prompts

SETTINGS = SelfPromptSettings(max_new_tokens=64, batch_size=3)


def test_opening_ends_where_the_user_starts_writing(smollm2):
    opening = smollm2.tokenizer.decode(user_turn_opening(smollm2))
    assert opening.endswith("<|im_start|>user\n")
    assert "<|im_start|>system\n" in opening  # the template's own system prompt stays: the model was tuned with it


def test_kept_prompts_drop_cut_short_duplicate_and_evaluation_turns():
    gsm8k_question = load_benchmark("gsm8k", limit=1)[0].turns[0]
    samples = [
        {"attempt": 4, "text": "How do I sort a list of tuples by their second item?", "finish_reason": "stop"},
        {"attempt": 1, "text": "Write a short poem about the sea at night.", "finish_reason": "stop"},
        {"attempt": 2, "text": "Write a  short poem about the SEA at night. ", "finish_reason": "stop"},
        {"attempt": 3, "text": "Explain how a rainbow forms in the sky and why", "finish_reason": "length"},
        {"attempt": 5, "text": "Hi there!", "finish_reason": "stop"},
        {"attempt": 6, "text": gsm8k_question, "finish_reason": "stop"},
    ]
    kept = kept_prompts(samples)
    assert [k["id"] for k in kept] == ["self-1", "self-4"]
    assert kept[0] == {"id": "self-1", "source": "self", "turns": ["Write a short poem about the sea at night."]}


def test_samples_are_seeded_per_attempt_and_resume(smollm2, tmp_path):
    whole = write_self_prompts(smollm2, 5, str(tmp_path / "whole"), SETTINGS)
    write_self_prompts(smollm2, 3, str(tmp_path / "resumed"), SETTINGS)
    resumed = write_self_prompts(smollm2, 5, str(tmp_path / "resumed"), SelfPromptSettings(max_new_tokens=64))
    samples = {
        name: [json.loads(line) for line in (tmp_path / name / "samples.jsonl").read_text().splitlines()]
        for name in ("whole", "resumed")
    }
    assert [s["attempt"] for s in samples["resumed"]].count(0) == 1  # finished attempts are not redone
    by_attempt = {name: sorted(records, key=lambda s: s["attempt"]) for name, records in samples.items()}
    assert by_attempt["resumed"] == by_attempt["whole"]  # neither batch size nor a restart changes a sample
    assert resumed == whole and len({k["turns"][0] for k in whole}) == len(whole) >= 1
    with pytest.raises(SpecDecodeError, match="other settings"):
        write_self_prompts(smollm2, 5, str(tmp_path / "whole"), SelfPromptSettings(temperature=0.5))


def test_regeneration_reads_them_under_their_own_ids(tmp_path):
    path = tmp_path / "prompts.jsonl"
    turns = ["Name three rivers in Africa."]
    path.write_text(json.dumps({"id": "self-7", "source": "self", "turns": turns}) + "\n")
    [conversation] = build_prompt_mix(1, extra_jsonl=str(path))
    assert (conversation.id, conversation.source, conversation.turns) == ("self-7", "self", turns)

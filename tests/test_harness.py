"""The evaluation harness: results in the shared shape, identical outputs at T=0, and resume."""

import json
from functools import partial

import pytest

from specdecode.evaluation.harness import _pooled_acceptance, run_eval
from tests.conftest import tiny_target


def test_eval_writes_results_and_resumes(tmp_path):
    target = tiny_target(vocab_size=24)
    bench = tmp_path / "prompts.jsonl"
    bench.write_text(
        json.dumps({"id": "a", "turns": ["t3 t4 t5 t3 t4 t5 t3 t4"]})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "t6 t7 t6 t7 t6"}]})
        + "\n"
    )
    target.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    out = tmp_path / "results"
    evaluate = partial(
        run_eval,
        target,
        ["ngram"],
        [str(bench)],
        str(out),
        name="t",
        limit=None,
        temperatures=(0.0, 1.0),
        draft_length=3,
        max_new_tokens=12,
    )
    evaluate()
    doc = json.loads((out / "t.json").read_text())
    assert doc["name"] == "t" and doc["command"] and doc["machine"]["cores"]
    rows = {(r["drafter"], r["temperature"]): r for r in doc["runs"]}
    assert set(rows) == {("none", 0.0), ("ngram", 0.0), ("none", 1.0), ("ngram", 1.0)}
    assert rows[("ngram", 0.0)]["identical_to_normal_at_t0"] is True
    assert rows[("none", 0.0)]["mean_accepted_length"] == 1.0
    assert rows[("ngram", 0.0)]["mean_accepted_length"] > 1.0  # the repeating prompts give lookups
    cells = (out / "t.cells.jsonl").read_text()
    evaluate()
    assert (out / "t.cells.jsonl").read_text() == cells  # nothing was generated twice
    assert (out / "t_acceptance.png").stat().st_size > 0
    # a kill mid-line: the torn cell is measured again, on a line of its own (it landed on the torn one, lost)
    lines = cells.splitlines()
    (out / "t.cells.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:30])
    evaluate()
    again = (out / "t.cells.jsonl").read_text().splitlines()
    assert again[:-1] == lines[:-1] and json.loads(again[-1])["drafter"] == json.loads(lines[-1])["drafter"]
    # other settings are another run: none of its cells stand beside this one's, normal decoding included
    evaluate(max_new_tokens=10)
    fresh = (out / "t.cells.jsonl").read_text().splitlines()[len(cells.splitlines()) :]
    assert len(fresh) == len(cells.splitlines()) and {json.loads(c)["drafter"] for c in fresh} == {"none", "ngram"}


def test_acceptance_curves_pool_benchmarks_by_rounds_reaching_each_position():
    runs = [
        {"position_attempts": [100, 30, 5], "position_accepts": [30, 6, 5]},
        {"position_attempts": [300, 60], "position_accepts": [30, 30]},
    ]
    # position 1: (30 + 30) / 400; position 2: (6 + 30) / 90; position 3: 5 rounds, too few to plot
    assert _pooled_acceptance(runs) == pytest.approx([0.15, 0.4])

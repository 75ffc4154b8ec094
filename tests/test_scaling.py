"""The scaling bench reads what finished training runs learned from how much data."""

import json

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.evaluation.scaling import run_scaling


def fake_run(folder, conversations: int, tokens: int, greedy: float, t1: float) -> str:
    (folder / "drafter").mkdir(parents=True)
    recipe = {"train_conversations": conversations, "train_supervised_tokens": tokens, "held_out_conversations": 9}
    (folder / "drafter" / "config.json").write_text(json.dumps({"kind": "dspark", "recipe": recipe}))
    lines = [
        {"step": 10, "elapsed": 30.0, "loss": 2.0},
        {
            "step": 10,
            "eval": True,
            "simulated_accept_length_greedy": 1.1,
            "simulated_accept_length": 1.0,
            "acc_pos_1": 0.1,
        },
        {"step": 20, "elapsed": 60.0, "loss": 1.5},
        {
            "step": 20,
            "eval": True,
            "simulated_accept_length_greedy": greedy,
            "simulated_accept_length": t1,
            "acc_pos_1": 0.4,
        },
    ]
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return str(folder)


def test_scaling_table_orders_runs_by_tokens_and_takes_the_last_evaluation(tmp_path):
    big = fake_run(tmp_path / "big", 2000, 300_000, 1.9, 1.7)
    small = fake_run(tmp_path / "small", 500, 70_000, 1.5, 1.4)
    result = run_scaling([big, small], str(tmp_path / "out"), "smollm2-135m")
    assert [r["train_supervised_tokens"] for r in result["runs"]] == [70_000, 300_000]
    assert [r["accepted_length_t0"] for r in result["runs"]] == [1.5, 1.9]
    assert result["runs"][1]["steps"] == 20 and result["runs"][1]["training_s"] == 60.0
    doc = json.loads((tmp_path / "out" / "dspark_scaling.json").read_text())
    assert doc["name"] == "dspark_scaling" and len(doc["runs"]) == 2
    assert (tmp_path / "out" / "dspark_scaling.png").stat().st_size > 0
    (tmp_path / "unfinished").mkdir()
    with pytest.raises(SpecDecodeError, match="not a finished training run"):
        run_scaling([str(tmp_path / "unfinished")], str(tmp_path / "out"), "smollm2-135m")


def test_rows_of_an_earlier_results_file_stay_in_the_curve(tmp_path):
    first = fake_run(tmp_path / "first", 500, 70_000, 1.5, 1.4)
    run_scaling([first], str(tmp_path / "old"), "smollm2-135m")
    second = fake_run(tmp_path / "second", 2000, 300_000, 1.9, 1.7)
    earlier = str(tmp_path / "old" / "dspark_scaling.json")
    result = run_scaling([second], str(tmp_path / "new"), "smollm2-135m", keep=earlier)
    assert [r["train_supervised_tokens"] for r in result["runs"]] == [70_000, 300_000]
    assert "measured_at" in result["runs"][0] and "measured_at" not in result["runs"][1]
    assert "500* |" in (tmp_path / "new" / "dspark_scaling.md").read_text()
    again = run_scaling([first, second], str(tmp_path / "again"), "smollm2-135m", keep=earlier)
    assert len(again["runs"]) == 2  # a run summarized again replaces its old row
    with pytest.raises(SpecDecodeError, match="not a dspark_scaling results file"):
        run_scaling([second], str(tmp_path / "x"), "smollm2-135m", keep=str(tmp_path / "missing.json"))

"""The Table 1 replica's table: our rows as ratios to EAGLE-3, beside the paper's."""

from specdecode.evaluation.table1 import BENCHMARKS, PAPER_QWEN3_8B, _table


def test_table_puts_ratios_to_eagle3_beside_the_paper():
    lengths = {"none": 1.0, "eagle3": 2.0, "eagle3 tree": 2.5, "dflash": 2.2, "dspark": 3.0}
    runs = [
        {"temperature": t, "drafter": d, "benchmark": b, "mean_accepted_length": v * (1 if t == 1.0 else 1.1)}
        for t in (1.0, 0.0)
        for d, v in lengths.items()
        for b in BENCHMARKS
    ]
    table = _table(runs)
    assert "| ours (smollm2-135m) | 1 | dspark | 3.00 (1.50) |" in table
    assert "| ours (smollm2-135m) | 1 | eagle3, tree 5/4/8 | 2.50 (1.25) |" in table
    assert "| ours (smollm2-135m) | 0 | normal decoding | 1.10 |" in table
    paper = PAPER_QWEN3_8B["dspark"]["gsm8k"] / PAPER_QWEN3_8B["eagle3"]["gsm8k"]
    assert f"| paper (Qwen3-8B) | 1 | dspark | 6.17 ({paper:.2f}) |" in table

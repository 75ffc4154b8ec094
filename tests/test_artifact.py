"""The packed regenerated-data file: what `train` reads from it is what it reads from the folder, and a
damaged or foreign file is refused with one clear error."""

import json

import pytest
import torch

from specdecode.errors import SpecDecodeError
from specdecode.training.artifact import load_packed, manifest_path, pack, packed_ids
from specdecode.training.run import load_examples
from tests.conftest import tiny_target

RECORDS = [
    {
        "id": f"chat-{i}",
        "source": "chat" if i % 2 else "math",
        "messages": [
            {"role": "user", "content": f"Tell me something about the number {i} and its neighbours."},
            {"role": "assistant", "content": f"The number {i} sits between {i - 1} and {i + 1}. " * (1 + i % 3)},
            {"role": "user", "content": "And its square?"},
            {"role": "assistant", "content": f"Its square is {i * i}, which is even." if i % 2 == 0 else "Odd."},
        ],
    }
    for i in range(12)
]


@pytest.fixture
def regenerated(tmp_path):
    folder = tmp_path / "regen"
    folder.mkdir()
    (folder / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    (folder / "settings.json").write_text(json.dumps({"temperature": 0.7}))
    return folder


def test_packed_examples_equal_the_folders(smollm2, regenerated, tmp_path):
    out = tmp_path / "data.npz"
    manifest = pack(smollm2, regenerated, out)
    assert manifest["conversations"] == 12 and manifest["sources"] == {"chat": 6, "math": 6}
    assert manifest["regeneration_settings"] == {"temperature": 0.7}
    from_folder = load_examples(smollm2, str(regenerated), max_length=1024)
    from_file = load_examples(smollm2, str(out), max_length=1024)
    assert [e.id for e in from_file] == [e.id for e in from_folder]
    for a, b in zip(from_file, from_folder, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    short = load_packed(smollm2, out, max_length=20)
    assert max(len(e.input_ids) for e in short) == 20


def test_a_damaged_or_foreign_file_is_refused(smollm2, regenerated, tmp_path):
    out = tmp_path / "data.npz"
    pack(smollm2, regenerated, out)
    with pytest.raises(SpecDecodeError, match="tokenizer"):
        load_packed(tiny_target(), out, 1024)
    data = bytearray(out.read_bytes())
    data[len(data) // 2] ^= 0xFF
    out.write_bytes(bytes(data))
    with pytest.raises(SpecDecodeError, match="sha256"):
        load_packed(smollm2, out, 1024)
    manifest_path(out).unlink()
    with pytest.raises(SpecDecodeError, match="no manifest"):
        load_packed(smollm2, out, 1024)


def test_a_packed_file_grows_without_answering_its_conversations_again(smollm2, regenerated, tmp_path):
    """`pack --base`: the file's conversations, then the new folder's, skipping those the file holds; the
    result reads like one folder holding them all. A folder sampled otherwise is refused."""
    out = tmp_path / "data.npz"
    first = regenerated.parent / "first"
    first.mkdir()
    (first / "shard-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:7]))
    (first / "settings.json").write_text(json.dumps({"temperature": 0.7}))
    pack(smollm2, first, out)
    assert packed_ids(smollm2, out, {"temperature": 0.7}) == {r["id"] for r in RECORDS[:7]}
    grown = pack(smollm2, regenerated, out, base=out)  # the folder holds all 12, five of them new
    assert grown["conversations"] == 12 and grown["sources"] == {"chat": 6, "math": 6}
    every = load_examples(smollm2, str(regenerated), max_length=1024)
    from_file = load_examples(smollm2, str(out), max_length=1024)
    assert [e.id for e in from_file] == [e.id for e in every]
    for a, b in zip(from_file, every, strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert grown["supervised_tokens"] == sum(int(e.loss_mask.sum()) for e in every)
    (regenerated / "settings.json").write_text(json.dumps({"temperature": 1.0}))
    with pytest.raises(SpecDecodeError, match="settings"):
        pack(smollm2, regenerated, tmp_path / "other.npz", base=out)
    with pytest.raises(SpecDecodeError, match="settings"):
        packed_ids(smollm2, out, {"temperature": 1.0})

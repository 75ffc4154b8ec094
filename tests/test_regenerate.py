"""Regeneration: assistant-only loss masks, turn-by-turn answers, and a restart that loses nothing."""

import os
import signal
import subprocess
import sys
import time

import pytest

from specdecode.errors import SpecDecodeError
from specdecode.training.data import tokenize_conversation
from specdecode.training.prompts import Conversation
from specdecode.training.regenerate import RegenerationSettings, read_records, regenerate

SETTINGS = RegenerationSettings(max_new_tokens=12, batch_size=2, shard_size=3)
KILLED_RUN_PROMPTS = 32  # a run the kill lands in the middle of (test_restart_after_sigkill_loses_nothing)


def test_loss_mask_covers_assistant_tokens_only(smollm2):
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
    ]
    example = tokenize_conversation(smollm2.tokenizer, "x", messages, max_length=4096)
    supervised = smollm2.tokenizer.decode(example.input_ids[example.loss_mask])
    assert "Hello! How can I help?" in supervised and "Why did the chicken cross the road?" in supervised
    assert "Hi there" not in supervised and "Tell me a joke" not in supervised and "user" not in supervised
    assert "<|im_end|>" in supervised  # the target's own end-of-turn token is learned too


def test_multi_turn_conversations_are_answered_turn_by_turn(smollm2, tmp_path):
    conversations = [
        Conversation("a", "chat", ["Say one word.", "Now say another word."]),
        Conversation("b", "math", ["What is 2 + 3?"]),
    ]
    report = regenerate(smollm2, conversations, str(tmp_path), SETTINGS)
    records = {r["id"]: r for r in read_records(tmp_path)}
    assert report.conversations == 2 and report.new_tokens > 0
    assert [m["role"] for m in records["a"]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert [m["role"] for m in records["b"]["messages"]] == ["user", "assistant"]
    assert all(m["content"] for m in records["a"]["messages"])


def test_other_settings_are_refused_on_resume(smollm2, tmp_path):
    regenerate(smollm2, [Conversation("a", "math", ["What is 1 + 1?"])], str(tmp_path), SETTINGS)
    with pytest.raises(SpecDecodeError, match="other settings"):
        regenerate(smollm2, [], str(tmp_path), RegenerationSettings(temperature=0.2, max_new_tokens=12))


def test_restart_after_sigkill_loses_nothing(tmp_path):
    """Kill a regeneration mid-run, restart it: every id ends up exactly once, finished ones are kept. The run must
    outlast the watcher's polls: eight prompts of 16 tokens took ~0.3 s on the 8-bit kernel in zmm registers, and a
    0.5 s poll saw 0 records and then all 8 (stop 62's CI)."""
    out = tmp_path / "regen"
    command = [
        sys.executable,
        "-m",
        "specdecode.cli",
        "data",
        "regenerate",
        "--out",
        str(out),
        "--num-prompts",
        str(KILLED_RUN_PROMPTS),
        "--batch-size",
        "2",
        "--max-new-tokens",
        "16",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while len(read_records(out)) < 2 and time.time() < deadline and first.poll() is None:
        time.sleep(0.02)
    first.send_signal(signal.SIGKILL)
    first.wait()
    kept = {r["id"]: r for r in read_records(out)}
    assert 2 <= len(kept) < KILLED_RUN_PROMPTS, "the kill should land mid-run"
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    records = read_records(out)
    ids = [r["id"] for r in records]
    assert len(ids) == len(set(ids)) == KILLED_RUN_PROMPTS
    by_id = {r["id"]: r for r in records}
    assert all(by_id[i] == kept[i] for i in kept)  # finished work was not redone

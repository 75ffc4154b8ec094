"""`specdecode data regenerate`: the target writes the answers its drafter will learn to predict.

A drafter is judged by how often the target agrees with it, so it must learn the target's own outputs,
not a data set's human answers (all three papers regenerate). Conversations are answered turn by turn,
each user turn seeing the target's earlier answers, in batches (left-padded) for throughput. Output is
JSONL shards; each finished conversation is one line written and fsynced at once, so a restart skips
finished ids and loses nothing but the batch in flight.
"""

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.training.prompts import Conversation

SHARD_GLOB = "shard-*.jsonl"


@dataclass(frozen=True)
class RegenerationSettings:
    """DeepSpec's settings for Qwen3 by default: temperature 0.7, top-p 0.8, top-k 20."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 256
    batch_size: int = 8
    shard_size: int = 500
    seed: int = 0


@dataclass
class RegenerationReport:
    conversations: int
    skipped: int
    new_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def read_records(out_dir: str | Path) -> list[dict]:
    """Every complete record in the shards; a torn last line (a crash mid-write) is ignored."""
    records = []
    for shard in sorted(Path(out_dir).glob(SHARD_GLOB)):
        for line in shard.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


class _ShardWriter:
    """Appends records to numbered shards, starting a fresh shard on every run."""

    def __init__(self, out_dir: Path, shard_size: int) -> None:
        self.out_dir, self.shard_size = out_dir, shard_size
        existing = sorted(out_dir.glob(SHARD_GLOB))
        self.index = int(existing[-1].stem.split("-")[1]) + 1 if existing else 0
        self.count = 0
        self.file = None

    def write(self, record: dict) -> None:
        if self.file is None or self.count == self.shard_size:
            if self.file:
                self.file.close()
            self.file = open(self.out_dir / f"shard-{self.index:05d}.jsonl", "a")
            self.index, self.count = self.index + 1, 0
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.count += 1

    def close(self) -> None:
        if self.file:
            self.file.close()


@torch.inference_mode()
def answer_batch(target: Target, chats: list[list[dict]], settings: RegenerationSettings) -> list[tuple[str, int]]:
    """One assistant answer per chat, sampled from the target in one left-padded batch: (text, tokens)."""
    tokenizer = target.tokenizer
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(target.device)
    out = target.model.generate(
        **batch,
        do_sample=settings.temperature > 0,
        temperature=settings.temperature or None,
        top_p=settings.top_p,
        top_k=settings.top_k,
        max_new_tokens=settings.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    answers = []
    eos = target.eos_token_ids
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        length = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        answers.append((tokenizer.decode(row[:length], skip_special_tokens=True).strip(), length))
    return answers


def regenerate(
    target: Target, conversations: list[Conversation], out_dir: str, settings: RegenerationSettings
) -> RegenerationReport:
    """Answer every conversation not yet in `out_dir`; resumable at any point."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = [c.id for c in conversations]
    if len(set(ids)) != len(ids):
        raise SpecDecodeError("conversation ids must be unique")
    _check_settings(out, settings)
    finished = {r["id"] for r in read_records(out)}
    todo = [c for c in conversations if c.id not in finished]
    writer = _ShardWriter(out, settings.shard_size)
    bar = tqdm(total=len(conversations), initial=len(conversations) - len(todo), desc="regenerate", unit="conv")
    new_tokens, start = 0, time.perf_counter()
    try:
        for first in range(0, len(todo), settings.batch_size):
            batch = todo[first : first + settings.batch_size]
            # seeded by the batch's first id: a run resumed between batches samples as an unbroken one
            torch.manual_seed(settings.seed + ids.index(batch[0].id))
            chats: list[list[dict]] = [[] for _ in batch]
            for turn in range(max(len(c.turns) for c in batch)):
                active = [i for i, c in enumerate(batch) if turn < len(c.turns)]
                for i in active:
                    chats[i].append({"role": "user", "content": batch[i].turns[turn]})
                for i, (text, n) in zip(
                    active, answer_batch(target, [chats[i] for i in active], settings), strict=True
                ):
                    chats[i].append({"role": "assistant", "content": text})
                    new_tokens += n
            for conversation, chat in zip(batch, chats, strict=True):
                writer.write({"id": conversation.id, "source": conversation.source, "messages": chat})
            seconds = time.perf_counter() - start
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / seconds:.1f}")
    finally:
        writer.close()
        bar.close()
    return RegenerationReport(
        len(conversations), len(conversations) - len(todo), new_tokens, time.perf_counter() - start
    )


def _check_settings(out: Path, settings: RegenerationSettings) -> None:
    """A resumed run must sample like the first one; mixing settings in one data set is refused."""
    path = out / "settings.json"
    mine = asdict(settings)
    mine.pop("batch_size")  # batching changes throughput, not the distribution
    mine.pop("shard_size")
    if path.exists():
        theirs = json.loads(path.read_text())
        if theirs != mine:
            raise SpecDecodeError(f"{out} was regenerated with other settings {theirs}; use a new --out folder")
    else:
        path.write_text(json.dumps(mine, indent=1))

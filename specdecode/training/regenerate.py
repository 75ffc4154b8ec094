"""`specdecode data regenerate`: the target writes the answers its drafter will learn to predict.

A drafter is judged by how often the target agrees with it, so it must learn the target's own outputs,
not a data set's human answers (all three papers regenerate). Conversations are answered turn by turn,
each user turn seeing the target's earlier answers. Every turn is a request to the continuous engine
(`engine/continuous.py`, normal decoding): `batch_size` requests decode together, one batched runner pass
per token, and a finished one hands its slot to the next at once. Each turn samples from its own seed
(seed, conversation index, turn), so what is written depends neither on batching nor on restarts. Output
is JSONL shards; each finished conversation is one line written and fsynced at once, so a restart skips
finished ids and loses only the conversations in flight.
"""

import json
import queue
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from specdecode.drafters.base import Drafter
from specdecode.engine.continuous import ContinuousEngine, EngineConfig
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.paths import append_synced, read_jsonl, write_text_atomically
from specdecode.sampling import SamplingParams
from specdecode.training.prompts import Conversation
from specdecode.training.trainer import derived_seed

SHARD_GLOB = "shard-*.jsonl"


@dataclass(frozen=True)
class RegenerationSettings:
    """DeepSpec's settings for Qwen3 by default: temperature 0.7, top-p 0.8, top-k 20."""

    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    max_new_tokens: int = 256
    batch_size: int = 64  # requests decoding at once (KV slots)
    max_len: int = 1024  # tokens a turn may hold, the conversation so far included
    shard_size: int = 500
    seed: int = 0
    prefix_caching: bool = True  # a turn's prefill skips the start a KV slot holds (engine/batch.py): same tokens


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
    """Every complete record in the shards."""
    return [record for shard in sorted(Path(out_dir).glob(SHARD_GLOB)) for record in read_jsonl(shard)]


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
            self.file = open(self.out_dir / f"shard-{self.index:05d}.jsonl", "a", encoding="utf-8")
            self.index, self.count = self.index + 1, 0
        append_synced(self.file, record)
        self.count += 1

    def close(self) -> None:
        if self.file:
            self.file.close()


def regenerate(
    target: Target, conversations: list[Conversation], out_dir: str, settings: RegenerationSettings
) -> RegenerationReport:
    """Answer every conversation not yet in `out_dir`; resumable at any point."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ids = [c.id for c in conversations]
    if len(set(ids)) != len(ids):
        raise SpecDecodeError("conversation ids must be unique")
    check_same_settings(out, sampling_settings(settings))
    finished = {r["id"] for r in read_records(out)}
    todo = [(index, c) for index, c in enumerate(conversations) if c.id not in finished]
    params = SamplingParams(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)
    config = EngineConfig(settings.batch_size, settings.max_len, 0, prefix_caching=settings.prefix_caching)
    engine = ContinuousEngine(target, Drafter(), config)
    answered: queue.Queue = queue.Queue()
    chats: dict[str, list[dict]] = {}

    def ask(index: int, conversation: Conversation, turn: int, front: bool = False) -> bool:
        """Queue the conversation's next user turn (`front`: before every queued one); False when it no longer fits
        a slot."""
        chat = chats.setdefault(conversation.id, [])
        chat.append({"role": "user", "content": conversation.turns[turn]})
        prompt = target.encode_chat(chat)
        room = min(settings.max_new_tokens, settings.max_len - len(prompt))
        if room < 1:
            chat.pop()
            return False
        engine.submit(
            prompt,
            params,
            room,
            seed=derived_seed(settings.seed, index, turn),
            on_done=lambda outcome: answer(index, conversation, turn, outcome),
            front=front,
        )
        return True

    def answer(index: int, conversation: Conversation, turn: int, outcome: object) -> None:
        """On the engine thread, as a turn ends: its answer joins the chat and the next turn goes to the front of the
        queue at once, so it is admitted before another request takes the slot that still holds the conversation
        so far (prefix reuse); a later turn that does not fit ends the conversation with the turns answered."""
        more = False
        if not isinstance(outcome, Exception):
            chats[conversation.id].append({"role": "assistant", "content": outcome.text.strip()})
            more = turn + 1 < len(conversation.turns) and ask(index, conversation, turn + 1, front=True)
        answered.put((conversation, outcome, more))

    writer = _ShardWriter(out, settings.shard_size)
    bar = tqdm(total=len(conversations), initial=len(conversations) - len(todo), desc="regenerate", unit="conv")
    new_tokens, start = 0, time.perf_counter()

    def collect() -> int:
        """Hand out first turns and write finished conversations (beside the engine loop); returns those skipped."""
        nonlocal new_tokens
        waiting = sum(ask(index, conversation, 0) for index, conversation in todo)
        skipped = len(todo) - waiting
        while waiting:
            conversation, outcome, more = answered.get()
            if isinstance(outcome, Exception):
                raise outcome
            new_tokens += len(outcome.token_ids)
            if more:
                continue
            writer.write({"id": conversation.id, "source": conversation.source, "messages": chats.pop(conversation.id)})
            waiting -= 1
            bar.update(1)
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - start):.1f}")
        return skipped

    try:
        skipped = engine.drive(collect)  # the engine steps on this thread, the model's (engine/continuous.py)
    finally:
        writer.close()
        bar.close()
    if skipped:
        print(f"regenerate: skipped {skipped} conversations whose first turn does not fit {settings.max_len} tokens")
    seconds = time.perf_counter() - start
    return RegenerationReport(len(conversations), len(conversations) - len(todo), new_tokens, seconds)


_THROUGHPUT_ONLY = ("batch_size", "shard_size", "prefix_caching")


def sampling_settings(settings: object) -> dict:
    """What decides the tokens a settings dataclass writes (batching and sharding change only throughput and
    files)."""
    return {k: v for k, v in asdict(settings).items() if k not in _THROUGHPUT_ONLY}


def check_same_settings(out: Path, mine: dict) -> None:
    """A resumed run must sample like the first one; mixing settings in one data set is refused."""
    path = out / "settings.json"
    if path.exists():
        theirs = json.loads(path.read_text())
        if theirs != mine:
            raise SpecDecodeError(f"{out} was regenerated with other settings {theirs}; use a new --out folder")
    else:
        write_text_atomically(path, json.dumps(mine, indent=1))

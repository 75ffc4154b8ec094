"""`specdecode calibrate`: fit STS temperatures and biases for a DSpark checkpoint; its reliability report.

Rounds are recorded by decoding prompts the drafter never trained on: prompts of the training mix that
were not regenerated into the data folder (same distribution, disjoint ids and texts). Recording is
resumable (one JSONL line per prompt under the cache). Half of the rounds (interleaved) fit the
map, the other half measures ECE before and after, so the reported gain is not measured on the data it
was fitted to; next to it, the ECE a perfectly calibrated predictor would show on the same rounds (the
sampling-noise floor of a binned ECE). The map is written into the checkpoint's config.json: rounds at
T = 0 fit the greedy map (`greedy_calibration_*`), any other temperature the sampled one; greedy decoding
keeps more of the same drafts, so one map for both misjudged one of them.
"""

import hashlib
import json
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.drafters.checkpoint import load_drafter, read_config
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target
from specdecode.paths import append_synced, cache_dir, resume_jsonl
from specdecode.sampling import SamplingParams
from specdecode.training.calibration import (
    RoundRecorder,
    Rounds,
    cumulative_confidence,
    fit_sequential_temperatures,
    per_position_report,
    reliability_curve,
)
from specdecode.training.prompts import DEFAULT_MIX, build_prompt_mix
from specdecode.training.regenerate import read_records
from specdecode.verify import SAMPLED_CHAIN_RULE


def mix_pool(seen_ids: set[str], count: int, seed: int) -> list:
    """The default mix just large enough to hold `4 * count` prompts beside every seen one it can name: only
    ids of its own sources count (a data set's other sources, e.g. self-written turns, would ask the mix for
    more prompts than it has)."""
    named = sum(1 for i in seen_ids if i.rsplit("-", 1)[0] in DEFAULT_MIX)
    return build_prompt_mix(named + 4 * count, seed=seed)


def unseen_prompts(target: Target, data_dir: str, count: int, seed: int = 0) -> list[list[dict]]:
    """First-turn chat messages of mix prompts absent from the regenerated data (never trained on): a
    regeneration folder, whose ids name prompts of the mix built with `seed`, or a packed `.npz` (checked
    against its manifest, whose regeneration seed built the mix its ids name)."""
    if Path(data_dir).suffix == ".npz":
        from specdecode.training.artifact import packed_prompts

        seen_ids, seed = packed_prompts(target, data_dir)
        pool = mix_pool(seen_ids, count, seed)
        seen_texts = {turn for c in pool if c.id in seen_ids for turn in c.turns}
    else:
        records = read_records(data_dir)
        seen_ids = {r["id"] for r in records}
        seen_texts = {m["content"] for r in records for m in r["messages"] if m["role"] == "user"}
        pool = mix_pool(seen_ids, count, seed)
    fresh = [c for c in pool if c.id not in seen_ids and c.turns[0] not in seen_texts]
    if len(fresh) < count:
        raise SpecDecodeError(f"only {len(fresh)} unseen prompts are available, {count} asked for")
    return [[{"role": "user", "content": c.turns[0]}] for c in fresh[:count]]


def record_rounds(
    target: Target, drafter_path: str, prompts: list[list[dict]], params: SamplingParams, max_new_tokens: int
) -> Rounds:
    """Decode every prompt with the raw (uncalibrated) confidences, recording each round; resumable: a cached
    prompt's rounds are found by its text, so another `--prompts` count (another list) reuses what matches."""
    drafter = load_drafter(drafter_path, target)
    if not getattr(drafter.config, "confidence_head", False):
        raise SpecDecodeError(f"{drafter_path} is a {drafter.name} drafter without a confidence head")
    drafter.config.clear_calibration()  # record raw confidences
    gamma = drafter.config.draft_length
    digest = hashlib.sha256(Path(drafter_path, "model.safetensors").read_bytes())
    digest.update(f"{params} {max_new_tokens} {SAMPLED_CHAIN_RULE}".encode())
    log = cache_dir("calibration") / f"rounds-{digest.hexdigest()[:12]}.jsonl"
    cached = resume_jsonl(log)  # a last line cut short by a kill is redone
    done = {row["prompt"]: row for row in cached if "prompt" in row}  # lines written before prompt keys: redone
    keys = [hashlib.sha256(json.dumps(messages).encode()).hexdigest()[:16] for messages in prompts]
    recorder = RoundRecorder(drafter, gamma)
    decoder = SpeculativeDecoder(target, recorder, draft_length=gamma)
    missing = [i for i, key in enumerate(keys) if key not in done]
    with log.open("a") as f:
        for i in tqdm(missing, desc="calibration rounds", initial=len(prompts) - len(missing), total=len(prompts)):
            start = len(recorder.accepted)
            ids = target.encode_chat(prompts[i])
            if len(ids) + max_new_tokens <= target.max_context:  # else (a pasted document) no room: no rounds
                decoder.generate(ids, params, max_new_tokens, seed=i)
            done[keys[i]] = {
                "prompt": keys[i],
                "logits": recorder.logits[start:],
                "accepted": recorder.accepted[start:],
            }
            append_synced(f, done[keys[i]])
    rows = [done[key] for key in keys]
    logits = torch.tensor([r for row in rows for r in row["logits"]], dtype=torch.float64)
    accepted = torch.tensor([a for row in rows for a in row["accepted"]], dtype=torch.float64)
    return Rounds(logits, accepted)


def write_calibration(
    drafter_path: str, temperatures: list[float], biases: list[float], details: dict, greedy: bool = False
) -> None:
    """The map into the checkpoint's config.json: the sampled one, or with `greedy` the one for T = 0."""
    path = Path(drafter_path) / "config.json"
    config = read_config(drafter_path)
    prefix = "greedy_" if greedy else ""
    config["architecture"][f"{prefix}calibration_temperatures"] = temperatures
    config["architecture"][f"{prefix}calibration_biases"] = biases
    config[f"{prefix}calibration"] = details
    path.write_text(json.dumps(config, indent=1) + "\n")


def run_calibration(
    target: Target,
    drafter_path: str,
    data_dir: str,
    out_dir: str = "docs/results",
    name: str = "calibration",
    num_prompts: int = 40,
    temperature: float = 1.0,
    max_new_tokens: int = 160,
) -> dict:
    params = SamplingParams(temperature=temperature)
    prompts = unseen_prompts(target, data_dir, num_prompts)
    rounds = record_rounds(target, drafter_path, prompts, params, max_new_tokens)
    fit_half, report_half = rounds.split()
    fit = fit_sequential_temperatures(fit_half)
    report = per_position_report(report_half, fit.temperatures, fit.biases)
    details = {
        "method": "sequential temperature scaling with a bias per position",
        "decoding_temperature": temperature,
        "prompts": num_prompts,
        "rounds_fit": len(fit_half.accepted),
        "rounds_report": len(report_half.accepted),
    }
    write_calibration(drafter_path, fit.temperatures, fit.biases, details, greedy=params.greedy)
    plot = Path(out_dir) / f"{name}_reliability.png"
    _plot_reliability(report_half, fit.temperatures, fit.biases, plot)
    table = _table(report) + f"\n\n![reliability]({plot.name})\n"
    write_results(name, out_dir, target.name, report, table, drafter=drafter_path, calibration=details)
    return {"temperatures": fit.temperatures, "biases": fit.biases, "positions": report}


def _table(report: list[dict]) -> str:
    lines = [
        "Per draft position k: ECE of the cumulative confidence prod_{i<=k} c_i against whether drafts 1..k all "
        "survived, on held-out rounds (the fit used the other half); c_i = sigmoid(z_i / T_i + b_i). ECE floor: "
        "the ECE a perfectly calibrated predictor shows on the same rounds (mean of 200 draws of the labels).",
        "",
        "| k | rounds | survival | predicted before | predicted after | ECE before | ECE after | ECE floor | AUROC "
        "| T_k | b_k |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report:
        lines.append(
            f"| {r['position']} | {r['rounds']} | {r['survival_rate']:.3f} | {r['mean_predicted_before']:.3f} | "
            f"{r['mean_predicted_after']:.3f} | {100 * r['ece_before']:.1f}% | {100 * r['ece_after']:.1f}% | "
            f"{100 * r['ece_floor']:.1f}% | {r['auroc']:.3f} | {r['temperature']:.2f} | {r['bias']:+.1f} |"
        )
    return "\n".join(lines)


def _plot_reliability(rounds: Rounds, temperatures: list[float], biases: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = rounds.labels()
    gamma = rounds.logits.shape[1]
    curves = {
        "before (raw)": cumulative_confidence(rounds.logits, []),
        "after STS": cumulative_confidence(rounds.logits, temperatures, biases),
    }
    shown = sorted({0, 1, 2, gamma // 2, gamma - 1} & set(range(gamma)))
    fig, axes = plt.subplots(1, len(shown), figsize=(3.2 * len(shown), 3.4), squeeze=False)
    for ax, k in zip(axes[0], shown, strict=True):
        ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--")
        for label, predicted in curves.items():
            x, y, _ = reliability_curve(predicted[:, k], labels[:, k])
            ax.plot(x, y, marker="o", ms=3, label=label)
        ax.set_title(f"position {k + 1}")
        ax.set_xlabel("predicted prefix survival")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("observed survival")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

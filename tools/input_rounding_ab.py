"""What rounding the target's inputs costs in quality: the default target's plan (8-bit inputs where the plan took
them, docs/runner.md) against float32 inputs over the same GGUF rows (`--kernel few-rows-gguf`), scored on
human-written reference answers as llama.cpp scores its quantizations: the mean negative log-likelihood of each
reference token given the text before it, and how often the target's top token is the reference's.

    python tools/input_rounding_ab.py --gsm8k 100 --humaneval 50 --name input_rounding_ab

GSM8K: the chat prompt of the question, then its reference solution (scored). HumanEval: the function's prompt,
then its canonical solution (scored), as plain text. One pass per text through `Target.features` (the decoding
kernels, a scratch cache).
"""

import argparse

import torch

from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.results import write_results
from specdecode.models.target import Target


def reference_texts(gsm8k: int, humaneval: int, target: Target) -> list[tuple[str, list[int], int]]:
    """(set, token ids, scored from) per text: the reference answer's tokens are scored, the prompt's are not."""
    texts = []
    for item in load_benchmark("gsm8k", gsm8k):
        prompt = target.encode(item.turns[0])
        answer = target.tokenizer.encode(item.reference, add_special_tokens=False)
        texts.append(("gsm8k", prompt + answer, len(prompt)))
    for item in load_benchmark("humaneval", humaneval):
        prompt = target.tokenizer.encode(item.turns[0], add_special_tokens=False)
        solution = target.tokenizer.encode(item.reference, add_special_tokens=False)
        texts.append(("humaneval", prompt + solution, len(prompt)))
    return texts


@torch.inference_mode()
def score(target: Target, ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scored token: its negative log-likelihood, and the target's top token at its position."""
    hidden = target.features(torch.tensor(ids)).last_hidden
    logits = target.lm_head(hidden[start - 1 : len(ids) - 1]).float()
    reference = torch.tensor(ids[start:])
    nll = -torch.log_softmax(logits, -1).gather(1, reference[:, None])[:, 0]
    return nll, logits.argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gsm8k", type=int, default=100)
    parser.add_argument("--humaneval", type=int, default=50)
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--name", default="input_rounding_ab")
    args = parser.parse_args()
    targets = {"default": Target.load(), "float32 inputs": Target.load(kernel="few-rows-gguf")}
    kernels = {name: t.runner.lm_head.kernel_for(1) if t.runner else "hf" for name, t in targets.items()}
    texts = reference_texts(args.gsm8k, args.humaneval, targets["default"])
    scored: dict[tuple[str, str], list] = {}
    for kind, ids, start in texts:
        tops = {}
        for name, target in targets.items():
            nll, tops[name] = score(target, ids, start)
            reference = torch.tensor(ids[start:])
            scored.setdefault((kind, name), []).append((nll, tops[name] == reference))
        scored.setdefault((kind, "agree"), []).append(tops["default"] == tops["float32 inputs"])
    runs, rows = [], []
    for kind in ("gsm8k", "humaneval"):
        agree = torch.cat(scored[(kind, "agree")]).float().mean().item()
        for name in targets:
            nll = torch.cat([n for n, _ in scored[(kind, name)]])
            hits = torch.cat([h for _, h in scored[(kind, name)]]).float()
            run = {
                "set": kind,
                "variant": name,
                "kernel_at_one_row": kernels[name],
                "texts": len(scored[(kind, name)]),
                "tokens": nll.numel(),
                "mean_nll": round(nll.mean().item(), 4),
                "perplexity": round(nll.mean().exp().item(), 3),
                "top1_reference": round(hits.mean().item(), 4),
                "top1_agree_between_variants": round(agree, 4),
            }
            runs.append(run)
            rows.append(
                f"| {kind} | {name} (`{kernels[name]}`) | {run['texts']} | {run['tokens']} | {run['mean_nll']:.4f} | "
                f"{run['perplexity']:.3f} | {run['top1_reference']:.4f} | {agree:.4f} |"
            )
    table = (
        "Reference answers scored token by token (teacher-forced, one pass a text); top-1 agree: the two variants' "
        "top tokens at the same positions.\n\n"
        "| set | variant | texts | tokens | mean NLL | perplexity | top-1 = reference | top-1 agree |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|\n" + "\n".join(rows) + "\n"
    )
    print(table)
    write_results(args.name, args.out, targets["default"].name, runs, table)


if __name__ == "__main__":
    main()

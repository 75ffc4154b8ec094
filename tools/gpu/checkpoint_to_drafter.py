"""Write a drafter from a training checkpoint's weights, for a run stopped before its end (a device call's limit).

`specdecode train` writes the drafter folder only when its run ends; a run stopped by SIGTERM leaves a checkpoint
(`step-N/weights.safetensors`, the trainable parameters by name, and `state.json`). On a lent GPU the last
checkpoint's weights come back in bfloat16 (tools/gpu/train_long_h200.sh); this rebuilds the drafter around them
from a drafter of the same kind, architecture and draft vocabulary (one of the same run, or, with `--continued`,
the drafter the run started from with `train --init`, then recorded as its init), and records in its recipe
that these are step N's weights of a schedule planned for more.

    python tools/gpu/checkpoint_to_drafter.py WEIGHTS.safetensors STATE.json --like DRAFTER --out DRAFTER_OUT \
        [--continued] --metrics METRICS.jsonl --note "how it was trained"
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdecode.drafters.checkpoint import load_model, read_config, save_drafter
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.training.trainer import read_metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("weights", help="a checkpoint's weights.safetensors (any float dtype)")
    parser.add_argument("state", help="the checkpoint's state.json")
    parser.add_argument("--like", required=True, help="a drafter folder with the same architecture and vocabulary")
    parser.add_argument("--out", required=True)
    parser.add_argument("--note", default="", help="how the run was trained, kept in the recipe")
    parser.add_argument("--metrics", help="the run's metrics.jsonl: its last held-out evaluation is kept")
    parser.add_argument("--continued", action="store_true", help="the run started from --like (train --init)")
    args = parser.parse_args()
    like = read_config(args.like)
    target = Target.load(like["target"]["name"], device="cpu")
    kind, model = load_model(args.like, target)
    weights, state = load_file(args.weights), json.loads(Path(args.state).read_text())
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(weights) != trainable:
        raise SpecDecodeError(f"{args.weights} holds other tensors than {args.like}'s trainable parameters")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in weights:
                p.copy_(weights[name].float())
    recipe = {
        **like.get("recipe", {}),
        "training": state["config"],
        "stopped_at": {"step": state["step"], "planned_steps": state["total_steps"], "elapsed_s": state["elapsed"]},
        "trained_on": args.note,
    }
    if args.continued:  # else --like is of the same run, and its recipe's init is this run's
        recipe["init"] = {"drafter": str(args.like), "recipe": like.get("recipe", {})}
    recipe.pop("final_metrics", None)  # --like's; this run's last step is in its metrics.jsonl
    recipe.pop("held_out_metrics", None)
    if args.metrics:
        evals = read_metrics(args.metrics)[1]
        recipe["held_out_metrics"] = evals[-1] if evals else {}
    path = save_drafter(args.out, kind, model, model.config.to_dict(), target, recipe)
    print(f"drafter written to {path} (step {state['step']} of {state['total_steps']})")


if __name__ == "__main__":
    main()

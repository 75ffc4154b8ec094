"""Does an exported DFlash/DSpark folder compute in vLLM what the drafter computes here? One block, both engines.

The same committed context (the target's features of a real prompt, computed here) goes to our drafter and,
through `vllm_drafter_check.py` in vLLM's venv, to vLLM's own drafter class loaded from the exported
folder. Compared: the corrected draft logits of every position (greedy chain, so both follow the same
previous tokens while they agree), the drafted tokens and, for DSpark, the raw confidences.
"""

import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdecode.drafters.dspark import BlockDrafter
from specdecode.errors import SpecDecodeError
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
    logits, conf, tokens = m.sequential(h, m.lm_head(h), anchor_ids[0], choose=lambda x: x.argmax(-1))
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
    agree = int((ours["tokens"] == theirs["tokens"]).long().cumprod(0).sum())  # positions until the chains part
    scale = ours["logits"][:agree].abs().max().clamp_min(1e-6) if agree else torch.tensor(1.0)
    result = {
        "method": method,
        "positions": len(ours["tokens"]),
        "tokens_ours": ours["tokens"].tolist(),
        "tokens_vllm": theirs["tokens"].tolist(),
        "tokens_identical": agree == len(ours["tokens"]),
        "max_abs_logit_diff": float((ours["logits"][:agree] - theirs["logits"][:agree]).abs().max()) if agree else None,
        "max_logit_magnitude": float(scale),
    }
    if "confidence" in ours and "confidence" in theirs:
        result["max_confidence_diff"] = float((ours["confidence"][:agree] - theirs["confidence"][:agree]).abs().max())
    return result

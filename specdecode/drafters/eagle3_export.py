"""Export an EAGLE-3 drafter in the checkpoint format the serving engines load (`LlamaForCausalLMEagle3`).

SGLang and SpecForge read this format, and vLLM loads it with `method: "eagle3"`. It differs from ours in
three ways: the decoder layer's weights sit under `self_attn.` / `mlp.`, the config is a Llama config with
`draft_vocab_size` and `eagle_config`, and the captured layers are named by *input of layer j* (vLLM reads
the ids verbatim; SGLang adds one to them, which is why SpecForge writes output-of-layer ids) — here, output
of layer i is input of layer i + 1. The target's embedding stays out: engines share the target's.
"""

import json
from pathlib import Path

from specdecode.drafters.checkpoint import read_config
from specdecode.drafters.shipped import cast_weights, write_export
from specdecode.errors import SpecDecodeError
from specdecode.models.registry import resolve

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")  # what SpecForge's exporter checks


def engine_key(key: str) -> str:
    """Our flat `midlayer.q_proj.weight` -> `midlayer.self_attn.q_proj.weight` (and `mlp.` for the MLP)."""
    prefix, _, rest = key.partition(".")
    name = rest.split(".")[0]
    if prefix != "midlayer" or name not in ATTENTION + MLP:
        return key
    return f"midlayer.{'self_attn' if name in ATTENTION else 'mlp'}.{rest}"


def export_eagle3(
    source: str | Path, destination: str | Path, dtype: str = "float32", target_dir: str | Path | None = None
) -> Path:
    """Write `destination/{config.json, model.safetensors}` in the engines' EAGLE-3 format, floating-point
    weights cast to `dtype` (the d2t/t2d maps stay integer/boolean). The target's HF folder (by default the
    one of the target named in the checkpoint) gives the settings engines read from the draft's config."""
    config = read_config(source)
    if config["kind"] != "eagle3":
        raise SpecDecodeError(f"--format eagle3 exports EAGLE-3 drafters; {source} is a {config['kind']} drafter")
    weights = {engine_key(k): v for k, v in cast_weights(source, dtype).items()}
    missing = [k for k in REQUIRED if k not in weights]
    if missing:
        raise SpecDecodeError(f"drafter checkpoint {source} is broken: no {', '.join(missing)}")
    a = config["architecture"]
    target_dir = Path(target_dir or resolve(config["target"]["name"]))
    target_config = json.loads((target_dir / "config.json").read_text())
    engine_config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": a["hidden_size"],
        "intermediate_size": a["intermediate_size"],
        "num_attention_heads": a["num_heads"],
        "num_key_value_heads": a["num_kv_heads"],
        "head_dim": a["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": a["rms_norm_eps"],
        "rope_theta": a["rope_theta"],
        "rope_parameters": {"rope_theta": a["rope_theta"], "rope_type": "default"},
        "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
        "vocab_size": a["vocab_size"],
        "draft_vocab_size": a["draft_vocab_size"],
        "target_hidden_size": a["hidden_size"],
        "tie_word_embeddings": False,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in config["target_layer_ids"]],
            "use_aux_hidden_state": True,
        },
    }
    return write_export(source, destination, weights, engine_config)

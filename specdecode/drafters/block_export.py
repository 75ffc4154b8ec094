"""DFlash and DSpark drafters in the folders vLLM serves (`DFlashDraftModel`, `Qwen3DSparkModel`), and back.

vLLM (`qwen3_dflash.py`, `qwen3_dspark.py`) defines these drafters as our block drafter computes them: a
Qwen3 decoder stack with per-head q/k RMSNorm, context features through `fc` then `hidden_norm` into every
layer's k/v projection, a non-causal block over [anchor, mask...], the target's LM head shared. What differs
is spelling, converted both ways here:
- names: the layer's weights sit under `self_attn.` / `mlp.`; the heads are `markov_head.markov_w1/w2` and
  `confidence_head.proj` (its input [h ; W1[x_{k-1}]]: `confidence_head_with_markov`).
- the mask input: vLLM embeds a mask *token id*. Our learned mask vector becomes one extra row of the input
  embedding (the target's V rows plus ours, `vocab_size` V + 1, `mask_token_id` V), so no real token is ever
  read as the mask. The Markov head's input embedding gets a zero row for that id (never read: the previous
  token is always a real one).
- the vocabulary: with the target's whole one, `draft_vocab_size` is V and the LM head is shared; with a
  reduced one, `draft_vocab_size` is N and the folder carries the drafter's own `lm_head` and the `d2t` map
  (vLLM's convention too: target id = draft id + d2t[draft id]); `t2d` rides along and is rebuilt on import.
- layouts: vLLM's `dflash` samples the B-1 mask slots (our `sample_from_anchor=False`); its `dspark` reads
  `sample_from_anchor` (default true, DeepSpec's layout).
- target layer ids: ours are output-of-layer ids, the convention of `dflash_config.target_layer_ids`.
What a format cannot express is refused with one line. The per-position STS calibration and the target's
fingerprint have no key in vLLM's config; they ride along under `specdecode`, so an import restores them.
"""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from specdecode.drafters.checkpoint import frozen, load_state, read_weights
from specdecode.drafters.dspark import BlockDrafter, DSparkConfig, DSparkModel
from specdecode.drafters.shipped import cast, export_dtype, write_export
from specdecode.drafters.vocab import vocab_maps
from specdecode.errors import SpecDecodeError
from specdecode.models.registry import resolve
from specdecode.models.target import Target

ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel"}
LAYER_GROUPS = {name: "self_attn" for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
LAYER_GROUPS.update({name: "mlp" for name in ("gate_proj", "up_proj", "down_proj")})
HEADS = {
    "markov.w1.weight": "markov_head.markov_w1.weight",
    "markov.w2.weight": "markov_head.markov_w2.weight",
    "confidence.weight": "confidence_head.proj.weight",
    "confidence.bias": "confidence_head.proj.bias",
}
OUR_HEADS = {engine: ours for ours, engine in HEADS.items()}


def engine_key(key: str) -> str:
    """`layers.0.q_proj.weight` -> `layers.0.self_attn.q_proj.weight`; the heads renamed; the rest as is."""
    parts = key.split(".")
    if parts[0] == "layers" and len(parts) > 2 and parts[2] in LAYER_GROUPS:
        return ".".join([*parts[:2], LAYER_GROUPS[parts[2]], *parts[2:]])
    return HEADS.get(key, key)


def our_key(key: str) -> str:
    parts = key.split(".")
    if parts[0] == "layers" and len(parts) > 3 and parts[2] in ("self_attn", "mlp"):
        return ".".join([*parts[:2], *parts[3:]])
    return OUR_HEADS.get(key, key)


def refusal(c: DSparkConfig, fmt: str) -> str | None:
    """Why the format `fmt` cannot express this drafter, or None."""
    if not c.qk_norm:
        return "it was trained before the block drafters had q/k norm, which vLLM's drafter applies: retrain it"
    if fmt == "dflash" and c.markov_rank > 0:
        return "it has a Markov head, which vLLM's dflash drafter has no place for: export it with --format dspark"
    if fmt == "dflash" and c.sample_from_anchor:
        return (
            "it predicts from its anchor (DeepSpec's layout), and vLLM's dflash method samples only the mask slots: "
            "train it with --fill-in, or export a DSpark drafter with --format dspark"
        )
    if fmt == "dspark" and c.markov_rank == 0:
        return "it has no Markov head, which vLLM's dspark drafter requires: export it with --format dflash"
    if fmt == "dspark" and c.markov_head_type != "vanilla":
        return f"vLLM's dspark drafter has only the vanilla Markov head, not {c.markov_head_type!r}"
    return None


def target_embedding(target_dir: Path) -> torch.Tensor:
    """The input embedding matrix of an HF target folder, read without loading the model."""
    for file in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if key.endswith("embed_tokens.weight"):
                    return f.get_tensor(key)
    raise SpecDecodeError(f"no embed_tokens weight in the safetensors files of {target_dir}")


def export_block(
    config: dict, source: str | Path, destination: str | Path, fmt: str, dtype: str, target_dir: str | Path | None
) -> Path:
    """Write `destination/{config.json, model.safetensors}` in vLLM's `fmt` ('dflash' | 'dspark') format."""
    c = DSparkConfig(**config["architecture"])
    reason = refusal(c, fmt)
    if reason:
        raise SpecDecodeError(f"cannot export {source} as {fmt}: {reason}")
    export_dtype(dtype)  # before reading anything
    target_dir = Path(target_dir or resolve(config["target"]["name"]))
    target_config = json.loads((target_dir / "config.json").read_text())
    weights = {engine_key(k): v for k, v in read_weights(source).items()}
    vocab, mask_id = c.vocab_size, c.mask_token_id
    if mask_id is None:  # the learned mask vector becomes embedding row V
        mask_id, mask = vocab, weights.pop("mask_embedding")
        weights["embed_tokens.weight"] = torch.cat([target_embedding(target_dir).to(mask.dtype), mask[None]])
        if "markov_head.markov_w1.weight" in weights:
            w1 = weights["markov_head.markov_w1.weight"]
            weights["markov_head.markov_w1.weight"] = torch.cat([w1, w1.new_zeros(1, w1.shape[1])])
    weights = cast(weights, dtype)
    layer_ids = list(c.target_layer_ids)
    engine_config = {
        "architectures": [ARCHITECTURES[fmt]],
        "model_type": "qwen3",
        "num_hidden_layers": c.num_layers,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
        "attention_bias": False,
        "max_position_embeddings": target_config.get("max_position_embeddings", 2048),
        "vocab_size": weights["embed_tokens.weight"].shape[0] if "embed_tokens.weight" in weights else vocab,
        "draft_vocab_size": c.draft_vocab,
        "target_hidden_size": c.hidden_size,
        "tie_word_embeddings": False,
        "bos_token_id": target_config.get("bos_token_id"),
        "eos_token_id": target_config.get("eos_token_id"),
        "torch_dtype": dtype,
        "block_size": c.block_size,
        "num_target_layers": target_config.get("num_hidden_layers"),
        "target_layer_ids": layer_ids,
        "mask_token_id": mask_id,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": layer_ids},
        "specdecode": {
            "target": config["target"],
            "calibration_temperatures": c.calibration_temperatures,
            "calibration_biases": c.calibration_biases,
            "greedy_calibration_temperatures": c.greedy_calibration_temperatures,
            "greedy_calibration_biases": c.greedy_calibration_biases,
            "recipe": config.get("recipe", {}),
        },
    }
    if fmt == "dspark":
        engine_config.update(
            markov_rank=c.markov_rank,
            markov_head_type=c.markov_head_type,
            enable_confidence_head=c.confidence_head,
            confidence_head_with_markov=True,
            sample_from_anchor=c.sample_from_anchor,
        )
    return write_export(source, destination, weights, engine_config)


def is_engine_folder(path: Path) -> bool:
    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (OSError, json.JSONDecodeError, AttributeError):
        return False
    return any(a in ARCHITECTURES.values() for a in architectures)


def import_config(config: dict, target: Target, path: Path) -> DSparkConfig:
    """Our architecture for a vLLM-format config, refusing what our block drafter does not compute."""
    fmt = "dspark" if ARCHITECTURES["dspark"] in config["architectures"] else "dflash"
    inner = config.get("dflash_config") or {}
    layer_ids = inner.get("target_layer_ids", config.get("target_layer_ids"))
    mask_id = inner.get("mask_token_id", config.get("mask_token_id"))
    mask_row = mask_id is not None and mask_id == config["vocab_size"] - 1 and mask_id >= target.vocab_size
    vocab = config["vocab_size"] - mask_row  # the target's vocabulary, without an appended mask row
    draft_vocab = config.get("draft_vocab_size") or vocab
    problems = []
    if (config["hidden_size"], vocab) != (target.config.hidden_size, target.vocab_size):
        problems.append(
            f"hidden size {config['hidden_size']} and vocabulary {vocab} are not {target.name}'s "
            f"{target.config.hidden_size} and {target.vocab_size}"
        )
    if not layer_ids or max(layer_ids) >= target.num_layers - 1:
        problems.append(
            f"target layer ids {layer_ids} are not outputs of {target.name}'s first {target.num_layers - 1} layers"
        )
    if mask_id is None:
        problems.append("its config names no mask_token_id")
    if fmt == "dspark" and config.get("markov_head_type", "vanilla") != "vanilla":
        problems.append(f"Markov head {config['markov_head_type']!r}")
    if fmt == "dspark" and config.get("enable_confidence_head") and not config.get("confidence_head_with_markov"):
        problems.append("a confidence head that does not read the Markov embedding")
    if config.get("attention_bias") or inner.get("use_swa") or config.get("layer_types"):
        problems.append("attention bias or sliding-window layers")
    if problems:
        raise SpecDecodeError(f"drafter {path} cannot be loaded for {target.name}: {'; '.join(problems)}")
    extra = config.get("specdecode", {})
    rope = config.get("rope_parameters") or {}
    return DSparkConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_heads=config["num_attention_heads"],
        num_kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        vocab_size=vocab,
        target_layer_ids=list(layer_ids),
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 1e6)),
        num_layers=config["num_hidden_layers"],
        block_size=config["block_size"],
        mask_token_id=mask_id if mask_id < vocab else None,
        draft_vocab_size=draft_vocab if draft_vocab < vocab else 0,
        markov_rank=config.get("markov_rank", 0) if fmt == "dspark" else 0,
        confidence_head=fmt == "dspark" and bool(config.get("enable_confidence_head")),
        sample_from_anchor=fmt == "dspark" and config.get("sample_from_anchor", True),
        calibration_temperatures=list(extra.get("calibration_temperatures", [])),
        calibration_biases=list(extra.get("calibration_biases", [])),
        greedy_calibration_temperatures=list(extra.get("greedy_calibration_temperatures", [])),
        greedy_calibration_biases=list(extra.get("greedy_calibration_biases", [])),
    )


def load_engine_drafter(path: str | Path, target: Target) -> BlockDrafter:
    """A block drafter from a vLLM-format folder (ours exported, or another tool's of the same design)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    expected = config.get("specdecode", {}).get("target", {}).get("fingerprint")
    if expected is not None and expected != target.fingerprint():
        name = config["specdecode"]["target"].get("name")
        raise SpecDecodeError(f"drafter {path} was exported for target '{name}', not for '{target.name}'")
    c = import_config(config, target, path)
    engine = read_weights(path)
    embedding = target.model.get_input_embeddings().weight.detach()
    own = engine.pop("embed_tokens.weight", None)
    if own is not None and not torch.allclose(own[: c.vocab_size].float(), embedding.float().cpu(), atol=1e-2):
        raise SpecDecodeError(
            f"drafter {path} has its own input embedding; specdecode's block drafters share the target's"
        )
    if c.draft_vocab_size:
        if "d2t" not in engine or "lm_head.weight" not in engine:
            raise SpecDecodeError(f"drafter {path} has a reduced draft vocabulary but no lm_head weight or d2t map")
        draft_ids = engine.pop("d2t").long() + torch.arange(c.draft_vocab_size)
        engine.pop("t2d", None)
        if not bool(((draft_ids >= 0) & (draft_ids < c.vocab_size)).all()):
            raise SpecDecodeError(f"drafter {path} is broken: its d2t map names ids outside the target's vocabulary")
        engine["d2t"], engine["t2d"] = vocab_maps(draft_ids, c.vocab_size)
    weights = {our_key(k): (v.float() if v.is_floating_point() else v) for k, v in engine.items()}
    if c.mask_token_id is None:  # the mask is a row past the target's vocabulary: our learned mask vector
        mask_id = (config.get("dflash_config") or {}).get("mask_token_id", config.get("mask_token_id"))
        if own is None or own.shape[0] <= mask_id:
            raise SpecDecodeError(f"drafter {path} names mask token {mask_id} but ships no embedding row for it")
        weights["mask_embedding"] = own[mask_id].float()
    if "markov.w1.weight" in weights:
        weights["markov.w1.weight"] = weights["markov.w1.weight"][: c.vocab_size]
    model = DSparkModel(c, target.model.get_input_embeddings(), target.output_head())
    load_state(model, weights, path)
    if not model.vocab_maps_agree():
        raise SpecDecodeError(f"drafter {path} is broken: its d2t map is not an increasing set of target ids")
    return BlockDrafter(frozen(model, c.kind, target))

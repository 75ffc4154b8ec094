"""Drafter recipes: build a fresh drafter for a target, shaped like the target, with the papers' defaults.

DSpark and DFlash are one model (`DSparkModel`); DFlash is the configuration with the Markov head and the
confidence head off and a cross-entropy-only loss, as DeepSpec trains its DFlash baseline.
"""

from specdecode.drafters.dspark import DSparkConfig, DSparkModel
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target

DRAFTER_KINDS = ("dspark", "dflash")


def default_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """DFlash's rule: `count` output-of-layer ids spread evenly from layer 1 to layer L-3."""
    if count == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]


def build_block_drafter(
    kind: str,
    target: Target,
    num_layers: int = 2,
    block_size: int = 7,
    markov_rank: int = 64,
    markov_head_type: str = "vanilla",
    target_layer_ids: list[int] | None = None,
    num_anchors: int = 32,
) -> DSparkModel:
    if kind not in DRAFTER_KINDS:
        raise SpecDecodeError(f"unknown drafter kind '{kind}'; choose one of {', '.join(DRAFTER_KINDS)}")
    c = target.config
    dspark = kind == "dspark"
    config = DSparkConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_heads=c.num_attention_heads,
        num_kv_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size,
        target_layer_ids=target_layer_ids or default_layer_ids(c.num_hidden_layers),
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]),
        num_layers=num_layers,
        block_size=block_size,
        markov_rank=markov_rank if dspark else 0,
        markov_head_type=markov_head_type,
        confidence_head=dspark,
        num_anchors=num_anchors,
    )
    return DSparkModel(config, target.model.get_input_embeddings(), target.model.get_output_embeddings())

"""Drafter recipes: build a fresh drafter for a target, shaped like the target, with the papers' defaults.

DSpark and DFlash are one model (`DSparkModel`); DFlash is the configuration with the Markov head and the
confidence head off and a cross-entropy-only loss, as DeepSpec trains its DFlash baseline.

EAGLE-3 (`Eagle3Model`) is DeepSpec's EAGLE-3 baseline: one layer, 7 TTT steps, step weights 0.8^j, the
same target layers as DFlash/DSpark (here three of their five, so one feature cache serves all three) and
the same optimiser settings (the trainer's defaults: AdamW lr 6e-4, warm-up 4%, cosine, clip 1.0). One
change: a reduced draft vocabulary (DEFAULT_DRAFT_VOCAB) instead of DeepSpec's full one, as EAGLE-3 and
SpecForge do; its final norm and LM head start as the target's (rows of the drafted tokens), not at random.
"""

import torch

from specdecode.drafters.dspark import DSparkConfig, DSparkModel
from specdecode.drafters.eagle3 import Eagle3Config, Eagle3Model
from specdecode.errors import SpecDecodeError
from specdecode.models.target import Target
from specdecode.training.data import Example

DRAFTER_KINDS = ("dspark", "dflash")
TRAINABLE_KINDS = (*DRAFTER_KINDS, "eagle3")
# SmolLM2's 49,152-token vocabulary against the ~500-conversation training mix: the answers use ~3.8k distinct
# tokens; the top 8192 (by frequency, then the lower BPE id) cover 96.7% of held-out answer tokens (4096: 94.7%,
# 16384: 98.2%), with an LM head of 4.7M parameters instead of 28M for the full vocabulary. `specdecode train`'s
# default for every kind; 0 gives a block drafter the target's whole vocabulary through its shared LM head.
DEFAULT_DRAFT_VOCAB = 8192


def default_layer_ids(num_target_layers: int, count: int = 5) -> list[int]:
    """DFlash's rule: `count` output-of-layer ids spread evenly from layer 1 to layer L-3."""
    if count == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (count - 1)) for i in range(count)]


def target_shape(c) -> dict:
    """The target config's numbers a drafter copies (a drafter layer is shaped like a target layer)."""
    return {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_heads": c.num_attention_heads,
        "num_kv_heads": c.num_key_value_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]),
    }


def eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """Low, middle and high: the first, middle and last of DFlash's five ([1, 14, 27] for SmolLM2's 30)."""
    return default_layer_ids(num_target_layers)[::2]


def recipe_layer_ids(kind: str, num_target_layers: int) -> list[int]:
    """The target layers a fresh drafter of `kind` reads when none are given."""
    return eagle3_layer_ids(num_target_layers) if kind == "eagle3" else default_layer_ids(num_target_layers)


# the least value of each architecture setting, and the flag of `specdecode train` that sets it
LEAST_SETTINGS = {
    "num_layers": (1, "--layers"),
    "block_size": (1, "--block-size"),
    "markov_rank": (0, "--markov-rank"),
    "num_anchors": (1, "--anchors"),
    "draft_vocab_size": (0, "--draft-vocab"),
    "ttt_steps": (1, "--ttt-steps"),
}


def check_architecture(kind: str, architecture: dict) -> None:
    """Raise `SpecDecodeError` for a setting no drafter of `kind` can have (a run would fail on a tensor shape, or
    train a drafter with no layers, only after loading the target)."""
    least = dict(LEAST_SETTINGS)
    if kind == "eagle3":
        least["num_anchors"] = (0, "--anchors")  # 0: every position is unrolled
    if architecture.get("sample_from_anchor") is False:
        least["block_size"] = (2, "--block-size")  # the mask slots alone predict: B - 1 drafts
    for name, value in architecture.items():
        if name in least and value < least[name][0]:
            low, flag = least[name]
            raise SpecDecodeError(f"{flag} must be >= {low}, got {value}")


def build_block_drafter(
    kind: str,
    target: Target,
    num_layers: int = 2,
    block_size: int = 7,
    markov_rank: int = 64,
    markov_head_type: str = "vanilla",
    target_layer_ids: list[int] | None = None,
    num_anchors: int = 32,
    sample_from_anchor: bool = True,
    examples: list[Example] | None = None,
    draft_vocab_size: int = 0,
) -> DSparkModel:
    """A fresh DSpark/DFlash drafter: with the target's whole vocabulary (0), or with `draft_vocab_size` of the
    tokens most frequent in `examples` (the training set) and its own LM head, started as the target's rows."""
    if kind not in DRAFTER_KINDS:
        raise SpecDecodeError(f"unknown drafter kind '{kind}'; choose one of {', '.join(DRAFTER_KINDS)}")
    c = target.config
    dspark = kind == "dspark"
    config = DSparkConfig(
        **target_shape(c),
        target_layer_ids=target_layer_ids or default_layer_ids(c.num_hidden_layers),
        num_layers=num_layers,
        block_size=block_size,
        markov_rank=markov_rank if dspark else 0,
        markov_head_type=markov_head_type,
        confidence_head=dspark,
        num_anchors=num_anchors,
        sample_from_anchor=sample_from_anchor,
    )
    head = target.output_head()
    if not draft_vocab_size:
        return DSparkModel(config, target.model.get_input_embeddings(), head)
    if draft_vocab_size < 0 or not examples:
        raise SpecDecodeError(
            f"a draft vocabulary of {draft_vocab_size} tokens needs >= 0 tokens and training examples"
        )
    draft_ids = draft_vocabulary(examples, c.vocab_size, draft_vocab_size)
    config.draft_vocab_size = len(draft_ids)
    model = DSparkModel(config, target.model.get_input_embeddings(), head, draft_ids)
    with torch.no_grad():
        model.lm_head.weight.copy_(head.weight[draft_ids.to(head.weight.device)])
    return model


def draft_vocabulary(examples: list[Example], vocab_size: int, size: int) -> torch.Tensor:
    """Sorted target ids of the `size` most frequent loss-masked (answer) tokens; ties go to the lower id
    (an earlier BPE merge, usually the more common token), so slots the data leaves open get likely tokens."""
    if size < 1:
        raise SpecDecodeError(f"the draft vocabulary needs at least one token, got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for example in examples:
        counts += torch.bincount(example.input_ids[example.loss_mask], minlength=vocab_size)[:vocab_size]
    return torch.sort(-counts, stable=True).indices[: min(size, vocab_size)].sort().values


def build_eagle3_drafter(
    target: Target,
    examples: list[Example],
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB,
    ttt_steps: int = 7,
    target_layer_ids: list[int] | None = None,
    num_anchors: int = 32,
) -> Eagle3Model:
    """A fresh EAGLE-3 drafter whose draft vocabulary is counted on `examples` (the training set)."""
    check_architecture("eagle3", {"ttt_steps": ttt_steps, "num_anchors": num_anchors})
    c = target.config
    draft_ids = draft_vocabulary(examples, c.vocab_size, draft_vocab_size)
    config = Eagle3Config(
        **target_shape(c),
        draft_vocab_size=len(draft_ids),
        target_layer_ids=target_layer_ids or eagle3_layer_ids(c.num_hidden_layers),
        ttt_steps=ttt_steps,
        num_anchors=num_anchors,
    )
    head = target.output_head()
    model = Eagle3Model(config, target.model.get_input_embeddings(), head, draft_ids)
    with torch.no_grad():  # start as the target's own read-out, restricted to the draft vocabulary
        model.norm.weight.copy_(target.model.model.norm.weight)
        model.lm_head.weight.copy_(head.weight[draft_ids.to(head.weight.device)])
    return model

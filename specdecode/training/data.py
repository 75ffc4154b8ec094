"""Regenerated conversations -> token ids and a loss mask that covers the assistant's tokens only.

The drafter learns to predict the target's answers, not the user's words or the chat template's
markup, so only tokens the target itself wrote (plus its end-of-turn token) are supervised.
"""

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from specdecode.errors import SpecDecodeError


@dataclass
class Example:
    id: str
    input_ids: torch.Tensor  # (T,) long
    loss_mask: torch.Tensor  # (T,) bool: True where the token is part of an assistant answer


def _template_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict], generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, conversation_id: str, messages: list[dict], max_length: int
) -> Example:
    """Whole-conversation ids; each assistant span is found by rendering the chat up to it."""
    if not messages:
        raise SpecDecodeError(f"conversation {conversation_id} has no messages")
    ids = _template_ids(tokenizer, messages, generation_prompt=False)
    mask = torch.zeros(len(ids), dtype=torch.bool)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_template_ids(tokenizer, messages[:i], generation_prompt=True))
        end = len(_template_ids(tokenizer, messages[: i + 1], generation_prompt=False))
        mask[start:end] = True
    ids_tensor = torch.tensor(ids[:max_length], dtype=torch.long)
    return Example(conversation_id, ids_tensor, mask[:max_length])

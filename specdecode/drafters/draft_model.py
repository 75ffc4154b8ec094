"""An independent small causal LM that shares the target's tokenizer, sampling with full q.

The classic speculative-decoding drafter (Leviathan et al.; Chen et al.). No smaller model with
SmolLM2's tokenizer exists offline, so by default the drafter is a layer-truncated copy of the target
(its first `layers` decoder layers, final norm and LM head): a real, separately run LM, not a trained
head. Any HF folder or registry name with the same vocabulary can be used instead.
"""

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specdecode.drafters.base import Drafter, Proposal, TargetFeatures
from specdecode.errors import SpecDecodeError
from specdecode.models import registry
from specdecode.models.target import Target, first_line
from specdecode.sampling import SamplingParams, probabilities, sample

DEFAULT_TRUNCATED_LAYERS = 4


def _load_error(model_name: str, source: str, error: Exception) -> SpecDecodeError:
    return SpecDecodeError(f"could not load draft model '{model_name}' from {source} ({first_line(error)})")


class DraftModelDrafter(Drafter):
    name = "draft-model"

    def __init__(self, target: Target, model_name: str | None = None, layers: int = DEFAULT_TRUNCATED_LAYERS):
        if model_name is None:  # share the target's own tensors: no second copy in memory
            config = copy.deepcopy(target.config)
            config.num_hidden_layers = layers
            model = AutoModelForCausalLM.from_config(config, dtype=target.model.dtype)
            model.load_state_dict(target.model.state_dict(), strict=False, assign=True)
            model.tie_weights()
        else:
            source = registry.resolve(model_name)
            try:
                config = AutoConfig.from_pretrained(source)
            except Exception as e:  # no network for a hub id, a broken config.json, ...
                raise _load_error(model_name, source, e) from e
            if config.vocab_size != target.vocab_size:
                raise SpecDecodeError(
                    f"draft model {model_name} has a vocabulary of {config.vocab_size} tokens but the target "
                    f"{target.name} has {target.vocab_size}: a draft model must share the target's tokenizer"
                )
            try:
                model = AutoModelForCausalLM.from_pretrained(source, dtype=target.model.dtype)
            except Exception as e:  # missing or corrupt weights surface as many different errors
                raise _load_error(model_name, source, e) from e
        self.description = f"{model_name}" if model_name else f"first {layers} layers of {target.name}"
        # run like the target: the same runner, kernels and cache, one request at a time
        self.draft = Target(model.to(target.device), target.tokenizer, name=self.description, kernel=target.kernel)
        self._owner: DraftModelDrafter | None = None  # the instance whose request the draft's cache holds
        self._cached: list[int] = []  # the tokens whose keys and values the draft's cache holds

    def begin(self, prompt_ids, params: SamplingParams, generator: torch.Generator, features) -> None:
        self.params = params
        self.generator = generator
        if self._owner is not self:  # a per-request copy (the continuous engine): a cache of its own
            self.draft = copy.copy(self.draft)
            self.draft.kv = self.draft.new_cache(1, self.draft.kv.capacity)
            self.draft.reset()
            self._owner, self._cached = self, []
        # another sample of the same prompt (or a conversation's next turn) keeps what the cache shares with it
        held = self._cached[: self.draft.cache_length]
        shared = len(held)
        for i, (a, b) in enumerate(zip(held, prompt_ids, strict=False)):
            if a != b:
                shared = i
                break
        self.draft.rollback(min(shared, len(prompt_ids) - 1))  # the last prompt token is fed by the first propose

    @torch.inference_mode()
    def propose(self, ids: list[int], max_tokens: int) -> Proposal:
        if max_tokens <= 0:
            return Proposal(tokens=torch.empty(0, dtype=torch.long))
        pending = ids[self.draft.cache_length :]  # committed tokens the draft has not seen yet
        self._cached = list(ids)  # after the loop the cache holds ids and all drafts but the last
        tokens, dists = [], []
        for _ in range(max_tokens):
            logits = self.draft.forward(torch.tensor(pending)).logits[-1]
            q = probabilities(logits, self.params)
            token = int(q.argmax()) if self.params.greedy else sample(q, self.generator)
            tokens.append(token)
            dists.append(q)
            pending = [token]
        self._cached += tokens[:-1]
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long), probs=torch.stack(dists))

    def observe(self, ids: list[int], num_accepted: int, features: TargetFeatures | None) -> None:
        # cache = committed-before-round + drafts 1..k-1; drafts past the first rejection are stale
        self.draft.rollback(len(ids) - 1)

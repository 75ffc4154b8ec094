"""Shared fixtures: the real default target (loaded once) and tiny random models for model-free behaviour."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specdecode.errors import SpecDecodeError
from specdecode.models import registry
from specdecode.models.linear import EIGHT_BIT_INPUTS, cpu_kernels_available
from specdecode.models.target import Target


def _measurements_apart() -> None:
    """Tests measure this machine as they run (kernel plans, verify-cost tables, a hybrid's round costs), under a
    test session's load and with its threads about; cached where `specdecode` keeps them, those tables became
    what every later run on the machine priced its drafts with (stop 57: a session's table put a four-position
    pass at 1.71 one-position passes at 256 cached tokens; results/team_pass_ab.md: 1.49 at 128, 1.62 at 512).
    The session keeps its measurements in a cache root of its own and shares only the built artifacts
    (converted models, compiled kernels)."""
    if os.environ.get("SPECDECODE_TESTS_CACHE"):  # this module imported again, or a test's subprocess: set up
        return
    real = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdecode"
    root = Path(tempfile.mkdtemp(prefix="specdecode-tests-"))
    os.environ["SPECDECODE_TESTS_CACHE"] = str(root)
    for shared in ("models", "kernels", "gguf"):
        (real / shared).mkdir(parents=True, exist_ok=True)
        (root / "specdecode").mkdir(exist_ok=True)
        (root / "specdecode" / shared).symlink_to(real / shared, target_is_directory=True)
    os.environ["XDG_CACHE_HOME"] = str(root)  # read at each use (specdecode/paths.py), by subprocesses too
    atexit.register(shutil.rmtree, root, ignore_errors=True)


_measurements_apart()
needs_q8_rows = pytest.mark.skipif(
    not cpu_kernels_available() or not torch.ops.specdecode.q8_rows_available(), reason="no AVX2 kernels"
)


@pytest.fixture(scope="session")
def smollm2() -> Target:
    """The real default target; tests that need it share one instance (and reset its cache)."""
    return Target.load("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2) -> Target:
    """The default target in float32 with float32 inputs to every linear (the same instance where the machine
    chose that), for comparisons that hold two computations to float32 rounding: with the HF forward, or a tree
    pass against a causal one (where the linears round their rows, to bfloat16 or to 8 bits, an ulp of
    difference grows over 30 layers)."""
    if smollm2.dtype == torch.float32 and not smollm2.rounds_inputs:
        return smollm2
    target = Target.load("smollm2-135m", dtype=torch.float32)
    if target.runner is not None:
        keep_float_inputs(target)
    return target


def keep_float_inputs(target: Target) -> None:
    """Every linear of `target` on the fastest kernel of float32 inputs its plan timed at each row count
    (`few-rows-gguf` where the 8-bit-input kernel was forced and nothing was timed), and a KV cache of the
    weights' dtype."""
    timings = target.runner.kernel_plan["timings"]
    for lin in target.runner.linears():
        for bucket, kernel in lin.plan.items():
            if kernel == EIGHT_BIT_INPUTS:
                timed = {k: ms for k, ms in timings.get(bucket, timings.get(str(bucket), {})).items() if k != kernel}
                lin.plan[bucket] = min(timed, key=timed.get) if timed else "few-rows-gguf"
                if lin.plan[bucket] == "onednn":
                    lin.pack_onednn()
    target.runner.cache_dtype = target.dtype  # not the bfloat16 entries kept beside 8-bit inputs
    target.kv = target.new_cache(1, target.kv.capacity)


@pytest.fixture(scope="session")
def converted_target() -> str:
    """The default target, converted once and its runner's kernels built and timed for the CLI's thread
    count: a first run on a machine prints a progress note for each, which the one-line checks must not see
    (they run without a drafter's measurements: `--drafter none`, `ngram`, or one that fails to build)."""
    from tests.test_cli_errors import run_cli

    try:
        source = registry.resolve(registry.DEFAULT_TARGET)
    except SpecDecodeError as e:
        pytest.skip(f"default target not available: {e}")
    first = run_cli("generate", "hi", "--max-new-tokens", "1", "--drafter", "none")
    assert first.returncode == 0, first.stderr
    return source


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tokens t0..t{V-1}; t0 is EOS."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t0", unk_token="t1")


def tiny_llama(vocab_size: int = 24, layers: int = 2, hidden: int = 32, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper logits than the default init, so distributions are not near-uniform
        model.lm_head.weight.mul_(20)
    return model.eval()


def tiny_target(vocab_size: int = 24, seed: int = 0, kernel: str = "auto") -> Target:
    return Target(tiny_llama(vocab_size, seed=seed), tiny_tokenizer(vocab_size), name="tiny", kernel=kernel)

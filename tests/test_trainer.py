"""The trainer's promises: schedule, exact resume after SIGKILL and SIGTERM, DDP = gradient accumulation,
and the offline feature cache serving what the target computes.

Run as a module (`python -m tests.test_trainer OUT_DIR GRAD_ACCUM STEP_DELAY_S [VANISH_AT]`) this file trains the
tiny stand-in drafter, so the tests can kill, signal and restart real training processes (and run it under
torchrun; with VANISH_AT, rank 1 exits without a word at its VANISH_AT-th micro-batch).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import namedtuple
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.training import features as features_module
from specdecode.training.data import Example
from specdecode.training.features import (
    OfflineFeatures,
    OnlineFeatures,
    collate,
    estimate_cache_bytes,
    write_feature_cache,
)
from specdecode.training.trainer import TrainConfig, clock_lr, lr_at, train
from tests.conftest import tiny_target

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, VOCAB, LAYERS = 8, 16, 2
STEPS = 12  # 24 examples, global batch 4: two epochs of six steps


class TinyDrafter(nn.Module):
    """Next-token CE from the features; a random quarter of positions is dropped, so the generator matters."""

    def __init__(self, step_delay_s: float = 0.0, vanish_at: int | None = None) -> None:
        super().__init__()
        self.mix = nn.Linear(LAYERS * HIDDEN, HIDDEN, bias=False)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.frozen = nn.Embedding(VOCAB, HIDDEN).requires_grad_(False)  # like the copied target embedding
        self.step_delay_s = step_delay_s  # slows the subprocess runs down enough to interrupt them
        self.vanish_at = vanish_at  # rank 1 dies silently here: a peer that is gone
        self.calls = 0

    def training_losses(self, batch, generator: torch.Generator) -> dict[str, torch.Tensor]:
        time.sleep(self.step_delay_s)
        self.calls += 1
        if self.calls == self.vanish_at and os.environ.get("RANK") == "1":
            os._exit(0)
        dtype = self.head.weight.dtype
        h = batch.last_hidden.to(dtype) + self.mix(batch.layer_hidden.to(dtype)) + self.frozen(batch.input_ids)
        logits = self.head(h[:, :-1]).float()
        labels = batch.input_ids[:, 1:]
        mask = batch.loss_mask[:, 1:] & (torch.rand(labels.shape, generator=generator) > 0.25)
        loss = F.cross_entropy(logits[mask], labels[mask])
        acc = (logits[mask].argmax(-1) == labels[mask]).float().mean()
        return {"loss": loss, "acc": acc}


class FakeFeatures:
    """Fixed pseudo-random hidden states per token id: features without a model."""

    def __init__(self) -> None:
        self.table = torch.randn(VOCAB, (LAYERS + 1) * HIDDEN, generator=torch.Generator().manual_seed(0))

    def batch(self, examples: list[Example]):
        rows = [self.table[e.input_ids] for e in examples]
        return collate(examples, [r[:, : LAYERS * HIDDEN] for r in rows], [r[:, LAYERS * HIDDEN :] for r in rows])


def tiny_examples(n: int, seed: int) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    examples = []
    for i in range(n):
        length = int(torch.randint(6, 13, (1,), generator=g))
        mask = torch.arange(length) >= length // 3  # a "prompt" third, then the supervised "answer"
        examples.append(Example(f"ex{seed}-{i}", torch.randint(0, VOCAB, (length,), generator=g), mask))
    return examples


def run_tiny_training(
    out_dir, grad_accum: int = 2, step_delay_s: float = 0.0, dtype=torch.float32, vanish_at=None, **overrides
):
    torch.manual_seed(0)
    model = TinyDrafter(step_delay_s, vanish_at).to(dtype)
    config = dict(lr=3e-2, micro_batch_size=2, grad_accum=grad_accum, max_steps=STEPS, warmup_ratio=0.25)
    config.update(save_every=3, eval_every=4, eval_examples=4, **overrides)
    return train(model, tiny_examples(24, 1), tiny_examples(6, 2), FakeFeatures(), TrainConfig(**config), out_dir)


def losses(out_dir: Path) -> list[tuple[int, bool, float]]:
    lines = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("eval", False), r["loss"]) for r in lines]


def assert_same_curve(actual: list, expected: list, tol: float) -> None:
    assert [(s, e) for s, e, _ in actual] == [(s, e) for s, e, _ in expected]
    torch.testing.assert_close(torch.tensor([x for *_, x in actual]), torch.tensor([x for *_, x in expected]),
                               rtol=0, atol=tol)  # fmt: skip


def latest_step(out_dir: Path) -> int | None:
    latest = out_dir / "latest"
    return int(latest.read_text().strip().split("-")[1]) if latest.exists() else None


def logged_step(out_dir: Path) -> int:
    try:
        return max((s for s, e, _ in losses(out_dir) if not e), default=0)
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def start_training(
    out_dir: Path, grad_accum: int, step_delay_s: float, nproc: int = 1, vanish_at: int | None = None
) -> subprocess.Popen:
    """The training subprocess, in a session of its own so a test that gives up can kill all of it."""
    args = ["-m", "tests.test_trainer", str(out_dir), str(grad_accum), str(step_delay_s)]
    args += [] if vanish_at is None else [str(vanish_at)]
    if nproc > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port), *args]
    log = open(out_dir.parent / f"{out_dir.name}.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def finish(process: subprocess.Popen, out_dir: Path, timeout_s: float) -> tuple[int, str]:
    """The exit status and log of a training run; one still running after `timeout_s` is a failed test, and
    its whole process group (torchrun's launcher and every rank) is killed first, so nothing outlives it."""
    log = out_dir.parent / f"{out_dir.name}.log"
    try:
        return process.wait(timeout=timeout_s), log.read_text()
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"training still running after {timeout_s:g} s (killed its process group):\n{log.read_text()}")


def wait_until(condition, process: subprocess.Popen, out_dir: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail("training ended or hung too early:\n" + (out_dir.parent / f"{out_dir.name}.log").read_text())
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[tuple[int, bool, float]]:
    """One uninterrupted single-process run with grad_accum=2: the curve every other run must reproduce."""
    out_dir = tmp_path_factory.mktemp("reference")
    result = run_tiny_training(out_dir)
    curve = losses(out_dir)
    assert [s for s, e, _ in curve if not e] == list(range(1, STEPS + 1))
    assert [s for s, e, _ in curve if e] == [4, 8, 12]
    assert result["step"] == STEPS and not result["interrupted"] and result["eval"]["step"] == STEPS
    return curve


def test_schedule_warms_up_linearly_then_decays_by_cosine():
    config = TrainConfig(lr=1.0, warmup_ratio=0.1)
    assert [lr_at(s, 100, config) for s in (0, 4, 9, 10)] == pytest.approx([0.1, 0.5, 1.0, 1.0])
    assert lr_at(55, 100, config) == pytest.approx(0.5)  # half-way through the cosine
    assert 0 < lr_at(99, 100, config) < 1e-3  # the last step still learns a little
    floor = TrainConfig(lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert lr_at(55, 100, floor) == pytest.approx(0.55)


def test_a_time_budget_schedules_by_the_clock():
    config = TrainConfig(lr=1.0, warmup_ratio=0.1, max_time_s=200.0)
    assert [clock_lr(t, config) for t in (0.0, 9.9, 19.9, 20.0)] == pytest.approx([0.01, 0.5, 1.0, 1.0])
    assert clock_lr(110.0, config) == pytest.approx(0.5)  # half-way through the cosine
    assert 0 < clock_lr(199.9, config) == clock_lr(500.0, config) < 1e-4  # past the budget: the last slice's
    with pytest.raises(SpecDecodeError, match="must be positive"):
        TrainConfig(max_time_s=0)


def test_a_run_on_a_time_budget_ends_when_it_is_spent(tmp_path):
    """Steps of ~0.1 s, a 0.6 s budget and room for 1,000 steps: the run ends, finished and saved, at the first
    step that starts after 0.6 s, its learning rate down to the cosine's end; run again, it has nothing to do."""
    result = run_tiny_training(tmp_path, grad_accum=1, step_delay_s=0.1, max_steps=1000, max_time_s=0.6)
    logged = (tmp_path / "metrics.jsonl").read_text()
    steps = [r for r in map(json.loads, logged.splitlines()) if not r.get("eval")]
    assert not result["interrupted"] and 1 < result["step"] <= 7 and result["step"] == steps[-1]["step"]
    assert all(r["elapsed"] < 0.6 for r in steps[:-2])  # so the second to last step started within the budget
    assert steps[-1]["lr"] < 1e-4 * 3e-2  # and the last past it: the cosine's end
    lrs = [r["lr"] for r in steps]
    peak = lrs.index(max(lrs))  # up through the warm-up (the first quarter of the time), then down
    assert lrs[: peak + 1] == sorted(lrs[: peak + 1]) and lrs[peak:] == sorted(lrs[peak:], reverse=True)
    assert latest_step(tmp_path) == result["step"] and result["eval"]["step"] == result["step"]
    again = run_tiny_training(tmp_path, grad_accum=1, step_delay_s=0.1, max_steps=1000, max_time_s=0.6)
    assert again["step"] == result["step"] and not again["interrupted"]
    assert (tmp_path / "metrics.jsonl").read_text() == logged  # no step ran again


def test_checkpoint_holds_trainable_fp32_weights_and_keeps_the_last_two(tmp_path):
    result = run_tiny_training(tmp_path, dtype=torch.bfloat16, max_steps=7)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000006", "step-00000007"]
    assert (tmp_path / "latest").read_text().strip() == "step-00000007"
    weights = load_file(tmp_path / "step-00000007" / "weights.safetensors")
    assert set(weights) == {"mix.weight", "head.weight", "head.bias"}  # the frozen embedding is not saved
    assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 masters of the bf16 module
    assert result["step"] == 7 and {"loss", "acc", "grad_norm", "lr", "tokens_per_s"} <= set(result)


def test_bad_runs_are_refused(tmp_path):
    with pytest.raises(SpecDecodeError, match="do not fill one global batch"):
        train(TinyDrafter(), tiny_examples(3, 1), [], FakeFeatures(), TrainConfig(micro_batch_size=4), tmp_path)
    run_tiny_training(tmp_path, max_steps=3)
    with pytest.raises(SpecDecodeError, match="lr: 0.03 -> 0.01"):
        run_tiny_training(tmp_path, max_steps=3, lr=1e-2)


def test_bfloat16_precision_runs_the_products_in_bfloat16_on_float32_weights(tmp_path, reference):
    run_tiny_training(tmp_path, precision="bfloat16")
    curve = losses(tmp_path)
    assert [(s, e) for s, e, _ in curve] == [(s, e) for s, e, _ in reference]
    gaps = [abs(a - b) for (*_, a), (*_, b) in zip(curve, reference, strict=True)]
    assert 0 < max(gaps) < 0.05  # rounded products, not another computation
    weights = load_file(tmp_path / "step-00000012" / "weights.safetensors")
    assert all(w.dtype == torch.float32 for w in weights.values())
    with pytest.raises(SpecDecodeError, match="precision: bfloat16 -> float32"):
        run_tiny_training(tmp_path)  # a run resumes in the precision it was started in
    with pytest.raises(SpecDecodeError, match="unknown training precision 'fp8'"):
        run_tiny_training(tmp_path / "other", precision="fp8")


def test_sigkill_then_restart_continues_the_curve_exactly(tmp_path, reference):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    process = start_training(out_dir, grad_accum=2, step_delay_s=0.1)
    # kill once a checkpoint exists and a step after it was logged: the restart must drop and redo that step
    wait_until(lambda: (latest_step(out_dir) or STEPS) < logged_step(out_dir), process, out_dir)
    process.kill()
    process.wait()
    assert latest_step(out_dir) < STEPS
    run_tiny_training(out_dir)
    assert_same_curve(losses(out_dir), reference, tol=1e-6)


def test_sigterm_saves_exits_cleanly_and_resumes(tmp_path, reference):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    process = start_training(out_dir, grad_accum=2, step_delay_s=0.1)
    wait_until(lambda: logged_step(out_dir) >= 4, process, out_dir)
    process.terminate()
    assert finish(process, out_dir, timeout_s=30)[0] == 0
    stopped = latest_step(out_dir)
    assert stopped == logged_step(out_dir) < STEPS  # saved at the step boundary after the signal
    run_tiny_training(out_dir)
    assert_same_curve(losses(out_dir), reference, tol=1e-6)


def test_two_ddp_processes_equal_one_process_accumulating_two_micro_batches(tmp_path, reference):
    out_dir = tmp_path / "ddp"
    out_dir.mkdir()
    process = start_training(out_dir, grad_accum=1, step_delay_s=0.0, nproc=2)
    status, log = finish(process, out_dir, timeout_s=300)
    assert status == 0, log
    assert_same_curve(losses(out_dir), reference, tol=1e-5)


def test_a_rank_whose_peer_vanished_fails_with_one_clear_error(tmp_path):
    """Rank 1 exits mid-run without a word: rank 0 must fail (not hang), say why, and torchrun exit non-zero."""
    out_dir = tmp_path / "ddp"
    out_dir.mkdir()
    # rank 1's 6th micro-batch is step 5's (the step-4 eval ran one)
    process = start_training(out_dir, grad_accum=1, step_delay_s=0.0, nproc=2, vanish_at=6)
    status, log = finish(process, out_dir, timeout_s=120)
    assert status != 0, log
    assert "rank 0 of 2 failed at step 5" in log, log
    assert latest_step(out_dir) == 3  # the checkpoint before the failure is there to resume from


def test_offline_cache_serves_what_the_target_computes(tmp_path, monkeypatch):
    target = tiny_target()
    layer_ids = [-1, 0]
    examples = tiny_examples(5, 3)
    online = OnlineFeatures(target, layer_ids).batch(examples)
    target.reset()  # the cache-free pass equals the decoding pass
    torch.testing.assert_close(online.last_hidden[0, : len(examples[0].input_ids)],
                               target.forward(examples[0].input_ids, logits=False).last_hidden)  # fmt: skip

    write_feature_cache(target, layer_ids, examples[:2], tmp_path, shard_tokens=16)
    write_feature_cache(target, layer_ids, examples, tmp_path, shard_tokens=16)  # resumes: writes the other three
    index = json.loads((tmp_path / "index.json").read_text())
    assert sorted(e["id"] for e in index["examples"]) == sorted(e.id for e in examples)
    shards = {e["shard"] for e in index["examples"]}
    assert len(shards) >= 3
    on_disk = sum(p.stat().st_size for p in tmp_path.glob("shard-*.npy"))
    estimate = estimate_cache_bytes(examples, len(layer_ids), target.config.hidden_size)
    assert estimate <= on_disk <= estimate + 6 * len(shards) * 256  # npy headers only

    cache = OfflineFeatures(tmp_path, layer_ids)
    offline = cache.batch(examples)
    assert online.target_log_z is None  # the teacher statistics exist only in the cache
    for field in fields(offline):
        if getattr(online, field.name) is not None:
            torch.testing.assert_close(getattr(offline, field.name), getattr(online, field.name), rtol=1e-3, atol=1e-3)
    logits = target.model.get_output_embeddings()(online.last_hidden).float()
    # computed from the cached float16 states (the input the teacher reads), so within float16 rounding
    torch.testing.assert_close(
        offline.target_log_z * online.attention_mask, logits.logsumexp(-1) * online.attention_mask, rtol=1e-3, atol=1e-2
    )
    assert [(e.id, e.input_ids.tolist(), e.loss_mask.tolist()) for e in cache.examples()] == [
        (e.id, e.input_ids.tolist(), e.loss_mask.tolist()) for e in examples
    ]

    with pytest.raises(SpecDecodeError, match="target layers"):
        OfflineFeatures(tmp_path, [0])
    with pytest.raises(SpecDecodeError, match="not in the feature cache"):
        cache.batch(tiny_examples(1, 9))
    with pytest.raises(SpecDecodeError, match="layer_ids"):
        write_feature_cache(target, [0], examples, tmp_path)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(features_module.shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(SpecDecodeError, match="free"):
        write_feature_cache(target, layer_ids, tiny_examples(4, 4), tmp_path / "other")


def test_online_features_on_an_accelerator_are_one_padded_pass_with_the_per_sequence_values(monkeypatch):
    """Off the CPU a batch is one right-padded pass; a causal model's real positions cannot see the padding."""
    target = tiny_target()
    examples = tiny_examples(4, 5)
    per_sequence = OnlineFeatures(target, [-1, 0]).batch(examples)
    monkeypatch.setattr(target, "device", torch.device("meta"))  # takes the accelerator branch; runs on the CPU
    padded = OnlineFeatures(target, [-1, 0]).batch(examples)
    assert len({len(e.input_ids) for e in examples}) > 1  # the batch really is padded
    for field in fields(padded):
        if getattr(padded, field.name) is not None:
            torch.testing.assert_close(getattr(padded, field.name), getattr(per_sequence, field.name))


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3"])
@pytest.mark.parametrize("cached_teacher", [False, True])
def test_training_losses_keep_every_tensor_on_the_drafters_device(kind, cached_teacher, monkeypatch):
    """Training on a GPU: no loss may build a tensor on the CPU and mix it in. The meta device stands in for the
    accelerator (it refuses CPU operands as CUDA does, and has no data), so this runs on CPU-only machines."""
    import torch.fx.experimental._config as fx_config

    from specdecode.training import block_losses, eagle3_losses
    from specdecode.training.recipes import build_block_drafter, build_eagle3_drafter

    target = tiny_target(vocab_size=40, kernel="stock")
    examples = tiny_examples(3, 7)
    if kind == "eagle3":
        model = build_eagle3_drafter(target, examples, draft_vocab_size=16, target_layer_ids=[0, 0, 0], num_anchors=4)
        losses = eagle3_losses.training_losses
    else:
        model = build_block_drafter(kind, target, 1, 4, 8, target_layer_ids=[0], num_anchors=3, examples=examples,
                                    draft_vocab_size=16)  # fmt: skip
        losses = block_losses.training_losses
    hidden = target.config.hidden_size
    rows = [torch.randn(len(e.input_ids), hidden * (3 if kind == "eagle3" else 1)) for e in examples]
    last = [torch.randn(len(e.input_ids), hidden) for e in examples]
    teacher = [(torch.randn(len(e.input_ids)), torch.zeros(len(e.input_ids), dtype=torch.long)) for e in examples]
    batch = collate(examples, rows, last, teacher if cached_teacher else None)

    def to_meta(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t, device="meta")

    monkeypatch.setattr(torch.__future__, "get_overwrite_module_params_on_conversion", lambda: True)
    model._apply(to_meta)
    for frozen in model._frozen:  # the target's embedding and head live on the target's device
        frozen._apply(to_meta)
    for field in fields(batch):
        if getattr(batch, field.name) is not None:
            setattr(batch, field.name, to_meta(getattr(batch, field.name)))
    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):  # eagle3 indexes its supervised rows
        out = losses(model, batch, torch.Generator().manual_seed(0))
        out["loss"].backward()
    assert {value.device.type for value in out.values()} == {"meta"}
    assert all(p.grad is None or p.grad.device.type == "meta" for p in model.parameters())


if __name__ == "__main__":  # the subprocess side of the resume and DDP tests
    vanish = int(sys.argv[4]) if len(sys.argv) > 4 else None
    run_tiny_training(
        sys.argv[1], grad_accum=int(sys.argv[2]), step_delay_s=float(sys.argv[3]), vanish_at=vanish,
        collective_timeout_s=30.0,
    )  # fmt: skip

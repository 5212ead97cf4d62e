"""Command line: `python -m solutions "What is the capital of France?"`.

Generates with the default model (offline) and shows, step by step, what the engine did: prefill and decode
tokens, running and waiting sequences, KV blocks in use, preemptions, prefix-cache hits; then the outputs and
the tokens per second.
"""

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m solutions", description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or a local Hugging Face folder")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the per-step token budget")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    args = parser.parse_args()

    from solutions import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=args.model, block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens)
    loaded = time.perf_counter()
    engine = llm.llm_engine
    prompts = args.prompts
    if not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)

    print(f"model loaded in {loaded - start:.2f} s; KV cache: {engine.kv_cache_manager.num_blocks} blocks of "
          f"{engine.block_size} tokens ({engine.model_runner.kv_cache.num_bytes / 2**20:.0f} MiB)\n")
    print(" step  prefill  decode  running  waiting  blocks  preempted  cached   ms")
    texts: dict[str, dict[int, str]] = {str(i): {} for i in range(len(prompts))}
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                texts[output.request_id][completion.index] = texts[output.request_id].get(completion.index, "") + completion.text
                generated += len(completion.token_ids)
        s = engine.stats.steps[-1]
        print(f"{engine.stats.num_steps:5d}  {s.num_prefill_tokens:7d}  {s.num_decode_tokens:6d}  {s.num_running:7d}  "
              f"{s.num_waiting:7d}  {s.num_blocks_used:6d}  {s.num_preempted:9d}  {s.num_cached_tokens:6d}  "
              f"{1000 * sum(s.seconds.values()):5.0f}")
    done = time.perf_counter()

    for i, prompt in enumerate(args.prompts):
        print(f"\n>>> {prompt}")
        for index, text in sorted(texts[str(i)].items()):
            print(f"[{index}] {text.strip()}")
    stats, cache = engine.stats, engine.kv_cache_manager.prefix_cache_stats
    print("\nwhat the engine did:")
    print(f"  generated {generated} tokens in {done - loaded:.2f} s ({generated / (done - loaded):.1f} tok/s) over "
          f"{stats.num_steps} steps: {stats.num_prefill_tokens} prompt tokens prefilled, {stats.num_decode_tokens} "
          f"tokens decoded; sequences per step: max {max(stats.batch_sizes)}")
    print(f"  KV blocks: peak in use {stats.peak_blocks_used}, in use now {engine.kv_cache_manager.num_used_blocks}; "
          f"copy-on-write copies {engine.kv_cache_manager.num_blocks_copied}; preemptions {engine.scheduler.num_preemptions}")
    print(f"  prefix cache: {cache.queries} prompt tokens looked up, {cache.hits} found (hit rate {cache.hit_rate:.0%})")


if __name__ == "__main__":
    main()

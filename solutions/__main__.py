"""Command line: `python -m solutions "What is the capital of France?"`.

Generates with the default model (offline) and shows, step by step, what the engine did: prefill and decode
tokens, running and waiting sequences, KV blocks in use, preemptions, prefix-cache hits; then the outputs and
the tokens per second. Every engine option is a flag (`EngineArgs`: `--block-size 32`, `--attention-backend
inductor`, ...).
"""

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main() -> None:
    from solutions.engine.arg_utils import EngineArgs

    parser = argparse.ArgumentParser(prog="python -m solutions", description=__doc__.splitlines()[0])
    parser.add_argument("prompts", nargs="+", help="one or more prompts")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--n", type=int, default=1, help="samples per prompt")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    EngineArgs.add_cli_args(parser)
    args = parser.parse_args()

    from solutions import SamplingParams
    from solutions.engine.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    loaded = time.perf_counter()
    client = engine.engine_core  # the in-process engine core's client, to show what the core holds
    kv_cache_manager, scheduler = client.scheduler.kv_cache_manager, client.scheduler
    prompts, tokenizer = args.prompts, engine.tokenizer
    if not args.raw and tokenizer is not None and tokenizer.chat_template:
        prompts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)

    kv_cache = client.model_executor.model_runner.kv_cache
    print(f"model loaded in {loaded - start:.2f} s; KV cache: {kv_cache_manager.num_blocks} blocks of "
          f"{kv_cache_manager.block_size} tokens ({kv_cache.num_bytes / 2**20:.0f} MiB)\n")
    print(" step  prefill  decode  running  waiting  blocks  preempted  cached   ms")
    texts: dict[str, dict[int, str]] = {str(i): {} for i in range(len(prompts))}
    generated = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            for completion in output.outputs:
                sample_texts = texts[output.request_id]
                sample_texts[completion.index] = sample_texts.get(completion.index, "") + completion.text
                generated += len(completion.token_ids)
        s = engine.stats.steps[-1]
        print(f"{engine.stats.num_steps:5d}  {s.num_prefill_tokens:7d}  {s.num_decode_tokens:6d}  {s.num_running:7d}  "
              f"{s.num_waiting:7d}  {s.num_blocks_used:6d}  {s.num_preemptions:9d}  {s.num_cached_tokens:6d}  "
              f"{1000 * s.step_seconds:5.0f}")
    done = time.perf_counter()

    for i, prompt in enumerate(args.prompts):
        print(f"\n>>> {prompt}")
        for index, text in sorted(texts[str(i)].items()):
            print(f"[{index}] {text.strip()}")
    stats, cache = engine.stats, kv_cache_manager.prefix_cache_stats
    print("\nwhat the engine did:")
    print(f"  generated {generated} tokens in {done - loaded:.2f} s ({generated / (done - loaded):.1f} tok/s) over "
          f"{stats.num_steps} steps: {stats.num_prefill_tokens} prompt tokens prefilled, {stats.num_decode_tokens} "
          f"tokens decoded; sequences per step: max {max(stats.batch_sizes)}")
    print(f"  KV blocks: peak in use {stats.peak_blocks_used}, in use now {kv_cache_manager.num_used_blocks}; "
          f"copy-on-write copies {kv_cache_manager.num_blocks_copied}; preemptions {scheduler.num_preemptions}")
    print(f"  prefix cache: {cache.queries} prompt tokens looked up, {cache.hits} found "
          f"(hit rate {cache.hit_rate:.0%})")
    if (spec_decoding := stats.spec_decoding_summary()) is not None:
        print(f"  speculative decoding: {spec_decoding}")


if __name__ == "__main__":
    main()

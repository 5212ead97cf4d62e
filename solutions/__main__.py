"""Command line: `python -m solutions "What is the capital of France?"`.

Generates with the default model (offline) and shows what the engine did: steps, batch sizes, KV blocks.
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
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    args = parser.parse_args()

    from solutions import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=args.model, block_size=args.block_size)
    loaded = time.perf_counter()
    prompts = args.prompts
    if not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template:
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    params = SamplingParams(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    outputs = llm.generate(prompts, params)
    done = time.perf_counter()

    for prompt, output in zip(args.prompts, outputs, strict=True):
        print(f"\n>>> {prompt}")
        for completion in output.outputs:
            print(f"[{completion.index}] {completion.text.strip()}")
            print(f"    ({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason.value})")
    stats, engine = llm.engine.stats, llm.engine
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print("\nwhat the engine did:")
    print(f"  model loaded in {loaded - start:.2f} s; generated {generated} tokens in {done - loaded:.2f} s "
          f"({generated / (done - loaded):.1f} tok/s)")
    print(f"  {stats.num_steps} steps: {stats.num_prefill_tokens} prompt tokens prefilled, "
          f"{stats.num_decode_tokens} tokens decoded; sequences per step: max {max(stats.batch_sizes)}, "
          f"mean {sum(stats.batch_sizes) / len(stats.batch_sizes):.1f}")
    print(f"  KV cache: {engine.block_manager.num_blocks} blocks of {engine.block_size} tokens "
          f"({engine.model_runner.kv_cache.num_bytes / 2**20:.0f} MiB); peak blocks in use {stats.peak_blocks_used}, "
          f"in use now {engine.block_manager.num_used_blocks}")


if __name__ == "__main__":
    main()

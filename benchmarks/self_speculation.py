"""Self-speculation: how often the target's own first L layers guess its next token, and what the draft costs.

    python -m benchmarks.self_speculation                            # SmolLM2-135M, L in 1 2 4 8 15 22 29, k = 4
    python -m benchmarks.self_speculation --layers 8 29 --save self_speculation.json

The workload is `benchmarks.spec_decode.copying_prompts` (rename a variable in a standard-library function: an
answer that is mostly a copy of the prompt), greedy, `num_speculative_tokens` k = 4, all prompts in one batch. One
engine without speculation gives the plain decode step; then one engine per L with `{"method": "draft_model",
"num_draft_layers": L}`. For each L:

- acceptance rate: accepted drafts / drafts (greedy: a draft is accepted iff it is the target's argmax);
- mean tokens per step: per sequence and verify step, 1 + its accepted drafts (vLLM's mean acceptance length);
- time per proposal (the draft's catch-up pass, which also yields the first draft, then its k - 1 greedy steps,
  for the whole batch) and per verify step (the target's forward over 1 + k tokens per sequence);
- what sharing the target's first L layers' K/V would save. Memory: the draft's own K/V, in bytes per token
  (L/N of the target's, N = 30 layers). Compute: its catch-up re-reads every verified token it had not fed
  itself (and each prompt once) through L layers, tokens the target has just computed; printed as tokens x L
  layer-tokens and the seconds of those passes.

Times come from whatever else the machine runs: compare rows of one run, not runs of different machines.
"""

import argparse
import datetime
import json
import platform
import time

import torch

from benchmarks.spec_decode import copying_prompts
from solutions import LLM, SamplingParams

MODEL = "smollm2-135m"
LAYERS = (1, 2, 4, 8, 15, 22, 29)


def run_engine(prompts: list[list[int]], max_tokens: int, speculative_config: dict | None) -> dict:
    """One engine over the whole batch: its step counts and times, and its draft's counters if it has one."""
    llm = LLM(model=MODEL, max_num_seqs=len(prompts), max_model_len=1024, speculative_config=speculative_config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.llm_engine.stats
    decode_steps = [s for s in stats.steps if s.num_prefill_tokens == 0 and s.num_scheduled_seqs > 0]
    forward = sum(s.seconds.get("prepare", 0.0) + s.seconds.get("forward", 0.0) for s in decode_steps)
    result = dict(
        seconds=seconds, num_steps=stats.num_steps, num_decode_steps=len(decode_steps),
        seconds_per_decode_step=forward / max(len(decode_steps), 1),
        num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
    )
    runner = llm.llm_engine.engine_core.model_executor.model_runner
    drafter = runner.drafter
    if drafter is not None:
        config = runner.model.config
        num_layers = drafter.num_draft_layers
        kv_bytes = 2 * config.num_key_value_heads * config.head_dim * runner.dtype.itemsize  # K and V, one layer
        result |= dict(
            num_draft_layers=num_layers,
            acceptance_rate=stats.num_accepted_tokens / max(stats.num_draft_tokens, 1),
            mean_tokens_per_step=1 + stats.num_accepted_tokens / max(stats.num_drafts, 1),
            num_proposals=drafter.num_proposals,
            seconds_per_proposal=(drafter.catch_up_seconds + drafter.draft_seconds) / max(drafter.num_proposals, 1),
            draft_kv_bytes_per_token=num_layers * kv_bytes,
            target_kv_bytes_per_token=config.num_hidden_layers * kv_bytes, target_num_layers=config.num_hidden_layers,
            num_catch_up_tokens=drafter.num_catch_up_tokens,
            catch_up_layer_tokens=drafter.num_catch_up_tokens * num_layers,
            catch_up_seconds=drafter.catch_up_seconds, draft_step_seconds=drafter.draft_seconds,
        )
    return result


def run(layers: tuple[int, ...], num_prompts: int, max_tokens: int, k: int) -> dict:
    from transformers import AutoTokenizer

    from solutions.model.loader import resolve_model

    prompts = copying_prompts(AutoTokenizer.from_pretrained(resolve_model(MODEL)), num_prompts)
    rows = []
    for num_layers in layers:
        config = {"method": "draft_model", "num_speculative_tokens": k, "num_draft_layers": num_layers}
        rows.append(run_engine(prompts, max_tokens, config))
    return dict(
        model=MODEL, num_prompts=num_prompts, prompt_tokens=[len(p) for p in prompts], max_tokens=max_tokens,
        num_speculative_tokens=k, machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
        cpus=torch.get_num_threads(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        plain=run_engine(prompts, max_tokens, None), rows=rows,
    )


def table(r: dict) -> str:
    plain = r["plain"]
    lines = [
        f"Self-speculation, {r['model']} (its first L layers + final norm + LM head draft), copying workload: "
        f"{r['num_prompts']} prompts of {r['prompt_tokens']} tokens, {r['max_tokens']} greedy tokens each, "
        f"k = {r['num_speculative_tokens']}; {r['machine']}, {r['cpus']} threads, {r['date']}",
        f"without speculation: {plain['num_steps']} steps, {plain['seconds_per_decode_step'] * 1e3:.1f} ms per decode "
        f"step, {plain['seconds']:.1f} s in all",
        "",
        f"{'L':>3}{'accept':>8}{'tok/step':>10}{'steps':>7}{'ms/propose':>12}{'ms/verify':>11}{'total s':>9}"
        f"{'draft KV B/tok':>16}{'catch-up tok x L':>18}{'catch-up s':>12}",
    ]
    for row in r["rows"]:
        lines.append(
            f"{row['num_draft_layers']:>3}{row['acceptance_rate']:>8.1%}{row['mean_tokens_per_step']:>10.2f}"
            f"{row['num_steps']:>7}{row['seconds_per_proposal'] * 1e3:>12.1f}"
            f"{row['seconds_per_decode_step'] * 1e3:>11.1f}"
            f"{row['seconds']:>9.1f}{row['draft_kv_bytes_per_token']:>16,}"
            f"{row['num_catch_up_tokens']:>8,} x {row['num_draft_layers']:<2}= {row['catch_up_layer_tokens']:<6,}"
            f"{row['catch_up_seconds']:>10.2f}"
        )
    if r["rows"]:
        first = r["rows"][0]
        lines += [
            "",
            f"The target's own K/V: {first['target_kv_bytes_per_token']:,} B per token ({first['target_num_layers']} "
            f"layers), the draft's L/{first['target_num_layers']} of it: a draft reading the target's first L layers' "
            "K/V from the paged cache would save that memory and every catch-up pass.",
        ]
    lines += [
        "Times are from whatever else the machine was running; compare rows of one run.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.self_speculation", description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(LAYERS), help="draft depths L to run")
    parser.add_argument("--num-prompts", type=int, default=2, help="copying prompts in the batch")
    parser.add_argument("--max-tokens", type=int, default=48, help="greedy tokens per prompt")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="k, drafts per step")
    parser.add_argument("--save", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    result = run(tuple(args.layers), args.num_prompts, args.max_tokens, args.num_speculative_tokens)
    print(table(result))
    if args.save:
        with open(args.save, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

"""What sharing KV blocks buys: memory saved by parallel sampling and beam search, compute saved by prefix caching.

    python -m benchmarks.sharing            # a table, our figure beside the paper's
    python -m benchmarks.sharing --quick    # a smaller run (under two minutes on 2 cores)
    python -m benchmarks.sharing --json     # one JSON object

Paper: Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention" (SOSP 2023,
arXiv 2309.06180), §6.3 and §6.4. What we measure, and how it differs from what the paper measured:

1. Memory saved by sharing = 1 − (KV blocks in use with sharing) / (blocks if every sample or beam held its own
   copy), summed over every decode step (a time average, as the paper's is). Parallel sampling: the real
   `KVCacheManager` prefills each prompt once, forks it into n samples and grows each sample to its own output
   length (copy-on-write included); lengths are drawn from the ShareGPT-like workload of `workload.py` and from
   an Alpaca-like one (the same lognormal fit to the paper's Alpaca means). No model is needed: only lengths
   matter. Beam search: real beams of SmolLM2 on real prompts of ShareGPT-like and Alpaca-like lengths, through
   the engine's own beam search. The paper measured both inside a serving run of OPT-13B at a fixed request
   rate; the saving depends only on how prompt and outputs split the tokens, and on how long beams share
   their history — which a 135M model and a short `max_tokens` change (see the chapter 04 notebook).
2. Shared prefix: few-shot translation prompts written for this benchmark (1 example, ~80 tokens of prefix;
   5 examples, ~340), one batch of requests, prefix caching on against off: prefill tokens computed and
   end-to-end output tokens per second. The paper reports something else: the request rate vLLM sustains at
   equal latency under Poisson arrivals on a GPU, 1.67× and 3.58× that of Orca (Oracle) — another system, without
   prefix sharing — not of vLLM with caching off; ours is caching on against off, one offline batch on a CPU.
3. Chat: conversations whose every turn's prompt is the previous prompt + the answer + a new question; the
   prefix-cache hit rate (tokens found / prompt tokens looked up) and the prefill tokens saved.
"""

import argparse
import json
import time

import numpy as np

from benchmarks.workload import SIGMA, lognormal_mu, sample_lengths
from solutions import LLM, BeamSearchParams, SamplingParams
from solutions.beam_search import run_beam_search
from solutions.core.kv_cache_manager import KVCacheManager
from solutions.core.sequence import Sequence

ALPACA_MEAN_PROMPT_LEN = 19.31  # vLLM paper, Fig. 11b
ALPACA_MEAN_OUTPUT_LEN = 58.45  # vLLM paper, Fig. 11b
WIDTHS = (2, 4, 6)
PAPER = {
    "parallel_sharegpt": (0.162, 0.305), "parallel_alpaca": (0.061, 0.098),
    "beam_sharegpt": (0.443, 0.663), "beam_alpaca": (0.376, 0.552),
    "prefix_1shot": 1.67, "prefix_5shot": 3.58,  # request rate, vLLM ÷ Orca (Oracle), §6.4: not caching on ÷ off
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# 1a. parallel sampling, through the block manager -----------------------------------------------------------------


def alpaca_like_lengths(num: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output lengths with the paper's Alpaca means, by the same lognormal fit as `workload.py`."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(np.rint(rng.lognormal(lognormal_mu(ALPACA_MEAN_PROMPT_LEN, SIGMA), SIGMA, num)), 1, 1024)
    outputs = np.clip(np.rint(rng.lognormal(lognormal_mu(ALPACA_MEAN_OUTPUT_LEN, SIGMA), SIGMA, num)), 1, 1024)
    return prompts.astype(np.int64), outputs.astype(np.int64)


def parallel_sampling_saving(prompt_lens: np.ndarray, output_lens: np.ndarray, n: int, block_size: int = 16) -> float:
    """1 − Σ blocks used with sharing / Σ blocks of n private copies, over every decode step of every request.

    Sample i of request r generates `output_lens[(r * n + i) % len]` tokens: each sample its own length.
    """
    shared = own = 0
    for r, prompt_len in enumerate(prompt_lens.tolist()):
        lengths = [int(output_lens[(r * n + i) % len(output_lens)]) for i in range(n)]
        manager = KVCacheManager(cdiv(prompt_len + max(lengths), block_size) * n + 1, block_size, enable_prefix_caching=False)
        parent = Sequence(0, [0] * prompt_len)
        manager.allocate_slots(parent, prompt_len)
        parent.num_computed_tokens = prompt_len
        samples = []
        for i in range(n):
            child = parent.fork(i + 1)
            manager.fork(parent, child)
            samples.append(child)
        manager.free(parent)
        for step in range(max(lengths)):
            live = [s for s, length in zip(samples, lengths, strict=True) if step < length]
            for seq in live:
                seq.append_token(1)
                if manager.allocate_slots(seq, 1) is None:
                    raise RuntimeError("the simulation's cache is sized to never run out")
                seq.num_computed_tokens += 1
            shared += manager.num_used_blocks
            own += sum(cdiv(seq.num_tokens, block_size) for seq in live)
            for seq, length in zip(samples, lengths, strict=True):
                if step == length - 1:
                    manager.free(seq)
    return 1 - shared / own


# 1b. beam search, real beams from SmolLM2 ---------------------------------------------------------------------------

STORY = (
    "The lighthouse keeper had not spoken to another person in three weeks when the supply boat finally came. "
    "She watched it from the gallery, a grey shape against a grey sea, and tried to remember how conversations "
    "began. The captain was a young man she did not know. He handed her the crates one by one, flour, lamp oil, "
    "a bundle of letters tied with string, and said that the old captain had retired to his sister's farm inland. "
    "She asked whether the farm was near the river. He did not know. They stood on the jetty while the gulls "
    "argued overhead, and she realised that she had been rehearsing this moment for days, and that none of the "
    "sentences she had prepared fitted it. So she asked him about the weather to the south, and he told her, "
    "and that was enough. After he left she carried the letters up the spiral stairs, sat by the great lens, "
    "and read them in the order they had been written, slowly, so that they would last the whole winter. "
)
BEAM_PROMPTS = {
    "alpaca": ["Give three tips for staying healthy.", "Describe the water cycle in simple words.",
               "Write a short poem about the sea.", "Explain what a binary search does."],
    "sharegpt": [STORY + "Continue the story:", STORY + "Summarise the story:",
                 STORY + "What happens next?", STORY + "Rewrite the ending:"],
}


def beam_search_saving(llm: LLM, prompts: list[str], width: int, max_tokens: int) -> float:
    """1 − Σ blocks used / Σ blocks of private copies, over the steps of a real beam search (EOS ignored)."""
    totals = [0, 0]

    def on_step(manager: KVCacheManager, beams) -> None:
        totals[0] += manager.num_used_blocks
        totals[1] += sum(cdiv(b.seq.num_tokens, manager.block_size) for b in beams)

    engine = llm.llm_engine  # its in-process core's KV cache manager and model runner, through the client
    token_ids = [llm.tokenizer.encode(p) for p in prompts]
    # The engine is idle, as `EngineCore.beam_search` requires: none of its sequences holds an id the search uses.
    run_beam_search(engine.engine_core.scheduler.kv_cache_manager, engine.engine_core.model_executor.model_runner,
                    token_ids, BeamSearchParams(width, max_tokens, ignore_eos=True), eos_token_id=None,
                    max_model_len=engine.vllm_config.model_config.max_model_len, on_step=on_step)
    return 1 - totals[0] / totals[1]


# 2. shared prefix: few-shot translation -----------------------------------------------------------------------------

INSTRUCTION = "Translate English to French.\n\n"
EXAMPLES = [
    ("The museum opens at nine o'clock on weekdays, but on Sundays it stays closed all morning.",
     "Le musée ouvre à neuf heures en semaine, mais le dimanche il reste fermé toute la matinée."),
    ("My grandmother grows tomatoes, beans and three kinds of lettuce in the garden behind her house.",
     "Ma grand-mère cultive des tomates, des haricots et trois sortes de laitue dans le jardin derrière sa maison."),
    ("The train to Lyon was delayed by forty minutes because of snow on the tracks near Dijon.",
     "Le train pour Lyon a eu quarante minutes de retard à cause de la neige sur les voies près de Dijon."),
    ("Could you tell me where the nearest pharmacy is? I think I left my glasses at the hotel.",
     "Pourriez-vous me dire où se trouve la pharmacie la plus proche ? Je crois que j'ai laissé mes lunettes à l'hôtel."),
    ("Every autumn the children collect chestnuts in the forest and roast them over the fire in the evening.",
     "Chaque automne, les enfants ramassent des châtaignes dans la forêt et les font griller sur le feu le soir."),
]
QUERIES = [
    "The library is quiet today.", "We will meet at the station after lunch.", "Her brother plays the violin.",
    "The soup is too hot to eat.", "They painted the kitchen yellow.", "It rained all night in Paris.",
    "I forgot my umbrella again.", "The cat sleeps on the windowsill.", "He bought bread at the corner bakery.",
    "The river froze last winter.", "Our neighbours have a new dog.", "The concert starts at eight.",
    "She writes letters to her cousin.", "The museum was full of tourists.", "We walked along the beach.",
    "The baker wakes up at four.",
]


def few_shot_prefix(num_examples: int) -> str:
    return INSTRUCTION + "".join(f"English: {en}\nFrench: {fr}\n\n" for en, fr in EXAMPLES[:num_examples])


def prefix_run(llm_options: dict, caching: bool, prompts: list[str], max_tokens: int) -> dict[str, float]:
    llm = LLM(**llm_options, enable_prefix_caching=caching)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prefill_tokens": llm.llm_engine.stats.num_prefill_tokens, "tokens_per_s": num_out / seconds,
            "seconds": seconds, "tokens": [o.outputs[0].token_ids for o in outputs]}


def shared_prefix(llm_options: dict, num_examples: int, num_requests: int, max_tokens: int) -> dict[str, float]:
    prefix = few_shot_prefix(num_examples)
    prompts = [prefix + f"English: {QUERIES[i % len(QUERIES)]}\nFrench:" for i in range(num_requests)]
    off = prefix_run(llm_options, False, prompts, max_tokens)
    on = prefix_run(llm_options, True, prompts, max_tokens)
    if on["tokens"] != off["tokens"]:
        raise RuntimeError("prefix caching changed the generated tokens")
    from solutions.model.loader import load_tokenizer

    return {
        "prefix_tokens": len(load_tokenizer(llm_options["model"]).encode(prefix)),
        "prefill_tokens_off": off["prefill_tokens"], "prefill_tokens_on": on["prefill_tokens"],
        "tokens_per_s_off": off["tokens_per_s"], "tokens_per_s_on": on["tokens_per_s"],
        "speedup": on["tokens_per_s"] / off["tokens_per_s"],
    }


# 3. chat ---------------------------------------------------------------------------------------------------------

QUESTIONS = [
    ["What is a lighthouse?", "Who keeps it running?", "Is that a lonely job?", "What do they do all day?"],
    ["How do bees make honey?", "Why do they need so much?", "What happens in winter?", "Can people help them?"],
    ["What is the capital of Italy?", "What is it famous for?", "When is the best time to visit?", "What should I eat there?"],
    ["How does a bicycle stay upright?", "Is it easier when going fast?", "Why do children use training wheels?", "How do I learn to ride?"],
]


def chat_workload(llm: LLM, num_turns: int, max_tokens: int) -> dict[str, float]:
    """Every conversation's turn t+1 prompt extends turn t's prompt and answer; one batch per turn."""
    conversations = [[] for _ in QUESTIONS]
    manager = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    hits_before, queries_before = manager.prefix_cache_stats.hits, manager.prefix_cache_stats.queries
    prefill_before = llm.llm_engine.stats.num_prefill_tokens
    prompt_tokens = 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for turn in range(num_turns):
        for conversation, questions in zip(conversations, QUESTIONS, strict=True):
            conversation.append({"role": "user", "content": questions[turn % len(questions)]})
        outputs = llm.chat(conversations, params, use_tqdm=False)
        for conversation, output in zip(conversations, outputs, strict=True):
            prompt_tokens += len(output.prompt_token_ids)
            conversation.append({"role": "assistant", "content": output.outputs[0].text})
    stats = manager.prefix_cache_stats
    prefill = llm.llm_engine.stats.num_prefill_tokens - prefill_before
    return {
        "hit_rate": (stats.hits - hits_before) / (stats.queries - queries_before),
        "prompt_tokens": prompt_tokens, "prefill_tokens": prefill, "prefill_saved": 1 - prefill / prompt_tokens,
    }


# report ----------------------------------------------------------------------------------------------------------


def run(quick: bool) -> dict:
    num_requests = 40 if quick else 400
    sharegpt = sample_lengths(num_requests, seed=0)
    alpaca = alpaca_like_lengths(num_requests, seed=0)
    result: dict = {"quick": quick}
    result["parallel_saving_sharegpt"] = {str(n): parallel_sampling_saving(*sharegpt, n) for n in WIDTHS}
    result["parallel_saving_alpaca"] = {str(n): parallel_sampling_saving(*alpaca, n) for n in WIDTHS}
    result["parallel_saving"] = result["parallel_saving_sharegpt"]

    llm_options = dict(model="smollm2-135m", max_model_len=1024, max_num_seqs=64)
    llm = LLM(**llm_options)
    beam_tokens = {"alpaca": 16 if quick else 58, "sharegpt": 16 if quick else 96}
    prompts = {k: v[:2] if quick else v for k, v in BEAM_PROMPTS.items()}
    for kind in ("sharegpt", "alpaca"):
        result[f"beam_saving_{kind}"] = {
            str(w): beam_search_saving(llm, prompts[kind], w, beam_tokens[kind]) for w in WIDTHS
        }
    result["beam_saving"] = result["beam_saving_sharegpt"]
    result["beam_prompt_tokens"] = {k: float(np.mean([len(llm.tokenizer.encode(p)) for p in v])) for k, v in prompts.items()}
    result["beam_max_tokens"] = beam_tokens

    num_prefix_requests, prefix_max_tokens = (8, 8) if quick else (32, 24)
    result["prefix"] = {
        "1shot": shared_prefix(llm_options, 1, num_prefix_requests, prefix_max_tokens),
        "5shot": shared_prefix(llm_options, 5, num_prefix_requests, prefix_max_tokens),
    }
    result["prefix_speedup"] = {k: v["speedup"] for k, v in result["prefix"].items()}
    result["chat"] = chat_workload(llm, 2 if quick else 4, 12 if quick else 32)
    result["chat_hit_rate"] = result["chat"]["hit_rate"]
    return result


def _range(paper: tuple[float, float]) -> str:
    return f"{paper[0]:.1%}–{paper[1]:.1%}"


def table(r: dict) -> str:
    lines = [
        "Sharing KV blocks (vLLM paper §6.3–6.4 beside our runs; SmolLM2-135M fp32 on CPU"
        + (", --quick: small samples" if r["quick"] else "") + ")",
        "",
        "Memory saved by sharing (1 - blocks in use / blocks of private copies, time-averaged)",
        f"{'what':<34}{'n/width 2':>10}{'4':>8}{'6':>8}   paper (n or width 2-6)",
    ]
    rows = [
        ("parallel sampling, ShareGPT-like", "parallel_saving_sharegpt", "parallel_sharegpt"),
        ("parallel sampling, Alpaca-like", "parallel_saving_alpaca", "parallel_alpaca"),
        ("beam search, ShareGPT-like prompt", "beam_saving_sharegpt", "beam_sharegpt"),
        ("beam search, Alpaca-like prompt", "beam_saving_alpaca", "beam_alpaca"),
    ]
    for label, key, paper in rows:
        values = "".join(f"{r[key][str(w)]:>{10 if w == 2 else 8}.1%}" for w in WIDTHS)
        lines.append(f"{label:<34}{values}   {_range(PAPER[paper])}")
    lines += [
        f"  (beam prompts: {r['beam_prompt_tokens']['sharegpt']:.0f} and {r['beam_prompt_tokens']['alpaca']:.0f} tokens on average; "
        f"{r['beam_max_tokens']['sharegpt']} and {r['beam_max_tokens']['alpaca']} new tokens; EOS ignored)",
        "",
        "Shared prefix (few-shot translation; prefix caching on vs off, one offline batch)",
        f"{'prefix':<10}{'tokens':>8}{'prefill off':>13}{'prefill on':>12}{'tok/s off':>11}{'tok/s on':>10}{'speedup':>9}"
        "   paper: vLLM ÷ Orca (Oracle), request rate",
    ]
    for key, paper in (("1shot", "prefix_1shot"), ("5shot", "prefix_5shot")):
        p = r["prefix"][key]
        lines.append(
            f"{key:<10}{p['prefix_tokens']:>8}{p['prefill_tokens_off']:>13}{p['prefill_tokens_on']:>12}"
            f"{p['tokens_per_s_off']:>11.1f}{p['tokens_per_s_on']:>10.1f}{p['speedup']:>8.2f}x   {PAPER[paper]}x"
        )
    c = r["chat"]
    lines += [
        "",
        f"Chat ({len(QUESTIONS)} conversations, each turn extends the last): prefix-cache hit rate {c['hit_rate']:.1%}; "
        f"prefill {c['prefill_tokens']} of {c['prompt_tokens']} prompt tokens computed ({c['prefill_saved']:.1%} saved)",
        "",
        "Throughput figures are from whatever else the machine was running; the ratios come from one run each.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sharing", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small run, under two minutes on 2 cores")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args()
    result = run(args.quick)
    for p in result["prefix"].values():
        p.pop("tokens", None)
    print(json.dumps(result) if args.json else table(result))


if __name__ == "__main__":
    main()

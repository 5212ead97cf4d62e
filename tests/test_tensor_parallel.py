"""Tensor parallelism on 2 CPU ranks (gloo): the same tokens as one rank and as Hugging Face, and failures reported.

Greedy tokens at tensor_parallel_size=2 equal those at 1 and Hugging Face's (a near-tie may differ, checked as a
tie: the partial sums of a row-parallel layer are added in another order) on SmolLM2 — whose 9 query and 3 K/V
heads do not split evenly over 2 ranks — under preemption, chunked prefill, prefix-cache hits and n > 1 forks
(copy-on-write), and on tiny models whose heads split evenly and whose one K/V head is replicated, with n-gram
drafts too (rank 0 proposes and verifies; the drafts travel in the step's broadcast); seeded sampling gives the
same samples at both sizes (on the tiny models; see below for SmolLM2); a worker that dies is an error at the next
step, not a hang. Forked workers run this process's code (a patch here changes their tokens), and
`torchrun` with the external launcher runs every rank as the same engine, with one rank's tokens on each.
"""


import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grading.parity import assert_greedy_close, hf_greedy, hf_oracle
from grading.tiny_models import prompts_with_a_shared_head, sampled_token_ids, tiny_checkpoint
from solutions import LLM, SamplingParams
from solutions.distributed import layers
from solutions.distributed.layers import RowParallelLinear, allowed_tensor_parallel_sizes, partition, split_evenly
from solutions.distributed.parallel_state import free_port
from solutions.exceptions import ParameterError
from solutions.model.loader import load_model, resolve_model

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=NEW_TOKENS, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# preemption (KV for a few sequences), chunked prompts beside decodes, prefix-cache hits (a shared head)
HARD = dict(block_size=8, num_kv_blocks=24, max_num_batched_tokens=32, long_prefill_token_threshold=16, max_num_seqs=6,
            max_model_len=256)


def prompts(vocab_size: int, count: int = 8, seed: int = 0) -> list[list[int]]:
    return prompts_with_a_shared_head(count, vocab_size, seed)



@pytest.mark.parametrize("model", ["smollm2-135m", "llama-gqa", "qwen2-bias-mqa"])
def test_two_ranks_give_one_ranks_tokens_and_hugging_faces(model):
    path = "smollm2-135m" if model == "smollm2-135m" else str(tiny_checkpoint(model))
    one = LLM(path, **HARD)
    vocab_size = one.llm_engine.vllm_config.model_config.vocab_size
    batch = prompts(vocab_size)
    greedy_one, sampled_one = sampled_token_ids(one, batch, GREEDY), sampled_token_ids(one, batch, SAMPLED)
    two = LLM(path, tensor_parallel_size=2, **HARD)
    try:
        greedy_two, sampled_two = sampled_token_ids(two, batch, GREEDY), sampled_token_ids(two, batch, SAMPLED)
        scheduler = two.llm_engine.engine_core.scheduler
        assert scheduler.num_preemptions > 0, "the tight KV cache should have preempted"
    finally:
        two.llm_engine.shutdown()
    folder = str(resolve_model(path))
    for prompt, (ours,), (theirs,) in zip(batch, greedy_two, greedy_one, strict=True):
        assert_greedy_close(ours, theirs, prompt, hf_oracle(folder))
        assert_greedy_close(ours, hf_greedy(folder, tuple(prompt), NEW_TOKENS), prompt, hf_oracle(folder))
    # A seeded sample picks its token by inverse CDF, so a draw within float noise of the boundary between two
    # tokens' cumulative probabilities may pick the neighbour when the partial sums were added in another order:
    # the tiny models' peaked distributions leave no such draw, and must sample identically; SmolLM2's long
    # tails can (13 of 16 samples identical on a 2-core Xeon, 2026-11-23), so there only the count is shown.
    same = sum(a == b for a, b in zip(sum(sampled_one, []), sum(sampled_two, []), strict=True))
    print(f"{model}: {same} of {len(batch) * SAMPLED.n} seeded samples identical at 1 and 2 ranks")
    if model != "smollm2-135m":
        assert sampled_two == sampled_one, "seeded samples must not depend on the number of ranks"


@pytest.mark.parametrize("model", ["llama-gqa", "qwen2-bias-mqa"])
def test_two_ranks_verify_drafts_as_one_rank_without_them_and_hugging_face(model):
    """Speculative decoding at tensor_parallel_size=2: rank 0 proposes and verifies, and the drafts reach the
    workers inside the broadcast `SchedulerOutput` (its input ids, and the k + 1 logits rows of each drafted
    sequence), so every rank runs the same rows and their all-gathers line up. Under preemption, chunked prefill
    and prefix-cache hits, the greedy tokens are one rank's without drafts and Hugging Face's."""
    path, params = str(tiny_checkpoint(model)), SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    batch = prompts(256)
    plain = sampled_token_ids(LLM(path, **HARD), batch, params)
    two = LLM(path, tensor_parallel_size=2, speculative_config=NGRAM, **HARD)
    try:
        ours = sampled_token_ids(two, batch, params)
        stats = two.llm_engine.stats
        assert two.llm_engine.engine_core.scheduler.num_preemptions > 0, "the tight KV cache preempts"
    finally:
        two.llm_engine.shutdown()
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0, "drafts were verified, some accepted"
    folder = str(resolve_model(path))
    for prompt, (tokens,), (want,) in zip(batch, ours, plain, strict=True):
        assert_greedy_close(tokens, want, prompt, hf_oracle(folder))
        assert_greedy_close(tokens, hf_greedy(folder, tuple(prompt), 32), prompt, hf_oracle(folder))


def test_heads_are_dealt_by_kv_group_and_replicated_below_one_kv_head_per_rank():
    smollm2 = load_model("smollm2-135m").config  # 9 query heads, 3 K/V heads, 1536 hidden units
    (a, b) = partition(smollm2, 2)
    assert (a.q_heads, a.kv_heads, b.q_heads, b.kv_heads) == ((0, 3), (0, 1), (3, 9), (1, 3))
    assert (a.intermediate, b.intermediate, a.vocab, b.vocab) == ((0, 768), (768, 1536), (0, 24576), (24576, 49152))
    mqa = load_model(str(tiny_checkpoint("qwen2-bias-mqa"))).config  # 4 query heads, 1 K/V head
    assert [(p.q_heads, p.kv_heads) for p in partition(mqa, 2)] == [((0, 2), (0, 1)), ((2, 4), (0, 1))]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .* allowed values: \[1, 2, 4\]"):
        partition(mqa, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 .* allowed values: \[1, 2, 3, 9\]"):
        partition(smollm2, 4)  # 3 K/V heads: 1..3 ranks, or each K/V head on 3 ranks (9)
    assert allowed_tensor_parallel_sizes(smollm2) == [1, 2, 3, 9]
    for tp in allowed_tensor_parallel_sizes(smollm2):
        assert len(partition(smollm2, tp)) == tp
    assert split_evenly(10, 3) == [(0, 3), (3, 6), (6, 10)]


def test_row_and_column_slices_of_a_linear_sum_to_the_whole():
    """The identity tensor parallelism rests on, on one rank: columns of the first matmul, rows of the second,
    summed over the slices, give the unsplit product."""
    g = torch.Generator().manual_seed(0)
    x, w1, w2 = torch.randn(5, 16, generator=g), torch.randn(32, 16, generator=g), torch.randn(16, 32, generator=g)
    whole = torch.relu(x @ w1.T) @ w2.T
    partial = sum(torch.relu(x @ w1[a:b].T) @ w2[:, a:b].T for a, b in split_evenly(32, 3))
    torch.testing.assert_close(partial, whole)
    row = RowParallelLinear(32, 16, bias=True)  # one rank: the all-reduce adds nothing
    torch.testing.assert_close(row(x @ w1.T), torch.nn.functional.linear(x @ w1.T, row.weight, row.bias))


def test_forked_workers_give_spawns_tokens_and_run_this_processs_code_and_a_dead_worker_is_an_error(monkeypatch):
    """With "fork" a worker is a copy of this process: it slices the model already in memory and runs whatever
    this process runs. A `shard_weight` patched here (K/V heads taken from the wrong rank) changes the tokens of a
    forked engine, which proves the workers ran it; the unpatched forked engine gives spawn's tokens. The spawned
    engine then loses a worker: an error at its next step, not a hang (one engine start for both checks)."""
    path, batch = str(tiny_checkpoint("llama-gqa")), [[5, 6, 7], [9, 10, 11, 12, 13]]
    threads = torch.get_num_threads()
    spawned = LLM(path, tensor_parallel_size=2, max_model_len=64)
    executor = spawned.llm_engine.engine_core.model_executor
    try:
        want = sampled_token_ids(spawned, batch, GREEDY)
        executor.workers[0].kill()
        with pytest.raises(RuntimeError, match="tp-worker-1"):
            spawned.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        executor.shutdown()
    assert torch.get_num_threads() == threads, "shutting down gives this process its torch threads back"
    forked = LLM(path, tensor_parallel_size=2, max_model_len=64, worker_multiproc_method="fork")
    try:
        assert sampled_token_ids(forked, batch, GREEDY) == want
    finally:
        forked.llm_engine.shutdown()
    reference = layers.shard_weight

    def other_kv_head(name, tensor, part, head_dim):
        if name.split(".")[-2] in ("k_proj", "v_proj"):
            part = dataclasses.replace(part, kv_heads=(1 - part.kv_heads[0], 2 - part.kv_heads[0]))
        return reference(name, tensor, part, head_dim)

    monkeypatch.setattr(layers, "shard_weight", other_kv_head)
    patched = LLM(path, tensor_parallel_size=2, max_model_len=64, worker_multiproc_method="fork")
    try:
        assert sampled_token_ids(patched, batch, GREEDY) != want
    finally:
        patched.llm_engine.shutdown()


TORCHRUN_SCRIPT = """
import json, os, sys
from solutions import LLM, SamplingParams
llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="external_launcher", max_model_len=64)
greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
outs = llm.generate(json.loads(sys.argv[2]), greedy, use_tqdm=False)
samples = llm.generate(json.loads(sys.argv[2]), SamplingParams(n=2, temperature=1.0, max_tokens=8), use_tqdm=False)
llm.llm_engine.shutdown()
with open(os.path.join(sys.argv[3], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"greedy": [o.outputs[0].token_ids for o in outs],
               "sampled": [[c.token_ids for c in o.outputs] for o in samples]}, f)
"""


def test_torchrun_runs_every_rank_as_the_same_engine(tmp_path):
    """`torchrun --nproc-per-node 2` and `distributed_executor_backend="external_launcher"`: each rank builds the
    same LLM; both return one rank's greedy tokens, and the same unseeded samples (one engine seed, same steps)."""
    path = str(tiny_checkpoint("llama-gqa"))
    batch = prompts(256, count=4)
    script = tmp_path / "tp.py"
    script.write_text(TORCHRUN_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(free_port()), str(script), path, json.dumps(batch), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1], "every rank returns the same outputs"
    one = LLM(path, max_model_len=64)
    assert ranks[0]["greedy"] == [tokens for (tokens,) in sampled_token_ids(one, batch, GREEDY)]


def test_external_launcher_outside_torchrun_says_how_to_start_it(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ParameterError, match="torchrun --nproc-per-node 2") as refused:
        LLM(str(tiny_checkpoint("llama-gqa")), tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    assert refused.value.parameter == "distributed_executor_backend"


@pytest.mark.parametrize("options, message, parameter", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive int", "tensor_parallel_size"),
    (dict(tensor_parallel_size=2, attention_backend="inductor"), "tensor_parallel_size=2 runs with attention_backend",
     "tensor_parallel_size"),
    (dict(tensor_parallel_size=2, device="cuda", worker_multiproc_method="fork"), "cannot start GPU workers",
     "worker_multiproc_method"),
    (dict(tensor_parallel_size=max(2, torch.cuda.device_count() + 1), device="cuda"),
     "GPUs on this machine, one per rank", "tensor_parallel_size"),
    (dict(distributed_executor_backend="ray"), "distributed_executor_backend must be one of",
     "distributed_executor_backend"),
    (dict(worker_multiproc_method="forkserver"), "worker_multiproc_method must be one of", "worker_multiproc_method"),
])
def test_bad_tensor_parallel_options_are_refused(options, message, parameter):
    with pytest.raises(ParameterError, match=message) as refused:  # a ValueError naming the option
        LLM(str(tiny_checkpoint("llama-gqa")), **options)
    assert refused.value.parameter == parameter

"""The capstones' stored oracle is Hugging Face's own output, and the reference engine reproduces it.

`grading/smollm2_oracle.json` holds what `transformers` generates for the capstone prompts on SmolLM2 (greedy and
beam search, EOS ignored). Recomputing it here keeps it honest: a stale or edited file fails this test, so a
capstone that matches the file matches Hugging Face.
"""

import pytest

from grading import capstone
from solutions import LLM, BeamSearchParams, SamplingParams

pytestmark = pytest.mark.timeout(600)


def test_stored_oracle_is_what_hugging_face_generates():
    stored, fresh = capstone._oracle(), capstone.compute_oracle()
    assert [e["prompt"] for e in stored["greedy"]] == [e["prompt"] for e in fresh["greedy"]], "prompts changed"
    for i, (ours, theirs) in enumerate(zip(stored["greedy"], fresh["greedy"], strict=True)):
        assert ours["tokens"] == theirs["tokens"], f"greedy tokens of prompt {i} differ from Hugging Face's"
        assert ours["min_margin"] > 1e-3, f"prompt {i} has a near-tie ({ours['min_margin']}): pick another prompt"
    assert stored["beams"] == fresh["beams"], "stored beams differ from Hugging Face's"


def test_reference_engine_reproduces_the_oracle():
    llm = LLM(model="smollm2-135m", block_size=16, max_num_seqs=8, max_model_len=256)
    prompts = list(capstone.CAPSTONE_PROMPTS)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=capstone.NUM_GREEDY_TOKENS, ignore_eos=True), use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == capstone.smollm2_greedy(i, capstone.NUM_GREEDY_TOKENS), f"prompt {i}"
    params = BeamSearchParams(capstone.HF_BEAM_WIDTH, capstone.HF_BEAM_TOKENS, ignore_eos=True)
    beams = llm.beam_search(prompts[: capstone.NUM_BEAM_PROMPTS], params)
    for i, output in enumerate(beams):
        assert [seq.tokens[len(prompts[i]):] for seq in output.sequences] == capstone.smollm2_beams(i), f"beams of prompt {i}"


def test_swap_in_replaces_and_restores_every_site():
    from solutions.core.sched import scheduler as scheduler_module
    from solutions.core.sched import swapping_scheduler  # the engine core's scheduler class: `scheduler_cls`

    reference = {"Scheduler": scheduler_module.Scheduler}

    class Mine(scheduler_module.Scheduler):
        pass

    with capstone.swap_in({"Scheduler": Mine}, reference) as mine:
        assert issubclass(swapping_scheduler.Scheduler, Mine) and issubclass(scheduler_module.Scheduler, Mine)
        assert issubclass(mine.Scheduler, Mine)
    assert swapping_scheduler.Scheduler is reference["Scheduler"] and scheduler_module.Scheduler is reference["Scheduler"]


def test_swap_in_names_a_missing_exercise():
    from grading.impl import ExerciseError
    from solutions.core.sched import scheduler as scheduler_module

    with pytest.raises(ExerciseError, match="Scheduler"):
        with capstone.swap_in({}, {"Scheduler": scheduler_module.Scheduler}):
            pass

"""Stop conditions the engine core checks after every sampled token: length, EOS, stop token ids, a complete grammar.

Stop *strings* need text, so the front end's output processor checks those (solutions/engine/output_processor.py)
and aborts the request in the core when one matches.

Where this lives in vLLM: `vllm/v1/core/sched/utils.py` (`check_stop`).
"""

from solutions.core.sequence import Sequence, SequenceStatus


def check_stop(seq: Sequence, eos_token_id: int | None, max_model_len: int) -> tuple[SequenceStatus, int | None] | None:
    """(the finished status, the stop token id if one ended it) once `seq`'s newest token ends it; else None.

    In vLLM's order: the length cap first (a last allowed token that is also EOS reports "length"), then EOS
    (unless ignored), then the stop token ids, then a grammar that is complete (structured output).
    """
    params = seq.sampling_params
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return SequenceStatus.FINISHED_LENGTH_CAPPED, None
    token_id = seq.last_token_id
    if token_id == eos_token_id and not params.ignore_eos:
        return SequenceStatus.FINISHED_STOPPED, None
    if token_id in params.stop_token_ids:
        return SequenceStatus.FINISHED_STOPPED, token_id
    if seq.grammar is not None and seq.grammar.is_terminated():
        return SequenceStatus.FINISHED_STOPPED, None  # the output is complete
    return None

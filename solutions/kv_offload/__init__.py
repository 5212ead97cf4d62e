"""Host memory behind the device's KV pool: swapping preempted sequences out and in, and a second tier for the
prefix cache.

The device pool (chapter 4's `BlockPool`) is the only place attention reads K/V from. When it runs out, the paper
(§4.5) gives two ways to get a preempted sequence's K/V back: recompute them as one prefill (chapter 5), or copy
its blocks to a second pool in host memory and back again (`swap.py`: a `BlockPool` of its own, the same block
ids and reference counts, host tensors shaped like the device cache). vLLM v1 kept recomputation for preemption
and gave host memory another job: blocks the device pool evicts from its free queue are saved to a host pool
(`manager.py`, LRU there), and a prefix lookup that misses on the device but hits on the host loads them back
instead of recomputing them.

Both only decide *which* blocks move: the scheduler puts the pairs in its `SchedulerOutput`, and the model runner
makes the copies (`transfer.py`) before the step's forward pass.

Where this lives in vLLM: swapping is vLLM v0's (`vllm/core/block_manager.py`: `can_swap_out`, `swap_out`,
`can_swap_in`, `swap_in`; `vllm/worker/cache_engine.py`: `swap_in`, `swap_out`); the second tier is v1's
`vllm/v1/kv_offload/` (`cpu/manager.py`: `CPUOffloadingManager`, `lookup`, `prepare_load`, `prepare_store`)
behind the offloading KV connector (`vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py`).
"""

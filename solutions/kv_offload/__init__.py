"""Host memory behind the device's KV pool: swapping preempted sequences out and in, and a second tier for the
prefix cache.

Attention reads K/V from the device pool only. When it runs out, the paper (§4.5) gets a preempted sequence's K/V
back by recomputing them (chapter 5) or by copying its blocks to a host pool and back (`swap.py`: a `BlockPool` of
its own, host tensors shaped like the device cache). vLLM v1 kept recomputation and gave host memory another job:
blocks the device evicts are saved to a host pool (`manager.py`, LRU), and a prefix lookup that misses on the
device but hits there loads them back. Both only decide *which* blocks move: the pairs go in the
`SchedulerOutput`, and the model runner copies them (`transfer.py`) before the forward pass.

Where this lives in vLLM: swapping is vLLM v0's (`vllm/core/block_manager.py`: `can_swap_out`, `swap_out`,
`can_swap_in`, `swap_in`; `vllm/worker/cache_engine.py`: `swap_in`, `swap_out`); the second tier is v1's
`vllm/v1/kv_offload/` (`cpu/manager.py`: `CPUOffloadingManager`, `lookup`, `prepare_load`, `prepare_store`)
behind the offloading KV connector (`vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py`).
"""

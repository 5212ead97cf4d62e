"""The vLLM files the course cites, each checked against vLLM's repository (vllm-project/vllm) on a date.

`CITED[path] = (status, commit, date)`: "current" — the file is in vLLM's tree and still holds what the course
names in it (read at `commit`); "v0" — a file of vLLM's v0 engine, cited as history, read at a commit where
it existed. `MOVED[path] = (new_path, commit, date)`: a path the course cited before vLLM moved what it held;
`commit` is the one the new home was read at. tests/test_vllm_pointers.py fails on any vLLM path cited in
chapters/, solutions/ or docs/ that is not in CITED, naming the new home of one that is in MOVED.

To cite a new file: look it up in vLLM's repository, read what you cite in it, and add it here with the commit and
the date.
"""

CHECKED = "2026-12-03"

_CURRENT = {
    "docs/serving/data_parallel_deployment.md": "624b7aff3e997f284b2149b3798099029b916687",
    "vllm/_custom_ops.py": "7bcae67b5de3f155e70026695285de25d096b801",
    "vllm/beam_search.py": "87a71729f27df8079d36f8d78af6e6c2e79dcb6f",
    "vllm/config/model.py": "18ec6629253632af0a384f2ffbb8c6b28af322e7",
    "vllm/config/speculative.py": "f19b16d95e4395790661f4835e4436bc3dd5d9c7",
    "vllm/config/structured_outputs.py": "5644fd862eb46da5991073ccaae0fffbd3ff0a81",
    "vllm/config/vllm.py": "09f030eaf851400a83ad3d99f730868f76df0ca7",
    "vllm/distributed/communication_op.py": "c18f82401b9adf40b5a46b0c82301c2da91d82e1",
    "vllm/distributed/device_communicators/custom_all_reduce.py": "0ad80649d36672284c95b5e1ae73447d9d5f207f",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py": "7368908123b14495cca88daf580cbc07c384d5b3",
    "vllm/distributed/parallel_state.py": "0c175ae9295b575078961a68c4d3a2a838dce5ef",
    "vllm/engine/arg_utils.py": "99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b",
    "vllm/entrypoints/cli/serve.py": "78265ccd8aadf98d0e9d33c13b6cd2f0053b165e",
    "vllm/entrypoints/llm.py": "10fdb8f0d75a3ad1122b87020f1359d3fc51f2ca",
    "vllm/entrypoints/openai/api_server.py": "048027fbbdb8c252560205a6159ba3288ede291e",
    "vllm/entrypoints/openai/chat_completion/protocol.py": "d5dba2d7b0ab9b98096560c69db7126b54b14d79",
    "vllm/entrypoints/openai/chat_completion/serving.py": "5e918640d7b65820db5beaa98c2a99925bff7c17",
    "vllm/entrypoints/openai/cli_args.py": "789340fbad95a900ca3c467c9cee33b3d905fd61",
    "vllm/entrypoints/openai/completion/protocol.py": "d5dba2d7b0ab9b98096560c69db7126b54b14d79",
    "vllm/entrypoints/openai/completion/serving.py": "cc139d8ea6ff4db984778a3e77e95e1d1c7f1362",
    "vllm/entrypoints/openai/engine/protocol.py": "d7e52523a55cfd60207c99d9f3b7ed527d2115b7",
    "vllm/entrypoints/openai/engine/serving.py": "619e4b31da7791a6ea4f6724fe45b54556b5a8fa",
    "vllm/entrypoints/serve/engine/protocol.py": "f1bf7bd07a112d72d905d355a8206b8d1e82cb5d",
    "vllm/entrypoints/serve/tokenize/serving.py": "cf34c18c302ae4b2702d03afe903f5ccf71e2599",
    "vllm/entrypoints/utils.py": "97c10e4485f6dc98ff9b959a06d78828ffd00a07",
    "vllm/envs.py": "f218f9c24d224800e0ea4488aa71bd8215c8bdcd",
    "vllm/exceptions.py": "f984edf698e863600a1f5973c283fa9595c8707c",
    "vllm/forward_context.py": "762388d07ff7dfaa597a0bdd17a3dec0813b12a3",
    "vllm/logprobs.py": "578b601cd1f41074873532e99af8369bf75cb5a9",
    "vllm/model_executor/layers/activation.py": "f64c867c4026622aec80b1812188c0896f8b1bef",
    "vllm/model_executor/layers/attention/attention.py": "71169c16e9880bb04020f0479a847dc378920f0a",
    "vllm/model_executor/layers/layernorm.py": "30f84e845e0aa076f9acff81b068dd5168cca5a5",
    "vllm/model_executor/layers/linear.py": "9e109c9887e38c51fc16b0da89760c5bd7c293c9",
    "vllm/model_executor/layers/logits_processor.py": "307e0861d40948561f7ecd5289e0cc2585871b5d",
    "vllm/model_executor/layers/utils.py": "9c9de631f6f77766df6b4eecaa7210ce4cd68e54",
    "vllm/model_executor/layers/vocab_parallel_embedding.py": "7f5d141a0abde5fdedc220f55d9f19831c9a5b9e",
    "vllm/model_executor/models/llama.py": "e06c9ba2a6ea923a84add30f5dafaea126429b81",
    "vllm/outputs.py": "72a8dbfa388468c88b0046b5d8944c0a095f9bc8",
    "vllm/platforms/interface.py": "c77619938d1cca436ad7e674241811f9e6ea539f",
    "vllm/renderers/hf.py": "e7ad92e5308e67c9657fc06f351ff4326848f130",
    "vllm/sampling_params.py": "db573835d3ef40643442e0817059e087355cf458",
    "vllm/utils/math_utils.py": "df59a8edd0eddecc73c5d4c966f73cf4cd6f3cab",
    "vllm/v1/attention/backend.py": "e379cf37ec69dd7a07c87fe74413abb9193e9500",
    "vllm/v1/attention/backends/cpu_attn.py": "93bc48b093ceb08bd8ecd94c27ad461ef9ab88c3",
    "vllm/v1/attention/backends/registry.py": "d0ac57910c16de107f5758d0e530b638d8b0f91b",
    "vllm/v1/attention/backends/triton_attn.py": "63013883d93ca538eab430b4f5242916b878f618",
    "vllm/v1/attention/ops/triton_decode_attention.py": "5c1551b07a6547b852d347a5e9ae51e4296872d5",
    "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py": "d566b95565e0caa4a50cc6bd91f72e6ec386b878",
    "vllm/v1/attention/ops/triton_unified_attention.py": "3f392a390bf134f62e29ec338553a10ff672338d",
    "vllm/v1/core/block_pool.py": "c59cb7941357443da7c5eef75cfa8697d683d228",
    "vllm/v1/core/kv_cache_manager.py": "ace980e6de0540f49b0c63248437a1a7807590c1",
    "vllm/v1/core/kv_cache_utils.py": "bbf906a88ba1a39104884c88c9811a4f968e4659",
    "vllm/v1/core/sched/output.py": "a9b169409e5f3a8fa67b462c064c4080e93b82b7",
    "vllm/v1/core/sched/request_queue.py": "9feb38cacfe75c77aa5f45f99d135c02702db7e0",
    "vllm/v1/core/sched/scheduler.py": "b4622cf924bc72504aed99e486062d6633fde39e",
    "vllm/v1/core/sched/utils.py": "6110ea2910f2b99edfec706a8f72ba827d9b7631",
    "vllm/v1/engine/__init__.py": "b823d0262737fa53d714521434bf3fe097df20aa",
    "vllm/v1/engine/async_llm.py": "8ef0b5f50994abaef30bca67b5ec167e5187b99b",
    "vllm/v1/engine/core.py": "ac3cb2e2eca80290181abb9365d572af6d287473",
    "vllm/v1/engine/core_client.py": "364631ab07d283c4f08db0544a2653c5b415a427",
    "vllm/v1/engine/detokenizer.py": "e372329d90d7d12e3957ac21c4097fd9bb79192c",
    "vllm/v1/engine/input_processor.py": "a1799180e1fc12d2e900c767d7c619a10ceb9467",
    "vllm/v1/engine/llm_engine.py": "1e8a83f2aff547f594b85fbc24433aa14f7762c6",
    "vllm/v1/engine/output_processor.py": "d07822605346f767b672503c9aae85aa23ef2d82",
    "vllm/v1/engine/parallel_sampling.py": "491d923514ad9c40e665dc8deae57dd377cb88b0",
    "vllm/v1/executor/abstract.py": "0f1457b0e1303e64ea1c1f3a3e6e0bf348348dc2",
    "vllm/v1/executor/multiproc_executor.py": "c5c40ab252786c8d25f9336824c6b805973974cd",
    "vllm/v1/executor/uniproc_executor.py": "0b940c496a213d5667d61e7230d8606cb47e00d3",
    "vllm/v1/kv_cache_interface.py": "bc8282e61df21719b12b391c3a976b1c900dfbb4",
    "vllm/v1/kv_offload/cpu/gpu_worker.py": "715a6a64d8462912890819b8f614ed212339a10f",
    "vllm/v1/kv_offload/cpu/manager.py": "c8dd6f9d85b2f0e3382e543810082fd6938e38fd",
    "vllm/v1/metrics/loggers.py": "a6f0308cfe806b7731ad4979c9bea6e470c35efd",
    "vllm/v1/metrics/stats.py": "28ed1fb87ed5686e1d4d0cf4134b8e05d8a25a8a",
    "vllm/v1/outputs.py": "1b55f1e9b664c3844552b42749193e7ab3df352c",
    "vllm/v1/request.py": "dba83d52c06471eabafba4310718ac7a100cbfa4",
    "vllm/v1/sample/ops/penalties.py": "3ff2de9c96353a55f7e7a818b9d0c63b9f1e7eeb",
    "vllm/v1/sample/ops/topk_topp_sampler.py": "3babc05a035b42bb9d0ae51b83e102c85e3e5626",
    "vllm/v1/sample/rejection_sampler.py": "7f6fc1c5ce8d02f473b1b923debbfef3fa0b7a6a",
    "vllm/v1/sample/sampler.py": "3e342658b2e9c85a30a54d19e64e5ad77b8a26a6",
    "vllm/v1/spec_decode/draft_model.py": "9b849b170a1f068223fd75cb8aee78c967bd419d",
    "vllm/v1/spec_decode/metadata.py": "bed874faf610cfd61d52e3e8e4d1b87643fb6c51",
    "vllm/v1/spec_decode/metrics.py": "ee4ceaae5953d367d8edd2132fd86d6c42506e1e",
    "vllm/v1/spec_decode/ngram_proposer.py": "adce4e9a528d7f79328075e195c855d28732ef13",
    "vllm/v1/structured_output/__init__.py": "8ae7ba4d4db45492dd5844e3f9f0edf81ad9e4d8",
    "vllm/v1/structured_output/backend_guidance.py": "ace980e6de0540f49b0c63248437a1a7807590c1",
    "vllm/v1/structured_output/backend_types.py": "d26c81b6ef913b0a56bae31a0509cd221a519e11",
    "vllm/v1/structured_output/request.py": "f03e65252b28f135f03d3462f6e537141a046e7c",
    "vllm/v1/structured_output/utils.py": "18b31069c86e948ecdfc078abd5089346f8b4d00",
    "vllm/v1/worker/block_table.py": "a4cd9d0d28bdb41db8dfe0acdafac2bf2f608630",
    "vllm/v1/worker/cpu_worker.py": "cbea7e675d77343e4a6aca6feed9a91f5d8d8a90",
    "vllm/v1/worker/gpu_input_batch.py": "a9e3b0a07e039954a9fd1e3def76e0513b8ed4f5",
    "vllm/v1/worker/gpu_model_runner.py": "4e1790651fc758c06c7a903dd4cd82364ac91b27",
}

_V0 = {
    "vllm/core/block/cpu_gpu_block_allocator.py": "bed874faf610cfd61d52e3e8e4d1b87643fb6c51",
    "vllm/core/block_manager.py": "9a4b60a4c91d972116c01e818048ab8868542d62",
    "vllm/core/block_manager_v1.py": "a02da52a6cdd9f083e652847ebf6aa95cb8216d0",
    "vllm/core/scheduler.py": "0dce2b29aaaa36d3b7e5d80302b1018c1c296eee",
    "vllm/worker/cache_engine.py": "60b652b79cabe13e4059b5d5084bfed6eafc3cf1",
}

CITED = {path: ("current", commit, CHECKED) for path, commit in _CURRENT.items()} | {
    path: ("v0", commit, CHECKED) for path, commit in _V0.items()
}

_MOVED = {
    "vllm/attention/backends/abstract.py": "vllm/v1/attention/backend.py",
    "vllm/attention/backends/registry.py": "vllm/v1/attention/backends/registry.py",
    "vllm/attention/layer.py": "vllm/model_executor/layers/attention/attention.py",
    "vllm/entrypoints/openai/protocol.py": "vllm/entrypoints/openai/chat_completion/protocol.py",
    "vllm/entrypoints/openai/serving_chat.py": "vllm/entrypoints/openai/chat_completion/serving.py",
    "vllm/entrypoints/openai/serving_engine.py": "vllm/entrypoints/openai/engine/serving.py",
    "vllm/entrypoints/openai/serving_tokenization.py": "vllm/entrypoints/serve/tokenize/serving.py",
    "vllm/v1/engine/processor.py": "vllm/v1/engine/input_processor.py",
}

MOVED = {old: (new, _CURRENT[new], CHECKED) for old, new in _MOVED.items()}

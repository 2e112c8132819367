"""The model room: the only torch code (Triton in kernels/), a leaf: it spawns no processes and
imports nothing of ours above the domain types.

build.py           resolved options -> devices, models (Models), KV pools, start-up graph capture
loader.py          checkpoints (local dir, HF cache, GGUF, the embedded model) and random weights
checkpoint.py      tensor sources: safetensors memory-mapped per rank slice, state dicts, safe .bin
safetensors_file.py  one safetensors file's header checked, its bytes mapped; a directory's shards
llama.py           PagedLlama: the paged-KV forward of the Llama family (Gemma, Qwen2, Mistral too)
kv_pool.py         KV pool tensors (device, /dev/shm-shared on the CPU)
runner.py          ModelRunner: a model over its pool; prefill, verify and draft calls
graph_runner.py    CUDA graphs per batch bucket; draft_loop.py the k-step device draft loop
layout.py          batch layouts built on the host, copied to the device at once
sampler.py         token choice and lossless speculative acceptance
verify_fit.py, verdict_shift.py   calls fitted on the device to the previous verify's verdict
eagle_head.py, eagle_draft.py, eagle_chain.py, features.py   EAGLE-style feature drafts
tensor_parallel.py the sharded forward behind a small process-group interface
custom_all_reduce.py  the ranks' one-shot / two-shot all-reduce over peer-mapped buffers (NCCL beyond)
kernels/           Triton kernels, a kernel per file
"""

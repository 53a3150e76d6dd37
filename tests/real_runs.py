"""Real runs, declared as data: (name, request fields, tolerance). Executed by the verification
backend on CPU ranks (gloo) in CI, and by tests/test_deepspeed_cpu.py.

The architectures are small real configs of three families, built by transformers with random
weights. "small" buckets are 2e6 elements: small next to DeepSpeed's 5e8 default, yet larger than
any single parameter here (see README, "Known misses", for why buckets below the largest
parameter make gloo's scratch memory racy on CPU).
"""

LLAMA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}
QWEN2 = {"model_type": "qwen2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 4096, "tie_word_embeddings": True}
GPT2 = {"model_type": "gpt2", "vocab_size": 4096, "n_embd": 256, "n_layer": 4, "n_head": 4,
        "n_positions": 1024, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
SMALL = {"reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000,
         "prefetch_bucket_size": 1_000_000, "param_persistence_threshold": 10_000}


def _run(name, model, strategy, precision, *, small=False, ckpt="none", micro=2, seq=128, gpus=2):
    fields = dict(model_config=model, strategy=strategy, precision=precision, gpus=gpus, gpu="cpu",
                  micro_batch=micro, seq_len=seq, checkpointing=ckpt)
    if small:
        fields.update(SMALL)
    return name, fields


# ZeRO-1/2 on gloo: at the end of some runs (about half, with the same config and seed) the rank
# still holds a full copy of its gradients, even after a barrier and a garbage collection; the
# peak is unaffected. Until that retention is explained, their resident bytes are measured and
# reported (bench/accuracy.py) but only their peak is asserted.
RESIDENT_UNSTABLE = ("zero1", "zero2")


def resident_asserted(fields) -> bool:
    return fields["strategy"] not in RESIDENT_UNSTABLE


# Asserted within TOLERANCE by tests/test_deepspeed_cpu.py (CI) and reported by bench/accuracy.py.
CPU_RUNS = [
    _run("llama-zero0-bf16", LLAMA, "zero0", "bf16-mixed"),
    _run("llama-zero0-fp32-ckpt", LLAMA, "zero0", "fp32", ckpt="full"),
    _run("llama-zero1-bf16-small-s512", LLAMA, "zero1", "bf16-mixed", small=True, micro=4, seq=512),
    _run("llama-zero1-fp32", LLAMA, "zero1", "fp32"),
    _run("llama-zero2-fp32", LLAMA, "zero2", "fp32"),
    _run("llama-zero2-bf16", LLAMA, "zero2", "bf16-mixed"),
    _run("llama-zero3-bf16", LLAMA, "zero3", "bf16-mixed"),
    _run("llama-zero3-bf16-ckpt", LLAMA, "zero3", "bf16-mixed", ckpt="full"),
    _run("llama-zero3-fp32", LLAMA, "zero3", "fp32"),
]

# Measured and reported by bench/accuracy.py, not asserted: the model misses these by more than
# TOLERANCE today (README, "Known misses"). Each stays here until the model explains it.
KNOWN_MISSES = [
    _run("qwen2-zero2-bf16-small", QWEN2, "zero2", "bf16-mixed", small=True, micro=4, seq=256),
    _run("llama-zero2-bf16-ckpt", LLAMA, "zero2", "bf16-mixed", ckpt="full"),
    _run("llama-zero2-fp32-small", LLAMA, "zero2", "fp32", small=True),
    _run("llama-zero3-fp32-small", LLAMA, "zero3", "fp32", small=True),
    _run("qwen2-zero3-bf16-small-ckpt", QWEN2, "zero3", "bf16-mixed", small=True, ckpt="full", micro=4),
    _run("gpt2-zero1-bf16-small-s512", GPT2, "zero1", "bf16-mixed", small=True, micro=2, seq=512),
]
TOLERANCE = 0.05

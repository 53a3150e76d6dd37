"""Real runs, declared as data: (name, request fields, tolerance). Executed by the verification
backend on CPU ranks (gloo) in CI, and by tests/test_deepspeed_cpu.py.

The architectures are small real configs of each family, built by transformers with random
weights. "small" buckets are 2e6 elements: small next to DeepSpeed's 5e8 default, so that ZeRO-2
reduces several buckets during backward.
"""

LLAMA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}
QWEN2 = {"model_type": "qwen2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704,
         "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
         "max_position_embeddings": 4096, "tie_word_embeddings": True}
MISTRAL = {"model_type": "mistral", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 896,
           "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
           "max_position_embeddings": 4096, "sliding_window": 4096, "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "vocab_size": 4096, "n_embd": 256, "n_layer": 4, "n_head": 4,
        "n_positions": 1024, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
# The 2025-2026 families (issue 11), tiny versions of the real shapes.
QWEN3 = {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
         "max_position_embeddings": 4096, "tie_word_embeddings": True}
OLMO2 = {"model_type": "olmo2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 4096, "tie_word_embeddings": False}
GEMMA3_TEXT = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "sliding_window": 512, "sliding_window_pattern": 2, "max_position_embeddings": 4096}
GEMMA3 = {"model_type": "gemma3_text"} | GEMMA3_TEXT
# Gemma-3 as AutoModelForCausalLM builds it (issue 21): Gemma3ForConditionalGeneration, a SigLIP tower a third of
# the parameters (unused on a text batch: it holds states, makes no gradient)
GEMMA3_MM = {"model_type": "gemma3", "text_config": GEMMA3_TEXT, "mm_tokens_per_image": 16,
             "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 256, "intermediate_size": 1024,
                               "num_hidden_layers": 4, "num_attention_heads": 4, "image_size": 224,
                               "patch_size": 16, "vision_use_head": False}}
QWEN3_MOE = {"model_type": "qwen3_moe", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
             "moe_intermediate_size": 192, "num_experts": 8, "num_experts_per_tok": 2,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "max_position_embeddings": 4096, "tie_word_embeddings": False}
GPT_OSS = {"model_type": "gpt_oss", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 192,
           "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 128, "max_position_embeddings": 4096,
           "pad_token_id": None, "eos_token_id": None}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
               "moe_intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
               "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3,
               "num_attention_heads": 4, "q_lora_rank": 96, "kv_lora_rank": 64, "qk_rope_head_dim": 32,
               "qk_nope_head_dim": 64, "v_head_dim": 64, "max_position_embeddings": 4096,
               "pad_token_id": None, "eos_token_id": None, "bos_token_id": None}
LLAMA4 = {"model_type": "llama4_text", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 128,
          "intermediate_size_mlp": 512, "num_local_experts": 4, "num_experts_per_tok": 1,
          "interleave_moe_layer_step": 2, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "attention_chunk_size": 128, "max_position_embeddings": 4096,
          "pad_token_id": None, "eos_token_id": None, "bos_token_id": None}
SMOLLM3 = {"model_type": "smollm3", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 4096, "pad_token_id": None, "eos_token_id": None, "bos_token_id": None}
GEMMA2 = {"model_type": "gemma2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
          "sliding_window": 128, "max_position_embeddings": 4096,
          "pad_token_id": None, "eos_token_id": None, "bos_token_id": None}
DEEPSEEK_V2 = {"model_type": "deepseek_v2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
               "moe_intermediate_size": 128, "n_routed_experts": 8, "num_experts_per_tok": 2,
               "n_shared_experts": 2, "first_k_dense_replace": 1, "num_hidden_layers": 3,
               "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 64, "qk_rope_head_dim": 32,
               "qk_nope_head_dim": 64, "v_head_dim": 64, "max_position_embeddings": 4096,
               "pad_token_id": None, "eos_token_id": None, "bos_token_id": None}
# Logits-dominated shapes: the same blocks with a real vocabulary, so that at 1-2k tokens per
# micro-batch the loss's fp32 tokens x vocab tensors are most of the peak (Llama-2's 32,000,
# GPT-2's 50,257, a 64,000 one, Llama-3's 128,256). Run with small buckets, or DeepSpeed's 1 GB
# default bucket would be the peak instead.
LLAMA_32K = dict(LLAMA, vocab_size=32_000)
# Tensor parallelism (issue 12): heads and kv heads that split over tp 2
LLAMA_TP = dict(LLAMA, num_attention_heads=8, num_key_value_heads=4, intermediate_size=768)
LLAMA_TP_32K = dict(LLAMA_TP, vocab_size=32_000)
# Context parallelism (issue 12): a long sequence, every head with its own K/V and a small
# vocabulary, so that ring attention's backward (the whole sequence's K/V gathered, fp32
# accumulators, rotating gradients) is the peak rather than the loss
LLAMA_CP_LONG = dict(LLAMA, vocab_size=256, num_key_value_heads=4, max_position_embeddings=8192)
LLAMA_128K = dict(LLAMA, vocab_size=128_256)
QWEN2_32K = dict(QWEN2, vocab_size=32_000)
QWEN3_32K = dict(QWEN3, vocab_size=32_000)
QWEN3_MOE_32K = dict(QWEN3_MOE, vocab_size=32_000)
QWEN2_64K = dict(QWEN2, vocab_size=64_000)
# Expert parallelism (issue 12): a small vocabulary and top-4 of 8 experts, so that the routed
# pairs (tokens x 4) and their all-to-all buffers, not the logits, make the peak
QWEN3_MOE_K4_V512 = dict(QWEN3_MOE, vocab_size=512, num_experts_per_tok=4)
GPT2_50K = dict(GPT2, vocab_size=50_257)
# composer's train metrics (planner/recipes/loop.py): a 32k vocabulary at 512 wide, so that under DDP the states
# after backward and the metrics' fp32 logits outweigh the loss's tensors at the start of backward (at 768 tokens by
# 3%, where the metrics' temporaries are 17% of the peak: a missing fp32 copy would show as -5%)
LLAMA_32K_H512 = dict(LLAMA_32K, hidden_size=512, intermediate_size=1376)
SMALL = {"reduce_bucket_size": 2_000_000, "allgather_bucket_size": 2_000_000,
         "prefetch_bucket_size": 1_000_000, "param_persistence_threshold": 10_000}


def _run(name, model, strategy, precision, *, small=False, ckpt="none", micro=2, seq=128, gpus=2, nodes=1,
         offload="none", tp=1, sp=None, cp=1, **extra):
    fields = dict(model_config=model, strategy=strategy, precision=precision, gpus=gpus, gpu="cpu",
                  micro_batch=micro, seq_len=seq, checkpointing=ckpt) | extra
    if tp > 1:  # tensor parallelism: backend/train_parallel.py (torch DTensor on a (dp_shard, tp) mesh)
        fields["tp"] = tp
        if sp is not None:
            fields["sequence_parallel"] = sp
    if cp > 1:  # context parallelism: torch's ring attention (backend/context_parallel.py), FSDP2 over dp_shard x cp
        fields["cp"] = cp
    if nodes > 1:
        fields["nodes"] = nodes  # torch strategies: every node's ranks on this host (a 2-D mesh)
    if offload != "none":
        fields["offload_optimizer"] = offload
    if small:
        fields.update(SMALL)
    return name, fields


OPTIMIZER_RUNS = [
    _run("llama-single-fp32-adamw8bit-t64", LLAMA, "single", "fp32", gpus=1, micro=1, seq=64, optimizer="adamw-8bit"),
    _run("llama-ddp-bf16-adamw8bit-t256", LLAMA, "ddp", "bf16-mixed", micro=2, seq=128, optimizer="adamw-8bit"),
    _run("llama-single-bf16-paged8bit-t128", LLAMA, "single", "bf16-mixed", gpus=1, micro=1, seq=128,
         optimizer="adamw-paged-8bit"),
    _run("llama-ddp-fp32-paged8bit-t128", LLAMA, "ddp", "fp32", micro=1, seq=128, optimizer="adamw-paged-8bit"),
    _run("llama-single-fp32-ao8bit-t64", LLAMA, "single", "fp32", gpus=1, micro=1, seq=64,
         optimizer="adamw-torchao-8bit"),
    _run("llama-single-bf16-ao8bit-t256", LLAMA, "single", "bf16-mixed", gpus=1, micro=2, seq=128,
         optimizer="adamw-torchao-8bit"),
    _run("llama-single-fp32-ao4bit-t64", LLAMA, "single", "fp32", gpus=1, micro=1, seq=64,
         optimizer="adamw-torchao-4bit"),
    _run("llama-single-bf16-ao4bit-t256", LLAMA, "single", "bf16-mixed", gpus=1, micro=2, seq=128,
         optimizer="adamw-torchao-4bit"),
    _run("llama-single-fp32-adafactor-t64", LLAMA, "single", "fp32", gpus=1, micro=1, seq=64, optimizer="adafactor"),
    _run("llama-ddp-bf16-adafactor-t256", LLAMA, "ddp", "bf16-mixed", micro=2, seq=128, optimizer="adafactor"),
    _run("llama-single-fp32-lion-t64", LLAMA, "single", "fp32", gpus=1, micro=1, seq=64, optimizer="lion"),
    _run("llama-ddp-bf16-lion-t256", LLAMA, "ddp", "bf16-mixed", micro=2, seq=128, optimizer="lion"),
    _run("llama-single-fp32-sgd-t128", LLAMA, "single", "fp32", gpus=1, micro=1, seq=128, optimizer="sgd"),
    _run("llama-fsdp-fp32-sgd-t256", LLAMA, "fsdp", "fp32", micro=2, seq=128, optimizer="sgd"),
    _run("llama-single-bf16-sgdm-t128", LLAMA, "single", "bf16-mixed", gpus=1, micro=1, seq=128,
         optimizer="sgd-momentum"),
    _run("llama-ddp-fp32-sgdm-t256", LLAMA, "ddp", "fp32", micro=2, seq=128, optimizer="sgd-momentum"),
    _run("llama-single-fp32-muon-t64", LLAMA, "single", "fp32", gpus=1, micro=1, seq=64, optimizer="muon"),
    _run("llama-ddp-bf16-muon-t256", LLAMA, "ddp", "bf16-mixed", micro=2, seq=128, optimizer="muon"),
    # Muon on FSDP2's DTensor shards: DTensor's all-gathers / all-reduces inside Newton-Schulz
    _run("llama-fsdp-fp32-muon-t256", LLAMA, "fsdp", "fp32", micro=2, seq=128, optimizer="muon"),
    _run("llama-fsdp-bf16-muon-t256", LLAMA, "fsdp", "bf16-mixed", micro=2, seq=128, optimizer="muon"),
    _run("llama-fsdp-fp32-muon-4ranks-t256", LLAMA, "fsdp", "fp32", gpus=4, micro=2, seq=128, optimizer="muon"),
    _run("llama-single-fp32-inbwd-t256", LLAMA, "single", "fp32", gpus=1, micro=2, seq=128,
         optimizer_in_backward=True),
    _run("llama-single-bf16-inbwd-muon-t128", LLAMA, "single", "bf16-mixed", gpus=1, micro=1, seq=128,
         optimizer="muon", optimizer_in_backward=True),
]

# Asserted within TOLERANCE by tests/test_deepspeed_cpu.py (CI) and reported by bench/accuracy.py.
CPU_RUNS = [
    _run("llama-zero0-bf16", LLAMA, "zero0", "bf16-mixed"),
    _run("llama-zero0-fp32-ckpt", LLAMA, "zero0", "fp32", ckpt="full"),
    _run("llama-zero1-bf16-small-s512", LLAMA, "zero1", "bf16-mixed", small=True, micro=4, seq=512),
    _run("llama-zero1-fp32", LLAMA, "zero1", "fp32"),
    # ZeRO-1 with its default bucket (5e8 elements, 1 GB in bf16) at 4,096 tokens: the bucket is made at
    # the first gradient hook, beside the activations at the LM head's backward (-15.7% when it was
    # modelled at the end of backward only)
    _run("llama-zero1-bf16-t4096", LLAMA, "zero1", "bf16-mixed", micro=1, seq=4096),
    _run("llama-zero2-fp32", LLAMA, "zero2", "fp32"),
    _run("llama-zero2-bf16", LLAMA, "zero2", "bf16-mixed"),
    _run("llama-zero3-bf16", LLAMA, "zero3", "bf16-mixed"),
    _run("llama-zero3-bf16-ckpt", LLAMA, "zero3", "bf16-mixed", ckpt="full"),
    _run("llama-zero3-fp32", LLAMA, "zero3", "fp32"),
    _run("qwen2-zero2-bf16-small", QWEN2, "zero2", "bf16-mixed", small=True, micro=4, seq=256),
    _run("llama-zero2-bf16-ckpt", LLAMA, "zero2", "bf16-mixed", ckpt="full"),
    _run("llama-zero2-fp32-small", LLAMA, "zero2", "fp32", small=True),
    _run("llama-zero3-fp32-small", LLAMA, "zero3", "fp32", small=True),
    _run("qwen2-zero3-bf16-small-ckpt", QWEN2, "zero3", "bf16-mixed", small=True, ckpt="full", micro=4),
    _run("gpt2-zero1-bf16-small-s512", GPT2, "zero1", "bf16-mixed", small=True, micro=2, seq=512),
    # torch strategies, through torch.distributed.run
    _run("llama-ddp-bf16", LLAMA, "ddp", "bf16-mixed"),
    _run("llama-ddp-fp32", LLAMA, "ddp", "fp32"),
    _run("llama-fsdp-bf16", LLAMA, "fsdp", "bf16-mixed"),
    _run("llama-fsdp-fp32", LLAMA, "fsdp", "fp32"),
    _run("mistral-zero3-bf16-4ranks-s1024", MISTRAL, "zero3", "bf16-mixed", gpus=4, micro=1, seq=1024),
    _run("qwen3-zero2-bf16-small-s512", QWEN3, "zero2", "bf16-mixed", small=True, micro=4, seq=512),
    _run("qwen3moe-zero2-bf16-small-s512", QWEN3_MOE, "zero2", "bf16-mixed", small=True, micro=4, seq=512),
    # logits-dominated (1,024 tokens, vocabularies of 32k-64k)
    _run("llama-v32k-zero2-bf16-small-t1024", LLAMA_32K, "zero2", "bf16-mixed", small=True, micro=2, seq=512),
    _run("llama-v32k-zero3-fp32-small-ckpt-t1024", LLAMA_32K, "zero3", "fp32", small=True, ckpt="full",
         micro=1, seq=1024),
    _run("qwen2-v32k-fsdp-bf16-t1024", QWEN2_32K, "fsdp", "bf16-mixed", micro=1, seq=1024),
    _run("gpt2-v50k-ddp-fp32-ckpt-t1024", GPT2_50K, "ddp", "fp32", ckpt="full", micro=2, seq=512),
    # tensor parallelism (torch DTensor), cheap ones: TP only, and TP x FSDP2 on 4 ranks
    _run("llama-tp2-fp32-sp-t256", LLAMA_TP, "fsdp", "fp32", tp=2, micro=1, seq=256),
    _run("llama-tp2-fsdp2-bf16-sp-t256", LLAMA_TP, "fsdp", "bf16-mixed", tp=2, gpus=4, micro=1, seq=256),
    # context parallelism: torch's context_parallel, its ring attention given CPU's flash kernel
    _run("llama-v256-mha-cp2-fsdp-fp32-t1024", LLAMA_CP_LONG, "fsdp", "fp32", cp=2, micro=1, seq=1024),
    # pipeline parallelism (torch.distributed.pipelining, backend/train_pipeline.py); at one
    # data-parallel rank no wrapper, over dp > 1 FSDP2
    _run("llama-pp2-1f1b-fp32-m4", LLAMA, "fsdp", "fp32", pp=2, gradient_accumulation=4),
    # torch 2.13's zero-bubble schedules (issue 25): the split backward (I, then W with the graph
    # retained between them), the V placement (rank 0 holds the first and the last stage)
    _run("llama-pp2-zbv-fp32-m4", LLAMA, "fsdp", "fp32", pp=2, pp_schedule="zbv", pp_virtual_stages=2,
         gradient_accumulation=4),
    _run("llama-pp2-interleaved-zb-v2-fp32-m4", LLAMA, "fsdp", "fp32", pp=2, pp_schedule="interleaved-zb",
         pp_virtual_stages=2, gradient_accumulation=4),
    # expert parallelism (backend/train_experts.py): each rank holds 4 of the 8 experts of every
    # block, tokens exchanged by all-to-all, FSDP2 over both ranks for the rest
    _run("qwen3moe-ep2-fsdp-fp32-t1024", QWEN3_MOE, "fsdp", "fp32", ep=2, micro=4, seq=256),
    # LoRA (issue 13): PEFT adapters on a frozen bf16 base under autocast
    _run("llama-lora-ddp-bf16-qkvo-r16", LLAMA, "ddp", "bf16-mixed", micro=2, seq=256, finetune="lora",
         lora_rank=16, lora_targets="q_proj,k_proj,v_proj,o_proj"),
    # QLoRA: bitsandbytes' nf4 base (4-bit layers train on CPU), fp32 compute
    _run("llama-qlora-ddp-fp32-qv", LLAMA, "ddp", "fp32", micro=2, seq=256, finetune="qlora",
         lora_targets="q_proj,v_proj"),
    # tensor parallelism alone (dp 1: nothing wraps the model) with gradient accumulation: micro-batches
    # 2-4 run beside the accumulated gradients, the embedding's replicated over the whole vocabulary
    _run("llama-tp2-fp32-sp-t256-ga4", LLAMA_TP, "fsdp", "fp32", tp=2, micro=1, seq=256, gradient_accumulation=4),
    # gradient accumulation: the second micro-batch runs beside the sharded gradients of the first
    _run("llama-fsdp-fp32-ga2-t128", LLAMA, "fsdp", "fp32", micro=1, seq=128, gradient_accumulation=2),
    # the HF Trainer's no_sync (defer_gradient_sync): the later micro-batches run beside every unit's unsharded
    # gradients; in bf16 with a middle micro-batch (3), and with fp32 reduction (the kept gradients in fp32)
    _run("llama-fsdp-bf16-ga3-defer-t128", LLAMA, "fsdp", "bf16-mixed", micro=1, seq=128, gradient_accumulation=3,
         defer_gradient_sync=True),
    _run("llama-fsdp-bf16-ga2-defer-fp32reduce-t256", LLAMA, "fsdp", "bf16-mixed", micro=2, seq=128,
         gradient_accumulation=2, defer_gradient_sync=True, reduce_dtype="fp32"),
    # logits-dominated (32k vocabulary): the kept unsharded gradients are mostly the embedding's and the head's
    _run("llama-v32k-fsdp-bf16-ga2-defer-t512", LLAMA_32K, "fsdp", "bf16-mixed", micro=1, seq=512,
         gradient_accumulation=2, defer_gradient_sync=True),
    # one device, no framework (strategy single): the bare module under autocast
    _run("llama-single-bf16", LLAMA, "single", "bf16-mixed", gpus=1),
    # optimizers: Muon's Newton-Schulz with AdamW for the rest sets the peak; the step in backward; Muon on
    # FSDP2's DTensor shards (DTensor's collectives inside Newton-Schulz)
    *[run for run in OPTIMIZER_RUNS if run[0] in ("llama-single-fp32-muon-t64", "llama-single-fp32-inbwd-t256",
                                                  "llama-fsdp-fp32-muon-t256")],
    # transformers' own TP (tp_plan=transformers, backend/hf_tensor_parallel.py: from_pretrained(tp_plan="auto")):
    # logits-dominated, as the whole logits are gathered on every rank; untied fp32, tied bf16 with q/k norms
    _run("llama-v32k-tp2-hfplan-fp32-t1024", LLAMA_TP_32K, "fsdp", "fp32", tp=2, micro=1, seq=1024,
         tp_plan="transformers"),
    _run("qwen3-v32k-tp2-hfplan-bf16-t1024", QWEN3_32K, "fsdp", "bf16-mixed", tp=2, micro=1, seq=1024,
         tp_plan="transformers"),
    # an MoE: the routed experts are in transformers' ep plan, whole on every TP rank
    _run("qwen3moe-v32k-tp2-hfplan-fp32-t1024", QWEN3_MOE_32K, "fsdp", "fp32", tp=2, micro=1, seq=1024,
         tp_plan="transformers"),
    # with FSDP2 over dp_shard 2 (4 ranks): transformers' own DistributedConfig(tp_size, fsdp_size) composition, the
    # embedding its own unit, the final norm and LM head one unit kept gathered through backward; checkpointed, two
    # sequences. (At a 4,096 vocabulary one execution in four read 7.6% above: gloo's worker still holding the
    # head's all-gather input, the race planner/parallel/tensor.py gathered_logits_race_above describes.)
    _run("llama-v32k-tp2-fsdp2-hfplan-fp32-ckpt-t1024", LLAMA_TP_32K, "fsdp", "fp32", tp=2, gpus=4, ckpt="full",
         micro=2, seq=512, tp_plan="transformers"),
    # LoRA on an LLM.int8 base under autocast (Axolotl's lora-8b: load_in_8bit, bf16): bitsandbytes'
    # CPU path MatMul8bitFp keeps each int8 linear's fp32 input, its outputs 16-bit under autocast
    _run("llama-int8-lora-single-bf16-all-t512", LLAMA, "single", "bf16-mixed", gpus=1, micro=2, seq=256,
         finetune="qlora", quantize_base="int8", lora_targets="all-linear"),
    # loss=cce on a CPU rank: Cut Cross-Entropy's torch_compile implementation (backend/losses.py), LoRA under
    # autocast (the frozen head: no weight gradient; the logits bf16, the copied rows fp32)
    _run("llama-v32k-lora-ddp-bf16-cce-t512", LLAMA_32K, "ddp", "bf16-mixed", micro=2, seq=256, finetune="lora",
         loss="cce"),
    # activation_offload: TRL's OffloadActivations on a CPU rank (backend/offload.py; the others in BENCH_RUNS)
    _run("llama-offload-single-fp32-t512", LLAMA, "single", "fp32", gpus=1, micro=2, seq=256,
         activation_offload=True),
    # loss=chunked-in-forward (torchtitan's ChunkedLossWrapper, backend/losses.py): FSDP2 over two ranks with two
    # sequences (the slices copied), and tp 2 with SP (each slice's logits vocab-parallel), logits-dominated
    _run("llama-v32k-fsdp-bf16-chunkfwd-t1024", LLAMA_32K, "fsdp", "bf16-mixed", micro=2, seq=512,
         loss="chunked-in-forward"),
    _run("llama-v32k-tp2-fp32-sp-chunkfwd-t1024", LLAMA_TP_32K, "fsdp", "fp32", tp=2, micro=1, seq=1024,
         loss="chunked-in-forward"),
    # composer's loop: the outputs kept and two cross-entropy metrics on their logits after each backward, in fp32
    # under the loop's autocast; the metrics' phase is the peak
    _run("llama-v32k-h512-ddp-bf16-ckpt-keeps-metrics2-t768", LLAMA_32K_H512, "ddp", "bf16-mixed", ckpt="full",
         micro=1, seq=768, keeps_outputs=True, train_metrics=2),
]

# The part of CPU_RUNS that CI runs (scripts/test.sh deselects the rest, marked slow_matrix in
# tests/test_deepspeed_cpu.py; bench/accuracy.py runs all): every framework (ZeRO 0-3, DDP, FSDP2),
# every dimension (tp, cp, pp, ep, accumulation), every recipe (bf16, fp32, checkpointing, small
# buckets, LoRA, QLoRA) at least once, and a logits-dominated run.
CI_RUNS = frozenset({
    "llama-offload-single-fp32-t512",  # issue 21: activation offloading (TRL's class on a CPU rank)
    "llama-zero0-bf16", "llama-zero1-bf16-t4096", "qwen2-zero2-bf16-small", "llama-zero3-bf16-ckpt",
    "llama-zero3-fp32-small", "llama-ddp-bf16", "llama-fsdp-fp32", "llama-v32k-zero3-fp32-small-ckpt-t1024",
    "llama-tp2-fsdp2-bf16-sp-t256", "llama-v256-mha-cp2-fsdp-fp32-t1024", "llama-pp2-1f1b-fp32-m4",
    "qwen3moe-ep2-fsdp-fp32-t1024", "llama-lora-ddp-bf16-qkvo-r16", "llama-qlora-ddp-fp32-qv",
    "llama-fsdp-fp32-ga2-t128", "llama-fsdp-bf16-ga3-defer-t128", "llama-single-bf16", "llama-single-fp32-muon-t64", "llama-single-fp32-inbwd-t256",
    "llama-fsdp-fp32-muon-t256",  # issue 21: Muon on FSDP2's DTensor shards
    "llama-v32k-tp2-hfplan-fp32-t1024", "llama-v32k-tp2-fsdp2-hfplan-fp32-ckpt-t1024",
    "llama-int8-lora-single-bf16-all-t512", "llama-v32k-lora-ddp-bf16-cce-t512",
    "llama-pp2-zbv-fp32-m4", "llama-pp2-interleaved-zb-v2-fp32-m4",  # issue 25: the split backward, the V
    "llama-v32k-fsdp-bf16-chunkfwd-t1024", "llama-v32k-tp2-fp32-sp-chunkfwd-t1024",  # torchtitan's chunked loss
    "llama-v32k-h512-ddp-bf16-ckpt-keeps-metrics2-t768",  # composer's train metrics
})

# Measured and reported by bench/accuracy.py (not in CI, to keep it short): the rest of the
# matrix, asserted nowhere but held to the same TOLERANCE in the README's table.
BENCH_RUNS = [
    # tensor parallelism: SP on and off, TP x FSDP2, checkpointed, and logits-dominated (32k vocab)
    _run("llama-tp2-fp32-sp-t1024", LLAMA_TP, "fsdp", "fp32", tp=2, micro=1, seq=1024),
    _run("llama-tp2-fsdp2-bf16-sp-t512", LLAMA_TP, "fsdp", "bf16-mixed", tp=2, gpus=4, micro=1, seq=512),
    _run("llama-tp2-fp32-nosp-t1024", LLAMA_TP, "fsdp", "fp32", tp=2, sp=False, micro=1, seq=1024),
    _run("llama-tp2-fsdp2-fp32-sp-t1024", LLAMA_TP, "fsdp", "fp32", tp=2, gpus=4, micro=1, seq=1024),
    _run("llama-tp2-fsdp2-fp32-nosp-t1024", LLAMA_TP, "fsdp", "fp32", tp=2, sp=False, gpus=4, micro=1, seq=1024),
    _run("llama-tp2-fsdp2-fp32-sp-ckpt-t1024", LLAMA_TP, "fsdp", "fp32", tp=2, gpus=4, ckpt="full", micro=1,
         seq=1024),
    _run("llama-v32k-tp2-fp32-sp-t1024", LLAMA_TP_32K, "fsdp", "fp32", tp=2, micro=1, seq=1024),
    # context parallelism at 4,096 tokens: ring attention's backward is the peak
    _run("llama-v256-mha-cp2-fsdp-fp32-t4096", LLAMA_CP_LONG, "fsdp", "fp32", cp=2, micro=1, seq=4096),
    # CP x TP on a (dp_shard 1, cp 2, tp 2) mesh: the TP plan first (2 of the 4 heads per rank,
    # sequence parallel), the ring over the cp ranks on each rank's local heads, FSDP2 over the cp ranks
    _run("llama-v256-mha-cp2-tp2-fsdp-fp32-sp-t2048", LLAMA_CP_LONG, "fsdp", "fp32", cp=2, tp=2, gpus=4, micro=1,
         seq=2048),
    # and under FSDP2's bf16: the ring's fp32 accumulators beside bf16 K/V, CPU's fp32 copy of the
    # bf16 q gradient added into its accumulator
    _run("llama-v256-mha-cp2-tp2-fsdp-bf16-sp-t2048", LLAMA_CP_LONG, "fsdp", "bf16-mixed", cp=2, tp=2, gpus=4,
         micro=1, seq=2048),
    # cp x tp with full activation checkpointing: each block keeps its input, its backward recomputes
    # the forward (the ring's K/V gathered a third time) and then runs the ring's backward
    _run("llama-v256-mha-cp2-tp2-fsdp-fp32-sp-ckpt-t2048", LLAMA_CP_LONG, "fsdp", "fp32", cp=2, tp=2, gpus=4,
         ckpt="full", micro=1, seq=2048),
    # cp x tp without sequence parallelism: the residual stream, norms and their gradients whole on
    # every tp rank, under FSDP2's bf16
    _run("llama-v256-mha-cp2-tp2-fsdp-bf16-nosp-t2048", LLAMA_CP_LONG, "fsdp", "bf16-mixed", cp=2, tp=2,
         sp=False, gpus=4, micro=1, seq=2048),
    # and over dp_shard 2 x cp 2 x tp 2 on 8 ranks: FSDP2 shards over the 4 ranks of dp_shard x cp
    _run("llama-v256-mha-dp2-cp2-tp2-fsdp-fp32-sp-t1024", LLAMA_CP_LONG, "fsdp", "fp32", cp=2, tp=2, gpus=8,
         micro=1, seq=1024),
    # HSDP x CP on a (dp_replicate 2, dp_shard 1, cp 2) mesh: each node's two ranks the ring and the
    # shard group (FSDP2 over dp_shard x cp), the two nodes replicas all-reducing their shards
    _run("llama-v256-mha-cp2-hsdp-fp32-2x2-t2048", LLAMA_CP_LONG, "hsdp", "fp32", cp=2, nodes=2, micro=1,
         seq=2048),
    # DeepSpeed AutoTP (tensor_parallel.autotp_size) with ZeRO over the data-parallel ranks
    _run("llama-tp2-zero1-fp32-small-s256", LLAMA_TP, "zero1", "fp32", small=True, tp=2, micro=1, seq=256),
    _run("llama-tp2-zero2-fp32-small-4ranks-s256", LLAMA_TP, "zero2", "fp32", small=True, tp=2, gpus=4, micro=1,
         seq=256),
    # the same with a 32k vocabulary: the LM head's gather, held by gloo's worker into the loss, is
    # 8x larger (49 MB, 16 MB above the start of backward's peak; 2 MiB at 4,096)
    _run("llama-v32k-tp2-zero2-fp32-small-4ranks-s256", LLAMA_TP_32K, "zero2", "fp32", small=True, tp=2, gpus=4,
         micro=1, seq=256),
    # and in bf16: the gather in bf16 (3 MiB), the loss in fp32, at most 1 MiB above the start of backward
    _run("llama-tp2-zero2-bf16-small-4ranks-s256", LLAMA_TP, "zero2", "bf16-mixed", small=True, tp=2, gpus=4, micro=1,
         seq=256),
    _run("mistral-zero2-bf16-4ranks", MISTRAL, "zero2", "bf16-mixed", gpus=4, micro=4, seq=256),
    _run("mistral-ddp-bf16-ckpt", MISTRAL, "ddp", "bf16-mixed", ckpt="full", micro=8, seq=128),
    _run("llama-zero1-fp32-4ranks-m8-s32", LLAMA, "zero1", "fp32", gpus=4, micro=8, seq=32),
    _run("gpt2-ddp-fp32-ckpt", GPT2, "ddp", "fp32", ckpt="full"),
    _run("gpt2-zero3-fp32-m8-s64", GPT2, "zero3", "fp32", micro=8, seq=64),
    _run("qwen2-fsdp-bf16-ckpt", QWEN2, "fsdp", "bf16-mixed", ckpt="full", micro=4),
    _run("qwen2-zero0-fp32-m1-s1024", QWEN2, "zero0", "fp32", micro=1, seq=1024),
    _run("llama-fsdp-grad-op-fp32", LLAMA, "fsdp-grad-op", "fp32"),
    _run("llama-hsdp-bf16-2x2", LLAMA, "hsdp", "bf16-mixed", nodes=2),
    _run("llama-zero2-bf16-offload", LLAMA, "zero2", "bf16-mixed", offload="cpu"),
    _run("llama-zero3-bf16-offload", LLAMA, "zero3", "bf16-mixed", offload="cpu"),
    _run("qwen3-zero3-fp32-small-ckpt", QWEN3, "zero3", "fp32", small=True, ckpt="full", micro=4, seq=256),
    _run("olmo2-zero2-bf16-small-s512", OLMO2, "zero2", "bf16-mixed", small=True, micro=4, seq=512),
    _run("gemma3-zero1-bf16-small-s512", GEMMA3, "zero1", "bf16-mixed", small=True, micro=4, seq=512),
    _run("gemma3mm-zero1-bf16-small-s512", {"model_type": "gemma3", "text_config": GEMMA3_TEXT}, "zero1",
         "bf16-mixed", small=True, micro=4, seq=512, text_only=True),  # the text decoder (Gemma3ForCausalLM)
    # the whole Gemma3ForConditionalGeneration (the default: what AutoModelForCausalLM builds), fed text
    _run("gemma3mm-vision-zero2-fp32-small-s256", GEMMA3_MM, "zero2", "fp32", small=True, micro=2, seq=256),
    _run("gemma3mm-vision-zero3-bf16-small-s256", GEMMA3_MM, "zero3", "bf16-mixed", small=True, micro=2, seq=256),
    # FSDP2 units: the text decoder's blocks (backend/train.py _decoder_layer_class), the tower in the root
    _run("gemma3mm-vision-fsdp-bf16-s256", GEMMA3_MM, "fsdp", "bf16-mixed", micro=2, seq=256),
    _run("gptoss-zero2-bf16-small-s256", GPT_OSS, "zero2", "bf16-mixed", small=True, micro=4, seq=256),
    _run("deepseekv3-zero2-bf16-small-s256", DEEPSEEK_V3, "zero2", "bf16-mixed", small=True, micro=4, seq=256),
    _run("llama4-zero2-bf16-small-s256", LLAMA4, "zero2", "bf16-mixed", small=True, micro=4, seq=256),
    _run("qwen3moe-zero3-bf16-small-ckpt", QWEN3_MOE, "zero3", "bf16-mixed", small=True, ckpt="full", micro=4, seq=256),
    _run("gemma3-zero2-fp32-small-s1024", GEMMA3, "zero2", "fp32", small=True, micro=2, seq=1024),
    _run("smollm3-zero1-bf16-small-s512", SMOLLM3, "zero1", "bf16-mixed", small=True, micro=4, seq=512),
    _run("gemma2-zero2-fp32-small-eager", GEMMA2, "zero2", "fp32", small=True, micro=2, seq=256),
    _run("deepseekv2-zero3-fp32-small", DEEPSEEK_V2, "zero3", "fp32", small=True, micro=2, seq=256),
    # logits-dominated (1-2k tokens, vocabularies of 32k-128k)
    _run("llama-v32k-zero0-fp32-small-t2048", LLAMA_32K, "zero0", "fp32", small=True, micro=1, seq=2048),
    _run("llama-v32k-zero3-bf16-small-t1024", LLAMA_32K, "zero3", "bf16-mixed", small=True, micro=2, seq=512),
    _run("llama-v32k-ddp-bf16-t1024", LLAMA_32K, "ddp", "bf16-mixed", micro=2, seq=512),
    _run("gpt2-v50k-zero1-bf16-small-t1024", GPT2_50K, "zero1", "bf16-mixed", small=True, micro=2, seq=512),
    _run("qwen2-v64k-zero1-bf16-small-ckpt-t2048", QWEN2_64K, "zero1", "bf16-mixed", small=True, ckpt="full",
         micro=2, seq=1024),
    _run("llama-v128k-zero2-bf16-small-t1024", LLAMA_128K, "zero2", "bf16-mixed", small=True, micro=1, seq=1024),
    _run("gpt2-v50k-zero3-bf16-small-ckpt-t1024", GPT2_50K, "zero3", "bf16-mixed", small=True, ckpt="full",
         micro=2, seq=512),
    # a tied embedding at few tokens: its gradient, summed at the embedding's backward, is the peak
    _run("qwen2-v64k-zero2-fp32-small-t128", QWEN2_64K, "zero2", "fp32", small=True, micro=1, seq=128),
    _run("gpt2-v50k-zero2-bf16-small-t128", GPT2_50K, "zero2", "bf16-mixed", small=True, micro=1, seq=128),
    _run("qwen2-v64k-zero1-fp32-small-t128", QWEN2_64K, "zero1", "fp32", small=True, micro=1, seq=128),
    _run("gpt2-v50k-zero1-fp32-small-t128", GPT2_50K, "zero1", "fp32", small=True, micro=1, seq=128),
    _run("qwen2-v64k-fsdp-fp32-t128", QWEN2_64K, "fsdp", "fp32", small=True, micro=1, seq=128),
    _run("gpt2-v50k-fsdp-fp32-t128", GPT2_50K, "fsdp", "fp32", micro=1, seq=128),
    _run("qwen2-v64k-ddp-fp32-t128", QWEN2_64K, "ddp", "fp32", micro=1, seq=128),
    _run("qwen2-v64k-zero3-fp32-small-t128", QWEN2_64K, "zero3", "fp32", small=True, micro=1, seq=128),
    # pipeline parallelism: every schedule, autocast, and PP x FSDP2 on a (pp, dp) mesh
    _run("llama-pp2-gpipe-fp32-m4", LLAMA, "fsdp", "fp32", pp=2, pp_schedule="gpipe", gradient_accumulation=4),
    _run("llama-pp2-interleaved-v2-fp32-m4", LLAMA, "fsdp", "fp32", pp=2, pp_schedule="interleaved",
         pp_virtual_stages=2, gradient_accumulation=4),
    _run("llama-pp2-1f1b-bf16-m4", LLAMA, "fsdp", "bf16-mixed", pp=2, gradient_accumulation=4),
    _run("llama-pp2-dp2-fsdp-1f1b-bf16-m4", LLAMA, "fsdp", "bf16-mixed", gpus=4, pp=2, gradient_accumulation=4),
    _run("llama-pp4-1f1b-fp32-m4", LLAMA, "fsdp", "fp32", gpus=4, pp=4, gradient_accumulation=4),
    # uneven stages (issue 25; Megatron's --decoder-first/last-pipeline-num-layers): the first stage
    # one block, the last three beside the head; six blocks over four stages as 1/2/2/1
    _run("llama-pp2-uneven-1-3-1f1b-fp32-m4", LLAMA, "fsdp", "fp32", pp=2, pp_first_stage_layers=1,
         pp_last_stage_layers=3, gradient_accumulation=4),
    _run("llama6-pp4-uneven-1-1-1f1b-bf16-m4", LLAMA | {"num_hidden_layers": 6}, "fsdp", "bf16-mixed", gpus=4,
         pp=4, pp_first_stage_layers=1, pp_last_stage_layers=1, gradient_accumulation=4),
    _run("llama-pp2-dp2-fsdp-gpipe-fp32-m2", LLAMA, "fsdp", "fp32", gpus=4, pp=2, pp_schedule="gpipe",
         gradient_accumulation=2),
    _run("llama-pp2-dp2-fsdp-interleaved-bf16-m4", LLAMA, "fsdp", "bf16-mixed", gpus=4, pp=2,
         pp_schedule="interleaved", pp_virtual_stages=2, gradient_accumulation=4),
    _run("llama-pp2-1f1b-fp32-ckpt-m4", LLAMA, "fsdp", "fp32", ckpt="full", pp=2, gradient_accumulation=4),
    # torch 2.13's breadth-first and DualPipeV schedules (issue 25; ZBV and InterleavedZeroBubble: CPU_RUNS)
    _run("llama-pp2-looped-bfs-v2-fp32-m4", LLAMA, "fsdp", "fp32", pp=2, pp_schedule="looped-bfs",
         pp_virtual_stages=2, gradient_accumulation=4),
    _run("llama-pp2-dualpipev-bf16-m4", LLAMA, "fsdp", "bf16-mixed", pp=2, pp_schedule="dualpipev",
         pp_virtual_stages=2, gradient_accumulation=4),
    _run("llama-pp2-dp2-fsdp-zbv-bf16-m4", LLAMA, "fsdp", "bf16-mixed", gpus=4, pp=2, pp_schedule="zbv",
         pp_virtual_stages=2, gradient_accumulation=4),
    # FSDP2 reducing in fp32 (reduce_dtype fp32, torchtitan's mixed_precision_reduce): the root unit's
    # fp32 reduce-scatter input at the end of backward (few tokens: the states are the peak), and
    # PP x FSDP2, whose unsharded gradients accumulate in fp32 over the micro-batches
    _run("llama-fsdp-bf16-reduce32-t32", LLAMA, "fsdp", "bf16-mixed", micro=1, seq=32, reduce_dtype="fp32"),
    _run("llama-pp2-dp2-fsdp-1f1b-bf16-reduce32-m4", LLAMA, "fsdp", "bf16-mixed", gpus=4, pp=2,
         gradient_accumulation=4, reduce_dtype="fp32"),
    _run("llama-tp2-fsdp2-bf16-reduce32-t256", LLAMA_TP, "fsdp", "bf16-mixed", tp=2, gpus=4, micro=1, seq=256,
         reduce_dtype="fp32"),
    # logits-dominated pipeline: a 32k vocabulary at 1,024 tokens per micro-batch, the last stage's
    # fp32 loss and held logits per micro-batch in flight
    _run("llama-v32k-pp2-1f1b-fp32-t1024", LLAMA_32K, "fsdp", "fp32", pp=2, micro=1, seq=1024,
         gradient_accumulation=2),
    # PP x TP on a (pp, dp, tp) mesh: each stage's blocks laid out by apply_tp (sequence parallel), the
    # last stage's loss by loss_parallel (backend/train_pipeline.py)
    _run("llama-pp2-tp2-1f1b-fp32-sp-t256-m4", LLAMA_TP, "fsdp", "fp32", gpus=4, tp=2, pp=2, micro=1, seq=256,
         gradient_accumulation=4),
    _run("llama-pp2-tp2-gpipe-bf16-sp-t256-m4", LLAMA_TP, "fsdp", "bf16-mixed", gpus=4, tp=2, pp=2, micro=1,
         seq=256, pp_schedule="gpipe", gradient_accumulation=4),
    # and x FSDP2 over dp 2 of the TP-sharded stages: a (pp 2, dp 2, tp 2) mesh on 8 ranks
    _run("llama-pp2-dp2-tp2-fsdp-1f1b-fp32-sp-t256-m4", LLAMA_TP, "fsdp", "fp32", gpus=8, tp=2, pp=2, micro=1,
         seq=256, gradient_accumulation=4),
    # ZeRO-3 with a tied embedding whose backward is the peak (the gathered embedding, the LM head's
    # held gradient and the embedding's own), at another vocabulary and length, and GPT-2's (learned positions)
    _run("qwen2-v32k-zero3-fp32-small-t64", QWEN2_32K, "zero3", "fp32", small=True, micro=1, seq=64),
    _run("gpt2-v50k-zero3-fp32-small-t128", GPT2_50K, "zero3", "fp32", small=True, micro=1, seq=128),
    # expert parallelism: dispatch-dominated (2,048 tokens x top-4: the last block's backward with its
    # all-to-all buffers is the peak), and ep 2 x expert-data-parallel 2 on 4 ranks under FSDP2's bf16
    _run("qwen3moe-ep2-fsdp-fp32-k4-v512-t2048", QWEN3_MOE_K4_V512, "fsdp", "fp32", ep=2, micro=2, seq=1024),
    _run("qwen3moe-ep2-fsdp2-bf16-4ranks-t512", QWEN3_MOE, "fsdp", "bf16-mixed", ep=2, gpus=4, micro=2, seq=256),
    # ep 4 over 4 ranks: two experts per rank, every all-to-all over four peers
    _run("qwen3moe-ep4-fsdp-fp32-4ranks-t512", QWEN3_MOE, "fsdp", "fp32", ep=4, gpus=4, micro=2, seq=256),
    # DeepSeek-V3's shape under ep: a dense first block, a shared expert beside the routed ones,
    # group-limited routing (n_group 4, topk_group 2) over all 8 experts on every rank
    _run("deepseekv3-ep2-fsdp-bf16-s256", DEEPSEEK_V3, "fsdp", "bf16-mixed", ep=2, micro=4, seq=256),
    # LoRA and QLoRA (issue 13): PEFT on the transformers model, bitsandbytes' nf4 base for QLoRA
    _run("llama-lora-zero2-bf16-small-all-s512", LLAMA, "zero2", "bf16-mixed", small=True, micro=2, seq=512,
         finetune="lora", lora_rank=16, lora_targets="all-linear"),
    _run("llama-qlora-zero2-bf16-small-all-s512", LLAMA, "zero2", "bf16-mixed", small=True, micro=2, seq=512,
         finetune="qlora", lora_rank=16, lora_targets="all-linear"),
    _run("llama-lora-zero3-bf16-small-qv", LLAMA, "zero3", "bf16-mixed", small=True, micro=2, seq=256,
         finetune="lora", lora_rank=8, lora_targets="q_proj,v_proj"),
    _run("llama-lora-zero3-bf16-small-all-r16-s512", LLAMA, "zero3", "bf16-mixed", small=True, micro=2, seq=512,
         finetune="lora", lora_rank=16, lora_targets="all-linear"),
    _run("llama-lora-fsdp-bf16-all", LLAMA, "fsdp", "bf16-mixed", micro=2, seq=256, finetune="lora", lora_rank=8,
         lora_targets="all-linear"),
    _run("qwen2-lora-ddp-fp32-dropout", QWEN2, "ddp", "fp32", micro=2, seq=256, finetune="lora", lora_dropout=0.1),
    # torch bf16-pure: the model cast to bf16, torch.optim.AdamW's states in the parameters' dtype
    _run("llama-fsdp-bf16pure-t512", LLAMA, "fsdp", "bf16-pure", micro=1, seq=512),
    _run("llama-ddp-bf16pure-t256", LLAMA, "ddp", "bf16-pure", micro=1, seq=256),
    # logits-dominated: 1,024 tokens, a 32k vocabulary, PEFT's default targets (q_proj, v_proj, r=8)
    _run("llama-v32k-lora-zero2-bf16-small-t1024", LLAMA_32K, "zero2", "bf16-mixed", small=True, micro=2, seq=512,
         finetune="lora"),
    _run("llama-qlora-zero2-bf16-small-ckpt-r32", LLAMA, "zero2", "bf16-mixed", small=True, ckpt="full", micro=4,
         seq=256, finetune="qlora", lora_rank=32, lora_targets="all-linear"),
    _run("llama-qlora-int8-zero2-bf16-small-all", LLAMA, "zero2", "bf16-mixed", small=True, micro=2, seq=256,
         finetune="qlora", quantize_base="int8", lora_targets="all-linear"),
    # tensor parallelism alone (dp 1: nothing wraps the model, the rank autocasts) with gradient
    # accumulation; its fp32 twin is in CPU_RUNS
    _run("llama-tp2-bf16-sp-t256-ga4", LLAMA_TP, "fsdp", "bf16-mixed", tp=2, micro=1, seq=256,
         gradient_accumulation=4),
    # gradient accumulation (2 micro-batches of 128 tokens: the states and gradients dominate): FSDP2
    # accumulating its reduce-scatter output into the sharded gradients (bf16 and fp32 reduce), DDP
    # under no_sync, ZeRO-1/2/3 accumulating in their partitions
    _run("llama-fsdp-bf16-ga2-t128", LLAMA, "fsdp", "bf16-mixed", micro=1, seq=128, gradient_accumulation=2),
    _run("llama-ddp-fp32-ga2-t128", LLAMA, "ddp", "fp32", micro=1, seq=128, gradient_accumulation=2),
    _run("llama-zero2-fp32-small-ga2-t128", LLAMA, "zero2", "fp32", small=True, micro=1, seq=128,
         gradient_accumulation=2),
    _run("llama-zero1-fp32-small-ga2-t128", LLAMA, "zero1", "fp32", small=True, micro=1, seq=128,
         gradient_accumulation=2),
    _run("llama-zero3-fp32-small-ga2-t128", LLAMA, "zero3", "fp32", small=True, micro=1, seq=128,
         gradient_accumulation=2),
    _run("llama-fsdp-bf16-reduce32-ga2-t128", LLAMA, "fsdp", "bf16-mixed", micro=1, seq=128,
         gradient_accumulation=2, reduce_dtype="fp32"),
    _run("llama-zero2-bf16-small-ga2-t128", LLAMA, "zero2", "bf16-mixed", small=True, micro=1, seq=128,
         gradient_accumulation=2),
    _run("llama-ddp-bf16-ga2-t128", LLAMA, "ddp", "bf16-mixed", micro=1, seq=128, gradient_accumulation=2),
    # the recipes as they are run (issue 21). keeps_outputs: accelerate's loop holds the outputs (their
    # logits in the training dtype) through backward, the optimizer step and the next forward;
    # logits-dominated (32k-50k vocabularies, 1-2k tokens) under autocast (DDP), ZeRO's bf16 model,
    # FSDP2's bf16 gather, fp32, and over two micro-batches
    _run("llama-v32k-ddp-bf16-keeps-t1024", LLAMA_32K, "ddp", "bf16-mixed", micro=2, seq=512, keeps_outputs=True),
    _run("llama-v32k-zero2-bf16-small-keeps-t1024", LLAMA_32K, "zero2", "bf16-mixed", small=True, micro=2, seq=512,
         keeps_outputs=True),
    _run("qwen2-v32k-fsdp-bf16-keeps-t1024", QWEN2_32K, "fsdp", "bf16-mixed", micro=1, seq=1024, keeps_outputs=True),
    _run("gpt2-v50k-zero1-fp32-small-keeps-t1024", GPT2_50K, "zero1", "fp32", small=True, micro=2, seq=512,
         keeps_outputs=True),
    _run("llama-v32k-zero3-bf16-small-keeps-ga2-t2048", LLAMA_32K, "zero3", "bf16-mixed", small=True, micro=1,
         seq=2048, gradient_accumulation=2, keeps_outputs=True),
    # composer's train metrics on one device (the metrics' phase the peak), under FSDP2 (fp32 under autocast over
    # FSDP2's bf16 logits; the start of backward the peak) and DeepSpeed (no autocast: bf16, as composer's null
    # precision context under DeepSpeed), over two micro-batches
    _run("llama-v32k-h512-single-bf16-ckpt-keeps-metrics2-t768", LLAMA_32K_H512, "single", "bf16-mixed", gpus=1,
         ckpt="full", micro=1, seq=768, keeps_outputs=True, train_metrics=2),
    _run("llama-v32k-fsdp-bf16-keeps-metrics2-ga2-t1024", LLAMA_32K, "fsdp", "bf16-mixed", micro=2, seq=512,
         gradient_accumulation=2, keeps_outputs=True, train_metrics=2),
    _run("llama-v32k-zero2-bf16-small-keeps-metrics2-t1024", LLAMA_32K, "zero2", "bf16-mixed", small=True, micro=2,
         seq=512, keeps_outputs=True, train_metrics=2),
    # strategy single: one device, the bare module under autocast (HF Trainer / accelerate on one GPU)
    _run("llama-single-bf16-t512", LLAMA, "single", "bf16-mixed", gpus=1, micro=2, seq=256),
    _run("llama-v32k-single-fp32-ckpt-keeps-t1024", LLAMA_32K, "single", "fp32", gpus=1, ckpt="full", micro=1,
         seq=1024, keeps_outputs=True),
    # QLoRA as it is run: a 4-bit base with bf16 compute, prepare_model_for_kbit_training (fp32 norms,
    # embeddings and head), torch.autocast bf16 (HF Trainer bf16=True), one device or DDP; the fp32
    # residual stream (planner/recipes/finetune.py lora_activations fp32_stream)
    _run("llama-qlora-single-bf16-all-t512", LLAMA, "single", "bf16-mixed", gpus=1, micro=2, seq=256,
         finetune="qlora", lora_targets="all-linear"),
    _run("llama-qlora-single-bf16-ckpt-all-r16-t1024", LLAMA, "single", "bf16-mixed", gpus=1, ckpt="full", micro=4,
         seq=256, finetune="qlora", lora_rank=16, lora_targets="all-linear"),
    _run("llama-qlora-single-bf16-fp4-nodq-all-t512", LLAMA, "single", "bf16-mixed", gpus=1, micro=2, seq=256,
         finetune="qlora", quantize_base="fp4", double_quant=False, lora_targets="all-linear"),
    _run("llama-qlora-ddp-bf16-all-t512", LLAMA, "ddp", "bf16-mixed", micro=2, seq=256, finetune="qlora",
         lora_targets="all-linear"),
    _run("llama-v32k-qlora-single-bf16-ckpt-t1024", LLAMA_32K, "single", "bf16-mixed", gpus=1, ckpt="full", micro=1,
         seq=1024, finetune="qlora"),
    _run("llama-v32k-qlora-single-bf16-keeps-t2048", LLAMA_32K, "single", "bf16-mixed", gpus=1, micro=2, seq=1024,
         finetune="qlora", keeps_outputs=True),
    # the int8 base as Axolotl's lora-8b runs it (checkpointed, r 32, embed_tokens and lm_head trained),
    # and under DDP with lora_dropout (each adapter's own fp32 copy and noise)
    _run("llama-int8-lora-single-bf16-ckpt-embed-r32-t1024", LLAMA, "single", "bf16-mixed", gpus=1, ckpt="full",
         micro=4, seq=256, finetune="qlora", quantize_base="int8", lora_rank=32, lora_targets="all-linear",
         train_embeddings=True),
    _run("llama-int8-lora-ddp-bf16-dropout-all-t512", LLAMA, "ddp", "bf16-mixed", micro=2, seq=256, finetune="qlora",
         quantize_base="int8", lora_targets="all-linear", lora_dropout=0.05),
    # checkpointing policies: torchtitan's per-op SAC (torch.utils.checkpoint's selective contexts
    # with its save list and every-second-mm rule: backend/checkpointing.py), every N-th block
    # (transformers' every_n_layers), Megatron's core-attention recompute (SDPA and eager)
    _run("llama-single-bf16-sacop-t1024", LLAMA, "single", "bf16-mixed", gpus=1, ckpt="selective-op", micro=4,
         seq=256),
    _run("llama-ddp-fp32-sacop-t512", LLAMA, "ddp", "fp32", ckpt="selective-op", micro=2, seq=256),
    _run("llama-zero2-bf16-small-sacop-t1024", LLAMA, "zero2", "bf16-mixed", small=True, ckpt="selective-op",
         micro=4, seq=256),
    _run("llama-single-fp32-every2-t1024", LLAMA, "single", "fp32", gpus=1, ckpt="full", checkpointing_every=2,
         micro=4, seq=256),
    _run("llama-ddp-bf16-every3-t1024", LLAMA, "ddp", "bf16-mixed", ckpt="full", checkpointing_every=3, micro=4,
         seq=256),
    _run("llama-single-bf16-selattn-t1024", LLAMA, "single", "bf16-mixed", gpus=1, ckpt="selective-attention",
         micro=4, seq=256),
    _run("llama-single-fp32-eager-selattn-t512", LLAMA, "single", "fp32", gpus=1, ckpt="selective-attention",
         attention="eager", micro=2, seq=256),
    # activation_offload: TRL's OffloadActivations around the forward and loss (backend/offload.py); on CPU
    # ranks the host copies are the rank's memory: the live total is the one without offloading plus the
    # tensors TRL keeps beside their copies, and the bytes TRL copied are measured (records'
    # measured_offloaded) against the predicted host-link bytes. With llama-offload-single-fp32-t512 (CPU_RUNS):
    _run("llama-offload-zero2-bf16-small-ckpt-t1024", LLAMA, "zero2", "bf16-mixed", small=True, ckpt="full", micro=4,
         seq=256, activation_offload=True),
    # predicted before they were run (the first two found the repeated saves and the forward's end at the loss)
    _run("llama-offload-ddp-bf16-t512", LLAMA, "ddp", "bf16-mixed", micro=2, seq=256, activation_offload=True),
    _run("qwen2-offload-zero1-fp32-small-t512", QWEN2, "zero1", "fp32", small=True, micro=2, seq=256,
         activation_offload=True),
    # transformers' TP x FSDP2 (backend/hf_tensor_parallel.py _distribution), logits-dominated
    _run("llama-v32k-tp2-fsdp2-hfplan-fp32-t1024", LLAMA_TP_32K, "fsdp", "fp32", tp=2, gpus=4, micro=1, seq=1024,
         tp_plan="transformers"),
    # loss=cce (Cut Cross-Entropy's torch_compile implementation on CPU ranks): logits-dominated at Llama-3's
    # vocabulary, and under ZeRO-2's bf16 (the logits and the weight's gradient bf16)
    _run("llama-v128k-single-fp32-cce-t1024", LLAMA_128K, "single", "fp32", gpus=1, micro=1, seq=1024, loss="cce"),
    _run("llama-v32k-zero2-bf16-cce-small-t1024", LLAMA_32K, "zero2", "bf16-mixed", small=True, micro=2, seq=512,
         loss="cce"),
    # loss=chunked (torchtune's chunked output loss, backend/losses.py), logits-dominated
    _run("llama-v32k-single-bf16-chunked-t2048", LLAMA_32K, "single", "bf16-mixed", gpus=1, micro=1, seq=2048,
         loss="chunked"),
    _run("llama-v32k-ddp-fp32-chunked4-t1024", LLAMA_32K, "ddp", "fp32", micro=2, seq=512, loss="chunked",
         loss_chunks=4),
    _run("llama-v32k-single-fp32-ckpt-chunked-t1024", LLAMA_32K, "single", "fp32", gpus=1, ckpt="full", micro=1,
         seq=1024, loss="chunked"),
    # loss=chunked-in-forward on one device under autocast (the hidden states fp32, the head's per-slice gradient
    # cast to fp32), checkpointed, and under TP x FSDP2 in bf16 on four ranks
    _run("llama-v32k-single-bf16-chunkfwd-t2048", LLAMA_32K, "single", "bf16-mixed", gpus=1, micro=1, seq=2048,
         loss="chunked-in-forward"),
    _run("llama-v32k-single-fp32-ckpt-chunkfwd4-t1024", LLAMA_32K, "single", "fp32", gpus=1, ckpt="full", micro=1,
         seq=1024, loss="chunked-in-forward", loss_chunks=4),
    _run("llama-v32k-tp2-fsdp2-bf16-sp-chunkfwd-t1024", LLAMA_TP_32K, "fsdp", "bf16-mixed", tp=2, gpus=4, micro=2,
         seq=512, loss="chunked-in-forward"),
    # optimizers, each from its own library on CPU ranks; at 64 tokens the
    # states dominate the resident and the step's temporaries (bitsandbytes' CPU path, Muon's Newton-Schulz,
    # Adafactor's full-size estimate) can set the peak
    *[run for run in OPTIMIZER_RUNS if run not in CPU_RUNS],
]

# Measured and reported by bench/accuracy.py, not asserted: runs the model misses by more than
# TOLERANCE (README, "Known misses"). Each stays here until the model explains it.
KNOWN_MISSES: list = []
# Within TOLERANCE but outside the README's 3% target, unexplained yet: asserted within TOLERANCE only
# (tests/test_records.py), shown as they are in the accuracy table.
TARGET_MISSES: dict[str, str] = {
    "llama-tp2-zero2-fp32-small-4ranks-s256": "DeepSpeed AutoTP + ZeRO-2: peak -3.4%, a race between threads: on "
                                              "some rank-steps gloo's worker still holds the LM head gather's input "
                                              "and output (6 MiB) into the loss; on the others the peak is the "
                                              "modelled start of backward to 152 bytes (peak trace)",
}
TOLERANCE = 0.05

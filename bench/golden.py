"""Golden dumps: the exact outputs of `planner estimate` / `plan` for a broad fixed set of requests.

A refactor that means to change no behaviour runs this before and after and compares the two
directories (`diff -r`): every byte the CLI prints (stdout, stderr, exit code) and every file
`--emit` writes, one directory per case.

    python bench/golden.py OUT_DIR [--only SUBSTRING]

The cases run in this process through `cli.main.main(argv)` with the standard streams captured,
which prints what the `planner` process prints (the process differs only in its garbage-collector
settings); the plan's own search time is masked (see `_masked`). Files a case reads (a DeepSpeed
JSON, a config.json) and the `--emit` directories sit under one fixed scratch path, so paths
printed in the outputs are the same on every run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import shutil
import sys
import time
from pathlib import Path

SCRATCH = Path("/tmp/planner-golden-scratch")

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": 200000000, "stage3_prefetch_bucket_size": 50000000,
                          "stage3_param_persistence_threshold": 100000, "offload_optimizer": {"device": "cpu"}},
}
DS_CONFIG_Z2 = {
    "train_micro_batch_size_per_gpu": 1,
    "fp16": {"enabled": True},
    "zero_optimization": {"stage": 2, "allgather_bucket_size": 100000000, "reduce_bucket_size": 100000000},
}
# A model_type the analytic core has no reader for (traced on fake tensors by backend/trace.py) and a
# tiny llama (the same shapes tests/test_trace.py uses).
STARCODER2 = {"model_type": "starcoder2", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
                    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
                    "n_routed_experts": 64, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
                    "q_lora_rank": None, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "v_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1}
TINY_LLAMA = {"model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688,
              "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}

FILES = {"ds3.json": DS_CONFIG, "ds2.json": DS_CONFIG_Z2, "starcoder2.json": STARCODER2,
         "tiny-llama.json": TINY_LLAMA,
         "deepseek-v2-lite.json": DEEPSEEK_V2_LITE}

FAMILIES = ["mistral-7b-v0.1", "llama-2-7b", "llama-3-8b", "llama-3.2-1b", "qwen2.5-7b", "gemma-2-9b",
            "mixtral-8x7b", "gpt2", "falcon-7b", "phi-3-mini-4k", "qwen3-8b", "qwen3-30b-a3b", "deepseek-v3",
            "gemma-3-4b", "gpt-oss-20b", "olmo-2-7b", "llama-4-scout", "smollm3-3b"]
STRATEGIES = ["ddp", "fsdp", "fsdp-grad-op", "hsdp", "zero0", "zero1", "zero2", "zero3"]


def _cases() -> list[tuple[str, list[str]]]:
    s = str(SCRATCH)
    cases: list[tuple[str, list[str]]] = [
        ("models", ["models", "--json"]),
        ("models-text", ["models"]),
        ("gpus", ["gpus", "--json"]),
        ("topo-list", ["topo", "--list"]),
        ("topo-hgx-h100", ["topo", "--preset", "hgx-h100", "--json"]),
    ]
    for model in FAMILIES:
        cases.append((f"est-{model}", ["estimate", "--model", model, "--strategy", "zero3", "--gpus", "8",
                                       "--nodes", "2", "--seq-len", "2048"]))
        cases.append((f"plan-{model}", ["plan", "--model", model, "--gpus", "8", "--nodes", "2",
                                        "--seq-len", "2048"]))
    for strategy in STRATEGIES:
        cases.append((f"est-strategy-{strategy}", ["estimate", "--model", "llama-3-8b", "--strategy", strategy,
                                                   "--gpus", "8", "--nodes", "2", "--micro-batch", "2",
                                                   "--seq-len", "4096", "--gradient-accumulation", "4"]))
        cases.append((f"est-strategy-{strategy}-cpu", ["estimate", "--model", "qwen2.5-0.5b", "--strategy",
                                                       strategy, "--gpus", "4", "--gpu", "cpu",
                                                       "--device-memory-gib", "16", "--seq-len", "256"]))
    more = {
        "est-params": ["estimate", "--params", "7B", "--strategy", "zero2"],
        "est-tp": ["estimate", "--model", "llama-3-70b", "--strategy", "fsdp", "--tp", "8", "--nodes", "4"],
        "est-tp-nosp": ["estimate", "--model", "llama-3-70b", "--strategy", "fsdp", "--tp", "4",
                        "--sequence-parallel", "false", "--nodes", "2"],
        "est-pp": ["estimate", "--model", "llama-3-70b", "--strategy", "fsdp", "--pp", "4", "--nodes", "2",
                   "--micro-batch", "1", "--gradient-accumulation", "8"],
        "est-pp-interleaved": ["estimate", "--model", "llama-3-70b", "--strategy", "fsdp", "--pp", "4",
                               "--pp-schedule", "interleaved", "--pp-virtual-stages", "2",
                               "--gradient-accumulation", "8"],
        "est-pp-gpipe-zero1": ["estimate", "--model", "llama-3-8b", "--strategy", "zero1", "--pp", "2",
                               "--pp-schedule", "gpipe", "--gradient-accumulation", "4"],
        "est-pp-gpipe-fsdp": ["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--pp", "2",
                              "--pp-schedule", "gpipe", "--gradient-accumulation", "4"],
        "est-pp-zero1": ["estimate", "--model", "llama-3-8b", "--strategy", "zero1", "--pp", "2",
                         "--gradient-accumulation", "4"],
        "plan-deepseek-v3-cp1": ["plan", "--model", "deepseek-v3", "--cp", "1", "--nodes", "32"],
        "est-cp": ["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--cp", "4", "--seq-len", "32768"],
        "est-cp-tp": ["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--cp", "2", "--tp", "2",
                      "--seq-len", "16384"],
        "est-hsdp-cp": ["estimate", "--model", "llama-3-8b", "--strategy", "hsdp", "--cp", "2", "--nodes", "2",
                        "--hsdp-shard-size", "8", "--seq-len", "16384"],
        "est-ep": ["estimate", "--model", "mixtral-8x7b", "--strategy", "fsdp", "--ep", "8", "--nodes", "2"],
        "est-ep-qwen3moe": ["estimate", "--model", "qwen3-30b-a3b", "--strategy", "fsdp", "--ep", "4",
                            "--tp", "2"],
        "est-mla-tp-cp": ["estimate", "--model", "deepseek-v3", "--strategy", "fsdp", "--ep", "8",
                          "--pp", "4", "--nodes", "4", "--gradient-accumulation", "8"],
        "est-mla-tp-refused": ["estimate", "--model", "deepseek-v3", "--strategy", "fsdp", "--tp", "2",
                               "--nodes", "16"],
        "est-mla-v2-lite": ["estimate", "--model-file", f"{s}/deepseek-v2-lite.json", "--strategy", "zero3",
                            "--checkpointing", "full"],
        "est-mla-v2-lite-ep-pp": ["estimate", "--model-file", f"{s}/deepseek-v2-lite.json", "--strategy",
                                  "fsdp", "--ep", "4", "--pp", "2", "--gradient-accumulation", "4"],
        "plan-mla-v2-lite": ["plan", "--model-file", f"{s}/deepseek-v2-lite.json", "--gpus", "8"],
        "est-mla-cp": ["estimate", "--model", "deepseek-v3", "--strategy", "fsdp", "--cp", "2", "--ep", "8",
                       "--nodes", "16", "--seq-len", "8192"],
        "est-lora": ["estimate", "--model", "llama-3-8b", "--strategy", "ddp", "--finetune", "lora",
                     "--lora-rank", "16", "--gpus", "1"],
        "est-lora-targets": ["estimate", "--model", "qwen3-8b", "--strategy", "fsdp", "--finetune", "lora",
                             "--lora-rank", "64", "--lora-alpha", "128", "--lora-targets", "q_proj,v_proj",
                             "--lora-dropout", "0.1", "--train-embeddings"],
        "est-qlora": ["estimate", "--model", "llama-3-70b", "--strategy", "zero1", "--finetune", "qlora",
                      "--quantize-base", "nf4", "--gpus", "1", "--gpu", "h100-80gb"],
        "est-qlora-int8": ["estimate", "--model", "mistral-7b-v0.1", "--strategy", "zero2", "--finetune",
                           "qlora", "--quantize-base", "int8", "--gpus", "2"],
        "est-lora-mla": ["estimate", "--model", "deepseek-v3", "--strategy", "zero3", "--finetune", "lora",
                         "--nodes", "8"],
        "est-offload-opt": ["estimate", "--model", "llama-3-70b", "--strategy", "zero3", "--offload-optimizer",
                            "cpu"],
        "est-offload-both": ["estimate", "--model", "llama-3-70b", "--strategy", "zero3", "--offload-optimizer",
                             "cpu", "--offload-params", "cpu", "--host-memory-gib", "512"],
        "est-offload-nvme": ["estimate", "--model", "llama-3-70b", "--strategy", "zero3", "--offload-optimizer",
                             "nvme", "--offload-params", "nvme"],
        "est-offload-fsdp": ["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--offload-params", "cpu",
                             "--offload-optimizer", "cpu"],
        "est-offload-zero2": ["estimate", "--model", "llama-3-8b", "--strategy", "zero2", "--offload-optimizer",
                              "cpu"],
        "est-ckpt-full": ["estimate", "--model", "llama-3-8b", "--strategy", "zero3", "--checkpointing", "full",
                          "--micro-batch", "4", "--seq-len", "8192"],
        "est-ckpt-full-fsdp-eager": ["estimate", "--model", "gemma-2-9b", "--strategy", "fsdp", "--checkpointing",
                                     "full", "--attention", "eager"],
        "est-fp16": ["estimate", "--model", "llama-3-8b", "--strategy", "zero2", "--precision", "fp16-mixed"],
        "est-bf16-pure-8bit": ["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--precision",
                               "bf16-pure", "--optimizer", "adamw-8bit"],
        "est-fp32-sgd": ["estimate", "--model", "gpt2-xl", "--strategy", "ddp", "--precision", "fp32",
                         "--optimizer", "sgd"],
        "est-reduce-fp32": ["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--reduce-dtype", "fp32"],
        "est-buckets": ["estimate", "--model", "llama-3-8b", "--strategy", "zero3", "--reduce-bucket-size",
                        "100000000", "--allgather-bucket-size", "300000000", "--prefetch-bucket-size", "20000000",
                        "--param-persistence-threshold", "50000", "--max-live-parameters", "500000000",
                        "--max-reuse-distance", "500000000"],
        "est-ds-config": ["estimate", "--model", "llama-3-8b", "--ds-config", f"{s}/ds3.json"],
        "est-ds-config-z2": ["estimate", "--model", "mistral-7b-v0.1", "--ds-config", f"{s}/ds2.json",
                             "--gpus", "4"],
        "est-vision": ["estimate", "--model", "gemma-3-27b", "--strategy", "fsdp", "--include-vision"],
        "est-vision-llama4": ["estimate", "--model", "llama-4-scout", "--strategy", "fsdp", "--include-vision",
                              "--ep", "8", "--nodes", "2"],
        "est-topology": ["estimate", "--model", "llama-3-8b", "--strategy", "zero3", "--gpu", "rtx-4090",
                         "--topology", "pcie-8x-rtx4090"],
        "est-fabric": ["estimate", "--model", "llama-3-70b", "--strategy", "zero3", "--nodes", "4", "--fabric",
                       "roce-100g", "--nics-per-node", "2"],
        "est-model-file": ["estimate", "--model-file", f"{s}/tiny-llama.json", "--strategy", "zero3", "--gpus",
                           "2", "--gpu", "cpu", "--seq-len", "128", "--micro-batch", "2"],
        "est-traced": ["estimate", "--model-file", f"{s}/starcoder2.json", "--strategy", "zero3", "--gpus", "2",
                       "--gpu", "cpu", "--seq-len", "128", "--micro-batch", "2"],
        "est-traced-zero2": ["estimate", "--model-file", f"{s}/starcoder2.json", "--strategy", "zero2",
                             "--gpus", "2", "--gpu", "h100-80gb", "--seq-len", "128"],
        "est-refused-tp": ["estimate", "--model", "llama-3-8b", "--tp", "3"],
        "est-refused-strategy": ["estimate", "--model", "llama-3-8b", "--strategy", "zero3", "--tp", "2"],
        "est-refused-model": ["estimate", "--model", "no-such-model"],
        "plan-tp": ["plan", "--model", "llama-3-70b", "--gpus", "8", "--nodes", "4", "--tp", "8"],
        "plan-pp-ep": ["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--nodes", "2", "--pp", "2", "--ep", "4"],
        "plan-objective-cost": ["plan", "--model", "llama-3-8b", "--objective", "cost", "--global-batch", "64"],
        "plan-objective-memory": ["plan", "--model", "llama-3-8b", "--objective", "memory", "--gpu", "rtx-4090",
                                  "--topology", "pcie-8x-rtx4090"],
        "plan-lora": ["plan", "--model", "llama-3-70b", "--finetune", "lora", "--gpus", "4"],
        "plan-auto-ft": ["plan", "--model", "llama-3-70b", "--finetune", "auto", "--gpu", "rtx-4090", "--gpus",
                         "2", "--topology", "workstation-2x-rtx4090"],
        "plan-qlora": ["plan", "--model", "qwen2.5-72b", "--finetune", "qlora", "--gpus", "2"],
        "plan-headroom": ["plan", "--model", "llama-3-8b", "--headroom", "0.2", "--compute-efficiency", "0.5",
                          "--link-efficiency", "0.7", "--precision", "fp16-mixed", "--optimizer", "adamw-8bit"],
        "plan-longseq": ["plan", "--model", "llama-3-8b", "--seq-len", "131072", "--nodes", "2"],
        "plan-cpu": ["plan", "--model", "qwen2.5-0.5b", "--gpu", "cpu", "--gpus", "4", "--seq-len", "256"],
        "plan-vision": ["plan", "--model", "gemma-3-4b", "--include-vision", "--gpus", "4"],
        "plan-traced-refused": ["plan", "--model-file", f"{s}/starcoder2.json", "--gpu", "rtx-4090", "--gpus", "2"],
        "plan-too-big": ["plan", "--model", "llama-3.1-405b", "--gpu", "l4", "--gpus", "1"],
    }
    cases.extend(more.items())
    emits = {
        "emit-est-zero3": ["estimate", "--model", "llama-3-8b", "--strategy", "zero3", "--nodes", "2"],
        "emit-est-zero2-offload": ["estimate", "--model", "llama-3-8b", "--strategy", "zero2",
                                   "--offload-optimizer", "cpu", "--gradient-accumulation", "4"],
        "emit-est-zero1-pp": ["estimate", "--model", "llama-3-8b", "--strategy", "zero1", "--pp", "2",
                              "--gradient-accumulation", "4"],
        "emit-est-ddp": ["estimate", "--model", "llama-3.2-1b", "--strategy", "ddp", "--gpus", "4"],
        "emit-est-fsdp-tp": ["estimate", "--model", "llama-3-70b", "--strategy", "fsdp", "--tp", "4", "--nodes",
                             "2", "--checkpointing", "full"],
        "emit-est-fsdp-pp-cp": ["estimate", "--model", "llama-3-70b", "--strategy", "fsdp", "--pp", "2", "--cp",
                                "2", "--nodes", "2", "--seq-len", "16384", "--gradient-accumulation", "8"],
        "emit-est-hsdp": ["estimate", "--model", "llama-3-8b", "--strategy", "hsdp", "--nodes", "2"],
        "emit-est-fsdp-grad-op": ["estimate", "--model", "llama-3-8b", "--strategy", "fsdp-grad-op"],
        "emit-est-ep": ["estimate", "--model", "mixtral-8x7b", "--strategy", "fsdp", "--ep", "8"],
        "emit-est-lora": ["estimate", "--model", "llama-3-8b", "--strategy", "ddp", "--finetune", "lora",
                          "--gpus", "2"],
        "emit-est-qlora-zero3": ["estimate", "--model", "llama-3-70b", "--strategy", "zero2", "--finetune",
                                 "qlora", "--quantize-base", "nf4"],
        "emit-est-ds-config": ["estimate", "--model", "llama-3-8b", "--ds-config", f"{s}/ds3.json"],
        "emit-est-script": ["estimate", "--model", "llama-3-8b", "--strategy", "zero3", "--script",
                            "train.py --epochs 1"],
        "emit-est-script-fsdp": ["estimate", "--model", "llama-3-8b", "--strategy", "fsdp", "--script",
                                 "train.py --lr 1e-4"],
        "emit-est-cpu": ["estimate", "--model", "qwen2.5-0.5b", "--strategy", "zero3", "--gpu", "cpu", "--gpus",
                         "2", "--device-memory-gib", "16", "--seq-len", "256"],
        "emit-plan": ["plan", "--model", "llama-3-8b", "--nodes", "2"],
        "emit-plan-pick": ["plan", "--model", "llama-3-70b", "--nodes", "2", "--pick", "3"],
        "emit-plan-lora": ["plan", "--model", "llama-3-70b", "--finetune", "lora", "--gpus", "4"],
        "emit-plan-moe": ["plan", "--model", "mixtral-8x7b", "--nodes", "2", "--ep", "8"],
    }
    for name, argv in emits.items():
        cases.append((name, argv + ["--emit", f"{s}/emit/{name}"]))
    return cases


# The plan's note of its own search time is the one output that differs between two runs of the
# same code (planner/plan/search.py: "N candidates evaluated in S s"); it is masked, the count kept.
_SEARCH_SECONDS = re.compile(r"(candidates evaluated in )[0-9.]+( s)")


def _masked(text: str) -> str:
    return _SEARCH_SECONDS.sub(r"\1<seconds>\2", text)


def _run(argv: list[str]) -> tuple[int, str, str]:
    from cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's --help and refusals end the process
            code = exc.code if isinstance(exc.code, int) else 1
    return code, _masked(out.getvalue()), _masked(err.getvalue())


def write_case(out_dir: Path, name: str, argv: list[str]) -> None:
    case_dir = out_dir / name
    case_dir.mkdir(parents=True)
    emit_dir = SCRATCH / "emit" / name
    if emit_dir.exists():
        shutil.rmtree(emit_dir)
    (case_dir / "argv").write_text(" ".join(argv) + "\n")
    variants = [("text", argv), ("json", argv + ["--json"])] if argv[0] in ("estimate", "plan") else [("out", argv)]
    for label, args in variants:
        if emit_dir.exists():
            shutil.rmtree(emit_dir)
        code, stdout, stderr = _run(args)
        (case_dir / f"{label}.stdout").write_text(stdout)
        (case_dir / f"{label}.stderr").write_text(stderr)
        (case_dir / f"{label}.rc").write_text(f"{code}\n")
    if emit_dir.exists():
        for path in sorted(emit_dir.rglob("*")):
            if path.is_file():
                target = case_dir / "emitted" / path.relative_to(emit_dir)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(_masked(path.read_text()).encode())
                mode = "x" if path.stat().st_mode & 0o111 else "-"
                (target.parent / (target.name + ".mode")).write_text(mode + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write (must not exist)")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this")
    args = parser.parse_args(argv)
    if args.out_dir.exists():
        parser.error(f"{args.out_dir} exists; golden dumps go into a fresh directory")
    if SCRATCH.exists():
        shutil.rmtree(SCRATCH)
    SCRATCH.mkdir(parents=True)
    for name, content in FILES.items():
        (SCRATCH / name).write_text(json.dumps(content, indent=2))
    started = time.perf_counter()
    cases = [c for c in _cases() if args.only is None or args.only in c[0]]
    for name, case_argv in cases:
        write_case(args.out_dir, name, case_argv)
    print(f"{len(cases)} cases into {args.out_dir} in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""load_model.py: how a training script of its own loads the model for tp_plan=transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from planner.setup import Setup

TORCH_DTYPE = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32"}


def hf_tp_loader(setup: "Setup") -> str:
    """What a training script of its own does to get the layout tp_plan=transformers estimates:
    the model sharded by its own plan while it loads (transformers 5.25 from_pretrained: tp_plan
    becomes DistributedConfig(tp_plan="auto"), over the WORLD_SIZE ranks torchrun or accelerate
    start), trained with the model's own loss on the gathered logits. launch.sh runs the planner's
    trainer, which loads it the same way (backend/hf_tensor_parallel.py)."""
    req = setup.request
    dtype = TORCH_DTYPE[setup.recipe.compute] if setup.recipe.casts_model else "torch.float32"
    source = repr(req.model) if req.model else '"path/to/your/checkpoint"  # a Hub id or the directory of config.json'
    data_parallel = setup.world_size // setup.tp
    if data_parallel == 1:
        how, imports, load = (" (torchrun, one process per GPU).", [], "tp_plan=\"auto\"")
    else:
        # transformers 5.25 drops from_pretrained's device_mesh when tp_plan is given and spans the
        # plan over the whole world, so accelerate's FSDP2 over a (dp_shard, tp) mesh then fails
        # (backend/hf_tensor_parallel.py _distribution, measured on CPU ranks): transformers composes
        # the two itself, its fsdp plan as the estimate models (planner/frameworks/torch/v2.py)
        how = (f"; transformers applies FSDP2 over dp_shard={data_parallel} itself (DistributedConfig), so the script "
               "does not wrap the model in FSDP again.")
        imports = ["from transformers.distributed import DistributedConfig"]
        load = f"distributed_config=DistributedConfig(tp_plan=\"auto\", tp_size={setup.tp}, fsdp_size={data_parallel})"
    lines = [
        f"# tp_plan=transformers: the model split over tp={setup.tp} ranks by its own tp_plan while it loads",
        "# (embedding and lm_head over vocabulary rows, q/k/v/o and the MLP by heads and columns, the logits",
        "# gathered whole on every rank). Start the script with the launcher of launch.sh" + how,
        "import torch",
        "from transformers import AutoModelForCausalLM",
        *imports,
        "",
        f"checkpoint = {source}",
        f"model = AutoModelForCausalLM.from_pretrained(checkpoint, {load}, dtype={dtype})",
        "# train with the model's own loss: outputs = model(input_ids=ids, labels=ids); outputs.loss.backward()",
    ]
    if setup.recipe.autocast_dtype:
        lines.append(f"# under torch.autocast(dtype={TORCH_DTYPE[setup.recipe.autocast_dtype]}) (accelerate's mixed_precision)")
    return "\n".join(lines) + "\n"

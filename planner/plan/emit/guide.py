"""LAUNCH.md: what each emitted file is and how to run it; the framework's own sections come from
its launcher (planner/frameworks/launcher.py)."""

from __future__ import annotations

from planner.plan.emit.accelerate import TRAINER_OPTIM, parallelism_config
from planner.plan.emit.shell import what_runs
from planner.plan.emit.spec import Launch, layout_words


def guide(launch: Launch, names: list[str], layout: list[str]) -> str:
    """LAUNCH.md: what each file is and how to run it. ``layout``: the section of the trainer whose
    config the framework wrote beside (Launcher.layout_guide: torchtitan's)."""
    req = launch.request
    roles = {
        "launch.sh": "the command for one node (deepspeed or torchrun); see its header",
        "job.sbatch": "the same under Slurm: `sbatch job.sbatch` from this directory",
        "hostfile": "DeepSpeed multi-node: list the nodes here before running launch.sh",
        "ds_config.json": "the DeepSpeed config the prediction assumed",
        "accelerate_config.yaml": "the same choice for `accelerate launch`",
        "trainer_args.json": "the matching transformers.TrainingArguments keyword arguments",
        "plan.json": "the request and the prediction; `planner verify --plan plan.json` runs it here",
        "torchtitan.toml": "the same degrees as a torchtitan job config (merge into your model's train config)",
        "megatron_args.txt": "the same pipeline layout as Megatron-LM arguments (its uneven first and last stages, "
                             "batch and recomputation; the first line says which data-parallel states it holds)",
        "lora_config.json": "the PEFT LoraConfig the prediction assumed: `get_peft_model(model, "
                            "LoraConfig(**json.load(open('lora_config.json'))))`",
        "bnb_config.json": "the quantized base: `from_pretrained(..., quantization_config=BitsAndBytesConfig("
                           "**json.load(open('bnb_config.json'))))`, then `prepare_model_for_kbit_training`",
        "load_model.py": "how your script loads the model for the estimated layout: `from_pretrained(..., "
                         "tp_plan=\"auto\")`, transformers' own tensor parallelism (tp_plan=transformers)",
        "LAUNCH.md": "this file",
    }
    script = launch.script.path if launch.script else "your_train.py"
    accelerate = "accelerate launch --config_file accelerate_config.yaml"
    if req.nodes > 1:
        accelerate += " --machine_rank $NODE_RANK --main_process_ip $MASTER_ADDR"
    model_parallel = "".join(f" x {n} {launch.degree(n)}" for n in ("tp", "cp", "pp", "ep") if launch.degree(n) > 1)
    out = [f"# Launching {launch.strategy}{model_parallel} on {req.nodes} x {req.gpus} {req.gpu}", "",
           f"planner: {launch.summary}", "", "## Files", ""]
    out += [f"- `{name}`: {roles[name]}" for name in names]
    out += ["", "## Run it", ""]
    if launch.unavailable:
        out += [f"No launch.sh or job.sbatch: {launch.unavailable}. Emit again with `--script 'your_train.py ARGS'` "
                "to get them for your own script."]
    else:
        out += [f"`./launch.sh` runs {what_runs(launch)}."]
        if launch.script is None:
            out += ["", "Arguments go to the trainer: `./launch.sh --steps 10 --warmup 2` trains longer; "
                    "`PLANNER_OUT=DIR` moves the records; `PLANNER_ROOT=/path/to/planner` finds the trainer in a "
                    "checkout that is not installed."]
        else:
            out += launch.launcher.script_note()
    if req.nodes > 1 and not launch.unavailable:
        out += ["", "Several nodes: under Slurm, `sbatch job.sbatch` (it derives the node rank from `SLURM_NODEID` and "
                "the master address from the first host of the allocation). Otherwise "
                + launch.launcher.multi_node_note()]
    batch = req.micro_batch * req.gradient_accumulation * launch.data_parallel
    out += ["", f"Global batch: micro-batch {req.micro_batch} x {req.gradient_accumulation} accumulation x "
            f"{launch.data_parallel} data-parallel ranks = {batch} sequences per optimizer step "
            f"({layout_words(launch)})."]
    engine = launch.launcher.pipeline_guide(launch, script)
    if engine is not None:  # a pipeline the framework's own engine runs: no accelerate, Trainer or torchtitan
        out += [""] + engine
        return "\n".join(out)
    if launch.accelerate_layout is not None:
        out += ["", f"No accelerate_config.yaml or trainer_args.json: {launch.accelerate_layout}; "
                "launch.sh" + (" and torchtitan.toml apply" if "torchtitan.toml" in names else " applies")
                + " the whole layout.", ""]
    else:
        out += _accelerate_guide(launch, accelerate, script)
    return _guide_tail(launch, out, names, layout)


def _accelerate_guide(launch: Launch, accelerate: str, script: str) -> list[str]:
    """LAUNCH.md's section for accelerate and the Trainer (the layouts accelerate has)."""
    req = launch.request
    out: list[str] = []
    if launch.launcher.accelerate_applies_tp and launch.degree("tp") > 1:
        out += ["", "accelerate applies tensor parallelism to a model loaded with `from_pretrained(..., "
                f"tp_plan=\"auto\")` (it checks the model's tp size against tp_size {launch.degree('tp')})."]
    out += ["", "## With Hugging Face accelerate or the Trainer", "",
            "For a script of your own that uses `transformers.Trainer` or `accelerate.Accelerator`, from this directory:",
            "", "```", f"{accelerate} {script}", "```", ""]
    if req.optimizer not in TRAINER_OPTIM:
        return out + [f"transformers' TrainingArguments name no optimizer that is {req.optimizer} (its \"adafactor\" "
                      "is transformers' own Adafactor; it has no Muon): the script builds torch's and passes it to "
                      "the Trainer (optimizers=(optimizer, None)), so no trainer_args.json is written."]
    out += ["with these `TrainingArguments` (trainer_args.json):", "", "```python",
            "import json", ""]
    parallel = parallelism_config(launch)
    if parallel:
        out += ["from accelerate.parallelism_config import ParallelismConfig",
                "from transformers import TrainingArguments", "",
                f"# {layout_words(launch)} (accelerate_config.yaml carries the same)",
                'args = TrainingArguments(output_dir="out", **json.load(open("trainer_args.json")),',
                "                         parallelism_config=ParallelismConfig("
                + ", ".join(f"{k}={v}" for k, v in parallel.items()) + "))"]
    else:
        out += ["from transformers import TrainingArguments", "",
                'args = TrainingArguments(output_dir="out", **json.load(open("trainer_args.json")))']
    out += ["```", "",
            "These arguments carry the same DeepSpeed / FSDP choice, so the script also runs under plain "
            f"`torchrun --nproc_per_node {req.gpus} {script}`" + (" (with --nnodes, --node_rank and --master_addr "
                                                                  "on each node)" if req.nodes > 1 else "") + ".", ""]
    return out


def _guide_tail(launch: Launch, out: list[str], names: list[str], layout: list[str]) -> str:
    out += layout
    if launch.recipe.casts_model:
        out += ["bf16-pure: load the model in bf16 (`from_pretrained(..., dtype=torch.bfloat16)`); "
                "no autocast, no fp32 master copy.", ""]
    if "ds_config.json" in names and "trainer_args.json" in names:
        out += ["The Trainer checks `trainer_args.json` against `ds_config.json` (batch, accumulation, learning rate, "
                "precision): change both together.", ""]
    return "\n".join(out)

"""The per-format key tables as one Markdown page (docs/JOBFILES.md is this text; a test keeps the
two equal)."""

from __future__ import annotations

from planner.jobfiles.common import HF_OPTIMIZERS
from planner.jobfiles import accelerate_config, axolotl, hf_trainer, llamafactory, torchtitan_job
from planner.jobfiles.keys import Key, schema_accepts, table_rows

TABLES: tuple[tuple[str, str, dict[str, Key]], ...] = (
    ("torchtitan (TOML of 0.2; 0.3 launch line)", "planner/jobfiles/torchtitan_job.py",
     {**torchtitan_job.TABLE, **torchtitan_job.LAUNCH_ONLY}),
    ("accelerate config YAML", "planner/jobfiles/accelerate_config.py", accelerate_config.TOP),
    ("accelerate deepspeed_config section", "planner/jobfiles/accelerate_config.py", accelerate_config.DEEPSPEED),
    ("accelerate fsdp_config section", "planner/jobfiles/accelerate_config.py", accelerate_config.FSDP),
    ("transformers TrainingArguments", "planner/jobfiles/hf_trainer.py", hf_trainer.TRAINING_ARGUMENTS),
    ("TRL SFTConfig, ModelConfig, ScriptArguments (beside TrainingArguments)", "planner/jobfiles/hf_trainer.py",
     hf_trainer.TRL),
    ("Axolotl", "planner/jobfiles/axolotl.py", axolotl.TABLE),
    ("LLaMA-Factory (beside TrainingArguments)", "planner/jobfiles/llamafactory.py", llamafactory.OWN),
)

HEADER = """# Job files: every key, per format

`planner check FILE...`, `planner estimate|plan|verify --from FILE...` and `POST /v1/check` read these
formats. Each key is **modelled** (read into the request), **inert** (changes neither memory nor time:
the reason says why), **refused** (changes memory or time in a way not modelled: accepted only at a value
that changes nothing, refused by name otherwise) or **needs** (modelled once the request schema has the
field named; refused by name until then). A key in no table is listed in the answer as unknown.
A DeepSpeed JSON named by any of them is read by planner/frameworks/deepspeed/config.py (its own tables), with the HF
Trainer's "auto" values filled in. Generated from the tables in the code by
`python -m planner.jobfiles.tables > docs/JOBFILES.md`.
"""


def pending_values() -> list[tuple[str, str]]:
    """Values of modelled keys that wait for a schema value agreed across issues (BRIEF.md)."""
    rows = [(f"`optim` / `optimizer`: {name}", f"optimizer={target!r}") for name, target in HF_OPTIMIZERS.items()
            if not schema_accepts("optimizer", target)]
    rows += [(shown, f"{field}={value!r}") for shown, field, value in (
        ("`activation_checkpoint.mode` selective, `selective_ac_option` op", "checkpointing", "selective-op"),
        ("`activation_checkpoint.mode` selective, `selective_ac_option` N", "checkpointing_every", 2))
        if not schema_accepts(field, value)]
    rows += [(f"`model.converters` {c}" + (f" (recipe {r})" if r else ""), f"low_precision={v!r}")
             for (c, r), v in torchtitan_job.CONVERTERS.items() if not schema_accepts("low_precision", v)]
    return rows


def markdown() -> str:
    pending = pending_values()
    parts = [HEADER]
    if pending:  # values of modelled keys this build's schema does not take yet (refused by name)
        parts += ["\n## Values that wait for a schema field\n\nModelled keys whose value maps to a request "
                  "value this build's schema does not take: refused by name (asked at run time).\n\n"
                  "| value | request field |\n|---|---|"]
        parts += [f"| {value} | `{field}` |" for value, field in pending]
    for title, module, table in TABLES:
        parts.append(f"\n## {title}\n\n`{module}`\n\n| key | kind | reason |\n|---|---|---|")
        parts += [f"| `{key}` | {kind} | {reason.replace('|', '/')} |" for key, kind, reason in table_rows(table)]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")

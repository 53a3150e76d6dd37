"""launch.sh and job.sbatch: the shell around the framework's launcher (planner/frameworks/
launcher.py), which says how its ranks start; here, what every launch shares: finding the
planner's trainer, the allocator's environment, CPU ranks, Slurm's node rank."""

from __future__ import annotations

import shlex

from planner.plan.emit.spec import DEFAULT_PORT, TRAINER_MODULE, Launch


def _q(words: list[str] | tuple[str, ...]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def _preamble(launch: Launch) -> str:
    """Find the planner's trainer (installed, or a checkout named by PLANNER_ROOT) and set the
    environment the ranks expect."""
    named, exports = launch.launcher.environment(launch)
    lines = ["# The emitted files, for the training script too: $PLANNER_PLAN (what to run)" + named,
             'export PLANNER_PLAN="$here/plan.json"', *exports]
    if launch.script is None:
        lines += [
            "# The planner's trainer: pip install -e '.[backend]' in its checkout, or PLANNER_ROOT=/path/to/it",
            'if [ -n "${PLANNER_ROOT:-}" ]; then export PYTHONPATH="$PLANNER_ROOT${PYTHONPATH:+:$PYTHONPATH}"; fi',
            f"python -c 'import {TRAINER_MODULE}' 2>/dev/null || {{ echo \"$0: cannot import {TRAINER_MODULE}: in the "
            "planner checkout run pip install -e '.[backend]', or set PLANNER_ROOT to it\" >&2; exit 2; }",
            "# Where every rank writes its record (rank<N>.json: measured peak, step time)",
            'out="${PLANNER_OUT:-$here/planner-run}"',
        ]
    if not launch.is_cpu:
        lines += _allocator_env(launch.request)
    if launch.is_cpu:
        lines += [
            "# CPU ranks over gloo: DeepSpeed's CPU accelerator, no GPU, one thread per rank unless told",
            "export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=",
            'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"',
        ]
    return "\n".join(lines) + "\n"


def _allocator_env(req) -> list[str]:
    """The caching allocator's and NCCL's settings the estimate assumed (planner/memory/reserved.py): the
    run must use them for its reserved memory to be the one predicted. torch 2.13 reads
    PYTORCH_ALLOC_CONF before PYTORCH_CUDA_ALLOC_CONF (c10/core/AllocatorConfig.h), so that one is unset."""
    conf = req.alloc_conf or ""
    lines = ["# The caching allocator's settings the memory estimate assumed (" + (conf or "torch's defaults") + ")",
             "unset PYTORCH_ALLOC_CONF",
             f"export PYTORCH_CUDA_ALLOC_CONF={shlex.quote(conf)}" if conf else "unset PYTORCH_CUDA_ALLOC_CONF"]
    if req.nccl_buffsize_bytes is not None:
        lines.append(f"export NCCL_BUFFSIZE={req.nccl_buffsize_bytes}  # NCCL's Simple-protocol buffer the estimate assumed")
    return lines


def _target(launch: Launch, module_flag: str, here: str = "$here") -> str:
    """What every rank runs: the planner's trainer on this plan, or the user's script."""
    if launch.script is None:
        words = f'{module_flag} {TRAINER_MODULE} --plan "{here}/plan.json" --out "$out"'
        return words + launch.launcher.target_arguments(here)
    return _q((launch.script.path,) + launch.script.args)


def launch_sh(launch: Launch) -> str:
    head = ["#!/usr/bin/env bash",
            f"# planner: {launch.summary}",
            "# Usage: ./launch.sh [more arguments for the training script]",
            f"# Runs {what_runs(launch)}."]
    extra, body, run = launch.launcher.node_command(launch, _target(launch, launch.launcher.module_flag))
    head += extra
    return ("\n".join(head) + "\nset -euo pipefail\n"
            + 'here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"  # the directory of the emitted files\n'
            + _preamble(launch) + f'port="${{MASTER_PORT:-{DEFAULT_PORT}}}"\n' + launch.launcher.exit_cleanup(launch)
            + "".join(line + "\n" for line in body) + run + "\n")


def sbatch(launch: Launch) -> str:
    """One srun task per node; each task reads its own SLURM_NODEID (its node rank) and starts the
    node's ranks with the same launcher as launch.sh."""
    req = launch.request
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name=planner-{launch.strategy}",
        f"#SBATCH --nodes={req.nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={req.gpus}" if not launch.is_cpu else f"#SBATCH --cpus-per-task={req.gpus}",
        "#SBATCH --exclusive",
        f"# planner: {launch.summary}",
        "# Submit from this directory: sbatch job.sbatch [more arguments for the training script]",
        f"# Runs {what_runs(launch)}.",
        f"# --nodes: the plan's {req.nodes} node(s); --ntasks-per-node=1: one launcher per node, which starts",
        f"# that node's {req.gpus} ranks." + (" Every node reads this directory at the same path (a shared filesystem)."
                                             if req.nodes > 1 else ""),
        "set -euo pipefail",
        "# sbatch runs a copy of this file: the emitted files are in the directory it was submitted from",
        'here="${SLURM_SUBMIT_DIR:-$PWD}"',
        'if [ ! -f "$here/plan.json" ]; then echo "$0: submit from the directory with plan.json" >&2; exit 2; fi',
        _preamble(launch).rstrip("\n"),
        "# the master address: the first host of the allocation, which is node rank 0",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
        f'export MASTER_PORT="${{MASTER_PORT:-{DEFAULT_PORT}}}"',
    ]
    if launch.script is None:
        lines.append("export out")
    node_rank = ("# In each task: SLURM_NNODES, the node count; SLURM_NODEID, this node's index 0..N-1 (with one task\n"
                 "# per node it equals SLURM_PROCID): the node rank. Single-quoted, so each task reads its own.")
    before, launcher = launch.launcher.sbatch_launcher(launch, node_rank)
    lines += before
    # The task's shell gets the emitted directory as $0 and the script's words as "$@": no quoting
    # of the user's meets the single quotes.
    module_flag = launch.launcher.module_flag
    command = f'{launcher} {_target(launch, module_flag, "$0")} "$@"' if launch.script is None else f'{launcher} "$@"'
    positional = '"$here" "$@"' if launch.script is None else f'"$here" {_target(launch, "")} "$@"'
    cleanup = launch.launcher.sbatch_cleanup(launch)
    if cleanup is not None:
        lines.append(cleanup[0])
        command += cleanup[1]
    else:
        command = "exec " + command
    lines.append(f"srun --kill-on-bad-exit=1 bash -c '{command}' {positional}")
    return "\n".join(lines) + "\n"


def what_runs(launch: Launch) -> str:
    if launch.script is not None:
        return f"{launch.script.path} on every rank"
    return ("the planner's trainer (backend/worker.py, what `planner verify` runs): the model with random "
            "weights on synthetic tokens, each rank's measured memory and step time in planner-run/")

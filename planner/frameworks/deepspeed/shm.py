"""The /dev/shm segments DeepSpeed's CPU shm all-reduce leaves behind, named once for the two
places that remove a run's own: a verify run's supervisor (backend/supervisor.py shm_segments) and
the emitted launch.sh / job.sbatch (planner/frameworks/deepspeed/launch.py).

DeepSpeed 0.19.8 deepspeed/ops/csrc/cpu/comm/shm.cpp:350-367 (shm_initialize) names them
deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> and never unlinks them, about 69 MB per
rank. The uid and the run's master port make them this user's and this run's.
"""

SEGMENT_PATTERN = "deepspeed_*_{uid}_*_{port}_*"  # a glob, for Path.glob and for the shell alike


def segment_glob(uid: int | str, port: int | str) -> str:
    """The glob of one run's segments; in a shell script pass quoted words ('"$port"')."""
    return SEGMENT_PATTERN.format(uid=uid, port=port)

"""Activation offloading on a rank (imported only inside a launched rank): TRL's own
OffloadActivations around the forward and its loss, as SFTTrainer's ``activation_offloading=True``
runs it (trl 1.16.0 trl/models/activation_offloading.py get_act_offloading_ctx_manager), and the
bytes it copied to the host counted per micro-batch (what the planner predicts crosses the host link:
planner/recipes/activation_offload.py)."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import torch


class Offload:
    """The context the forward runs in, and the bytes the last micro-batch's forward offloaded."""

    def __init__(self, context=None):
        self.active = context is not None
        self.context = context if context is not None else nullcontext()
        self.micro_batch_bytes: list[int] = []
        self._current = 0
        if context is not None:
            pack = context.pack_hook  # saved_tensors_hooks.__enter__ registers this attribute

            def counting_pack(tensor: torch.Tensor):
                tensor_id = pack(tensor)
                if context.tracker[tensor_id][1]:  # (tensor, modified, ...): True once copied to the host
                    self._current += tensor.numel() * tensor.element_size()
                return tensor_id

            context.pack_hook = counting_pack

    def __enter__(self):
        self._current = 0
        return self.context.__enter__()

    def __exit__(self, *exc):
        if self.active:
            self.micro_batch_bytes.append(self._current)
        return self.context.__exit__(*exc)


def activation_offload(job: dict, module: torch.nn.Module) -> Offload:
    """TRL's context for ``module`` when the job offloads activations, else a no-op one.

    On CPU ranks three settings of TRL's differ, none of them in what is copied: a CPU-only torch
    has no accelerator (``torch.accelerator.current_accelerator()`` is None, whose ``.type`` TRL
    reads in __init__), so the host device stands in for it, and TRL then copies CPU tensors as it
    would a GPU's; ``torch.cpu.Stream`` has no ``synchronize`` (TRL's __exit__ calls it on its
    streams), and CPU ops are synchronous, so it is a no-op; and no pinned memory exists without
    a GPU (``use_pin_memory=False``)."""
    if not job.get("activation_offload"):
        return Offload()
    # TRL is imported only by a rank that offloads (the backend extra pins it; a run without it never needs it)
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    if job["device"] != "cpu":
        return Offload(get_act_offloading_ctx_manager(module))
    if not hasattr(torch.cpu.Stream, "synchronize"):
        torch.cpu.Stream.synchronize = lambda self: None  # CPU work is done when issued
    with mock.patch.object(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu")):
        return Offload(get_act_offloading_ctx_manager(module, use_pin_memory=False))

"""The moments of a training step at which the live set is modelled, as typed kinds. Code identifies
a phase by its kind; the phase's name is for display only (it may carry a block number)."""

from __future__ import annotations

from enum import Enum


class PhaseKind(str, Enum):
    RESIDENT = "resident"  # between steps: what survives the optimizer step
    BACKWARD = "backward"  # the one backward point of a model known only by its parameter count
    START_OF_BACKWARD = "start_of_backward"  # at the loss, every activation saved
    AFTER_LM_HEAD = "after_lm_head"
    START_OF_BLOCK = "start_of_block"  # a block's backward begins (recomputed under checkpointing)
    END_OF_BLOCK = "end_of_block"  # a block's backward ends: its gradients exist
    END_OF_BACKWARD = "end_of_backward"  # the embeddings' backward, last
    TIED_SUM = "tied_sum"  # a tied embedding's two gradient contributions being summed
    FIRST_BUCKET_REDUCTION = "first_bucket_reduction"  # ZeRO-2's first reduce bucket overflow
    GRADIENT_ALLREDUCE = "gradient_allreduce"
    TRAIN_METRICS = "train_metrics"  # the loop's metrics on the kept logits, after a micro-batch's backward
    OPTIMIZER_STEP = "optimizer_step"

    @property
    def ends_a_unit(self) -> bool:
        """A unit's backward (a block, or the root at the end) has just finished."""
        return self in (PhaseKind.END_OF_BLOCK, PhaseKind.END_OF_BACKWARD)

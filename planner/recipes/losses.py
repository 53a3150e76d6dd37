"""The loss implementation a script computes the causal-LM loss with (``loss``).

- ``hf``: transformers' ForCausalLMLoss over the whole logits (activations._loss_saved and
  _loss_transient): the fp32 log-probabilities saved, the backward's two fp32 tokens x vocab
  gradients. Under torch tensor parallelism the probe and the model compute it vocab-parallel
  (loss_parallel), which ``vocab-parallel`` names.
- ``chunked``: torchtune's chunked output loss (CEWithChunkedOutputLoss, num_output_chunks=8:
  the LM head applied to ``loss_chunks`` slices of the sequence and each slice upcast and
  cross-entropied apart). The log-probabilities of every chunk are still saved (4 bytes x tokens x
  vocab in all), but the loss's backward runs one chunk at a time: its two fp32 gradients are
  1/chunks of HF's. torchtitan's ChunkedLossWrapper (num_chunks=8, components/loss.py) runs each
  chunk's backward inside the forward instead, a different schedule that is not this one.
- ``liger-fused``, ``cce``: fused linear cross-entropy kernels (Liger-Kernel, Cut Cross-Entropy),
  Triton on GPUs only: not modelled yet, refused with that reason.
- ``vocab-parallel``: torch tensor parallelism's loss_parallel (tp > 1 on a torch strategy).
"""

from __future__ import annotations

from typing import Any, Literal

from planner.errors import PlannerError

Loss = Literal["hf", "chunked", "liger-fused", "cce", "vocab-parallel"]
# torchtune modules/loss/ce_chunked_output_loss.py CEWithChunkedOutputLoss(num_output_chunks=8);
# torchtitan b5bcd76 components/loss.py ChunkedLossWrapper.Config.num_chunks = 8
DEFAULT_CHUNKS = 8


def loss_chunks(request: Any, why_not: str | None, torch_tp: bool) -> int:
    """How many chunks the loss's backward runs in (1: the whole logits at once), after refusing
    what is not modelled, naming the field."""
    loss = request.loss
    if request.loss_chunks is not None and loss != "chunked":
        raise PlannerError(f"loss_chunks={request.loss_chunks} applies to loss=chunked, not loss={loss}",
                           field="loss_chunks")
    if loss in ("liger-fused", "cce"):
        raise PlannerError(f"loss={loss}: a fused linear cross-entropy (Triton, GPU only) is not modelled yet; "
                           "choose hf, chunked or vocab-parallel", field="loss")
    if loss == "vocab-parallel" and not torch_tp:
        raise PlannerError("loss=vocab-parallel is tensor parallelism's loss_parallel: it needs tp > 1 on a torch "
                           "strategy (fsdp, hsdp)", field="loss")
    if loss == "chunked":
        if why_not:
            raise PlannerError(f"loss=chunked with {why_not}: modelled for a data-parallel layout of a full "
                               "fine-tune", field="loss")
        return request.loss_chunks or DEFAULT_CHUNKS
    return 1

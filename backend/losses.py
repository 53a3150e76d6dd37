"""The loss implementations a rank computes beyond transformers' own (imported only inside a rank)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

IGNORE = -100  # transformers' and torchtune's ignore_index


class ChunkedOutputLoss(torch.nn.Module):
    """torchtune's chunked output loss on a transformers causal LM (torchtune
    modules/loss/ce_chunked_output_loss.py CEWithChunkedOutputLoss with the model's chunked
    output, as its recipes pair them): the decoder's hidden states cut into ``chunks`` slices of the
    sequence, the LM head applied to each, each slice upcast to fp32 and cross-entropied with
    reduction sum, the total divided by the tokens counted. Labels shifted as transformers'
    ForCausalLMLoss shifts them (the last position ignored)."""

    def __init__(self, model: torch.nn.Module, chunks: int):
        super().__init__()
        self.model, self.chunks = model, chunks
        self._no_split_modules = getattr(model, "_no_split_modules", None)  # FSDP's unit (backend/train.py)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor):
        hidden = self.model.base_model(input_ids=input_ids).last_hidden_state
        head = self.model.get_output_embeddings()
        logits = [head(chunk) for chunk in hidden.chunk(self.chunks, dim=1)]
        shifted = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        total = hidden.new_zeros((), dtype=torch.float32)
        for chunk, target in zip(logits, shifted.chunk(self.chunks, dim=1)):
            total = total + F.cross_entropy(chunk.float().reshape(-1, chunk.size(-1)), target.reshape(-1),
                                            ignore_index=IGNORE, reduction="sum")
        return SimpleNamespace(loss=total / (shifted != IGNORE).sum(), logits=logits)


class FusedLinearLoss(torch.nn.Module):
    """A fused linear cross-entropy on a transformers causal LM, as Liger's and Cut
    Cross-Entropy's transformers patches call it (liger_kernel/transformers/model/llama.py
    lce_forward: ``LigerForCausalLMLoss(hidden_states, lm_head.weight, labels)``; cut_cross_entropy
    ``linear_cross_entropy(e, c, targets)``): the decoder's hidden states and the LM head's weight
    into the kernel, no logits returned. Labels shifted as transformers' ForCausalLMLoss. Both
    libraries are optional: imported here, inside a rank, never by the planner. Liger is Triton (CUDA
    only: bench/gpu_check.py); Cut Cross-Entropy runs its Triton kernels (``impl="cce"``, the default
    on Linux) on a GPU and its other implementation, ``impl="torch_compile"`` (cut-cross-entropy
    25.1.1 torch_compile.py: the logits, then F.cross_entropy, compiled by torch.compile), on a CPU
    rank, where no Triton kernel runs."""

    def __init__(self, model: torch.nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind
        self._no_split_modules = getattr(model, "_no_split_modules", None)
        if kind == "liger-fused":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss  # optional, GPU only

            self.loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE)
        else:
            from cut_cross_entropy import linear_cross_entropy  # optional (pyproject extras backend)

            self.loss = linear_cross_entropy

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor):
        # a PEFT model's base_model is its LoraModel; get_base_model() the causal LM under it
        causal = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        hidden = causal.base_model(input_ids=input_ids).last_hidden_state
        weight = causal.get_output_embeddings().weight
        shifted = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        if self.kind == "liger-fused":
            loss = self.loss(weight, hidden.reshape(-1, hidden.size(-1)), shifted.reshape(-1))
        else:
            impl = "cce" if hidden.is_cuda else "torch_compile"
            loss = self.loss(hidden, weight, shifted, ignore_index=IGNORE, impl=impl)
        return SimpleNamespace(loss=loss, logits=None)


class FlashAttnLoss(torch.nn.Module):
    """flash-attn's cross-entropy on a transformers causal LM, as llm-foundry's ``fused_crossentropy``
    calls it (llm-foundry 5f43bf1 llmfoundry/models/mpt/modeling_mpt.py: ``CrossEntropyLoss`` from
    ``flash_attn.losses.cross_entropy`` on the model's logits as they come out of the head, no
    upcast): the model's logits (returned, so a loop that keeps its outputs keeps them), the labels
    shifted as transformers' ForCausalLMLoss shifts them. flash-attn is Triton (2.x) or a CUDA
    extension (1.0.x): GPU only (bench/gpu_check.py), imported here, inside a rank."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        from flash_attn.losses.cross_entropy import CrossEntropyLoss  # optional, GPU only

        self.model, self.loss = model, CrossEntropyLoss(ignore_index=IGNORE)
        self._no_split_modules = getattr(model, "_no_split_modules", None)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor):
        logits = self.model(input_ids=input_ids).logits
        shifted = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        loss = self.loss(logits.reshape(-1, logits.size(-1)), shifted.reshape(-1))
        return SimpleNamespace(loss=loss, logits=logits)


class _HandBack(torch.autograd.Function):
    """The bridge from the loss's call to the decoder's backward: takes the hidden states (attached
    to the decoder's graph), the gradient already computed for them and the loss's value; returns
    the value, whose backward hands that gradient to the hidden states, scaled in place by the
    incoming gradient (the engine's 1 / accumulation)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, gradient: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gradient)
        return value.detach()

    @staticmethod
    def backward(ctx, incoming: torch.Tensor):
        (gradient,) = ctx.saved_tensors
        return gradient.mul_(incoming), None, None


def _output(loss: torch.Tensor):
    """A transformers output: a pytree node (ModelOutput registers its subclasses), so that FSDP2's
    root sees the loss and registers its pre-backward hook on it, which gathers the root unit again
    for the decoder's backward."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(loss=loss)


class InForwardChunkedLoss(torch.nn.Module):
    """torchtitan's chunked loss schedule (torchtitan 0.3.0 components/loss.py ChunkedLossWrapper; the
    planner's loss=chunked-in-forward) on a transformers causal LM, written from its description: the
    decoder's final hidden states cut into ``chunks`` equal slices of the sequence, each made a
    contiguous detached leaf; for each slice in turn the LM head, the summed cross-entropy of its
    fp32 upcast over the micro-batch's labelled tokens, and its backward at once, inside this
    forward, its input gradient copied into one fp32 buffer of the hidden states' shape; the buffer
    cast to the hidden states' dtype and handed to the decoder's backward (_HandBack). The backward
    of each slice runs without autocast, as a GPU's autograd thread runs it. Labels shifted as
    transformers' ForCausalLMLoss. ``loss_of(logits, labels, count)`` computes one slice's loss from
    its logits (the vocabulary-parallel one under TP: train_parallel.py). Under FSDP2 the head stays in
    the root unit (backend/train.py _fully_shard), gathered by the root's forward through the slices and
    its gradient reduced with the root's at the end of backward; torchtitan's own [norm, lm_head] unit,
    kept gathered with its reduction off until the last slice, ended both CPU ranks with SIGSEGV when
    tried here (torch 2.13), so its fp32 accumulation (planner/recipes/losses.py in_forward_memory
    reduce_bytes) is not what the probe measures."""

    def __init__(self, model: torch.nn.Module, chunks: int, loss_of=None):
        super().__init__()
        self.model, self.chunks = model, chunks
        self.loss_of = loss_of or _slice_cross_entropy
        self._no_split_modules = getattr(model, "_no_split_modules", None)

    def forward(self, *, input_ids: torch.Tensor, labels: torch.Tensor, **decoder_kwargs):
        hidden = self.model.base_model(input_ids=input_ids, **decoder_kwargs).last_hidden_state
        hidden = _replicated(hidden)
        head = self.model.get_output_embeddings()
        shifted = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
        count = (shifted != IGNORE).sum()
        if hidden.shape[1] % self.chunks:
            raise RuntimeError(f"sequence {hidden.shape[1]} does not divide into {self.chunks} chunks")
        width = hidden.shape[1] // self.chunks
        pieces = [p.contiguous().detach().requires_grad_(True) for p in torch.split(hidden, width, dim=1)]
        targets = torch.split(shifted, width, dim=1)
        buffer = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        total = hidden.new_zeros((), dtype=torch.float32)
        for index, (piece, target) in enumerate(zip(pieces, targets)):
            logits = head(piece)
            part = self.loss_of(logits, target, count)
            total = total + part.detach()
            with torch.autocast(hidden.device.type, enabled=False):
                part.backward()
            buffer[:, index * width:(index + 1) * width] = piece.grad.to(torch.float32)  # as GradAccumulator.add
            piece.grad = None
        gradient = buffer.to(hidden.dtype)
        return _output(_HandBack.apply(hidden, gradient, total))


def _replicated(hidden: torch.Tensor) -> torch.Tensor:
    """The hidden states whole on this rank: a sequence-parallel norm's DTensor gathered over the
    sequence (torchtitan's root norm redistributes to Replicate before the head), as a local tensor."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(hidden, DTensor):
        return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    return hidden


def _slice_cross_entropy(logits: torch.Tensor, target: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), target.reshape(-1), ignore_index=IGNORE,
                           reduction="sum") / count

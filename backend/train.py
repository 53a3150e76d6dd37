"""Train one rank and measure what it allocates (imported only inside a launched rank).

CPU: the torch profiler's memory timeline records every allocation and free with a category
(PARAMETER, GRADIENT, OPTIMIZER_STATE, ACTIVATION, TEMPORARY, ...), so the live total at every
instant, and hence the peak, is exact. The profiler runs from before the model is built, so every
tensor is seen being created rather than guessed as pre-existing.

CUDA: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` / ``memory_stats``. A CUDA
counter is never read on a CPU host (it would silently return 0).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from contextlib import nullcontext
from typing import Any

import torch

from backend.job import uses_deepspeed
from backend.offload import activation_offload

STEP_MARK = "planner::step::"
TEXT_DECODER_OF = {"gemma3", "llama4", "mistral3"}  # multimodal model_types read through text_config


def build_model(job: dict[str, Any]) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    fields = dict(job["model_config"])
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    builder = AutoModelForCausalLM
    if job.get("vision"):
        # the whole multimodal class, as the planner counted it (AutoModelForCausalLM builds it for
        # gemma3; mistral3 and a llama4 with include_vision load through AutoModelForImageTextToText),
        # fed text batches: the vision tower holds its states and runs on no image
        builder = AutoModelForImageTextToText
    elif model_type in TEXT_DECODER_OF:
        # text_only (or llama4, whose AutoModelForCausalLM is Llama4ForCausalLM): the text decoder
        config = config.text_config
    config.use_cache = False
    torch.manual_seed(int(job.get("seed", 0)))
    dtype = torch.float32
    if job.get("finetune"):  # LoRA/QLoRA: the frozen base in its own dtype (backend/finetune.py)
        from backend.finetune import base_dtype

        dtype = base_dtype(job)
    attention = attention_implementation(job)
    model = builder.from_config(config, attn_implementation=attention, dtype=dtype)
    if job.get("fused_kernels"):  # Liger's block kernels (GPU only: planner refuses them on CPU ranks)
        from backend.fused_kernels import apply_fused_kernels

        apply_fused_kernels(model, tuple(job["fused_kernels"]))
    apply_checkpointing(model, job)
    model.train()
    if job.get("finetune"):
        from backend.finetune import apply_finetune

        model = apply_finetune(model, job)
    if job.get("low_precision", "none") != "none":
        from backend.low_precision import convert

        model = convert(model, job["low_precision"], fp8_all_gather=job.get("float8_all_gather", False))
    if job.get("loss") == "chunked-in-forward" and not job.get("parallel"):  # under TP: train_parallel.py
        from backend.losses import InForwardChunkedLoss

        model = InForwardChunkedLoss(model, int(job["loss_chunks"]))
    elif job.get("loss") == "chunked":
        from backend.losses import ChunkedOutputLoss

        model = ChunkedOutputLoss(model, int(job["loss_chunks"]))
    elif job.get("loss") in ("liger-fused", "cce"):
        from backend.losses import FusedLinearLoss

        model = FusedLinearLoss(model, job["loss"])
    elif job.get("loss") == "flash-attn":
        from backend.losses import FlashAttnLoss

        model = FlashAttnLoss(model)
    return model


def attention_implementation(job: dict[str, Any]) -> str:
    """What the model's attention layers run: the job's kernel, wrapped for Megatron-style core-
    attention recompute under checkpointing selective-attention."""
    attention = _attention_for(job)
    if job["checkpointing"] == "selective-attention":
        from backend.checkpointing import core_attention_recompute

        attention = core_attention_recompute(attention)
    return attention


def apply_checkpointing(model: torch.nn.Module, job: dict[str, Any]) -> None:
    """The job's activation checkpointing on a built transformers model (every block, every N-th, or
    torchtitan's per-op selective policy)."""
    if job["checkpointing"] == "full" and not job.get("checkpointing_every"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif job["checkpointing"] in ("full", "selective-op"):
        from backend.checkpointing import selective_op_context

        options = {"use_reentrant": False} | (
            {"context_fn": selective_op_context} if job["checkpointing"] == "selective-op" else {})
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options,
                                              every_n_layers=job.get("checkpointing_every") or 1)


def _attention_for(job: dict[str, Any]) -> str:
    """The requested attention, or eager for a family transformers has no SDPA path for (gemma2,
    gpt_oss: ``_supports_sdpa = False``), as the planner predicts (Architecture.attention_implementation)."""
    from planner.model.architecture import from_hf_config

    if from_hf_config(dict(job["model_config"])).attention_implementation == "eager":
        return "eager"
    return job["attn_implementation"]


def synthetic_batch(job: dict[str, Any], step: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(int(job.get("seed", 0)) * 100003 + step)
    from planner.model.architecture import from_hf_config

    vocab = from_hf_config(dict(job["model_config"])).vocab_size  # also inside a text_config
    shape = (int(job["micro_batch"]), int(job["seq_len"]))
    return torch.randint(0, vocab, shape, generator=generator).to(device)


def init_distributed(job: dict[str, Any]) -> None:
    if not uses_deepspeed(job):
        torch.distributed.init_process_group(backend=job.get("dist_backend") or "nccl")
        return
    import deepspeed

    deepspeed.init_distributed(dist_backend=job.get("dist_backend") or None)


class AccumulatingEngine:
    """The DeepSpeed engine's three calls (``__call__`` the forward, ``backward(loss)``, ``step()``)
    over a torch module and its optimizer, so that one training loop (_train_steps) measures every
    framework; each torch path (TorchEngine; backend/train_parallel.py ParallelEngine,
    backend/context_parallel.py ContextParallelEngine, backend/train_experts.py ExpertEngine)
    changes only what differs. The forward runs under torch.autocast when ``autocast_dtype`` is set.
    Gradient accumulation: each micro-batch's loss divided by ``loss_divisor`` (the accumulation)
    before its backward, gradient sync left on, so that an FSDP2 module reduce-scatters every
    micro-batch's gradients into its sharded accumulators, as torchtitan's trainer runs it
    (torchtitan 0.3 trainer.py:885, one forward-backward per micro-batch with gradient sync on) and
    as the time model counts it (planner/frameworks/torch/v2.py: accumulation x reduce-scatter).
    One optimizer step (then zero_grad(set_to_none=True)) per accumulation boundary."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, *, accumulation: int,
                 autocast_dtype: torch.dtype | None = None, device: torch.device | None = None):
        self.module, self.optimizer = module, optimizer
        self.autocast_dtype, self.accumulation, self.device = autocast_dtype, accumulation, device
        self.loss_divisor = accumulation
        self.micro = 0

    def autocast(self):
        """torch.autocast in ``autocast_dtype`` on the engine's device; a no-op context without one."""
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def __call__(self, **inputs):
        with self.autocast():
            return self.forward(**inputs)

    def forward(self, **inputs):
        """The module's call (under the autocast); the training loop reads the output's ``loss``."""
        return self.module(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.loss_divisor).backward()

    def step(self) -> None:
        self.micro += 1
        if self.micro % self.accumulation == 0:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


class TorchEngine(AccumulatingEngine):
    """DDP or FSDP2 (torch_engine). Gradient accumulation under DDP as the torch docs prescribe:
    no_sync() on every micro-batch but the last, entered before the forward's autocast and left
    after the backward; FSDP2 (a module without no_sync) syncs every micro-batch (AccumulatingEngine),
    or with ``defer_sync`` (the request's defer_gradient_sync) only the last, as accelerate's no_sync
    runs it under the HF Trainer: set_requires_gradient_sync(False) on every micro-batch but the last
    (accelerate 1.16 accelerator.py no_sync, is_fsdp2)."""

    _no_sync = None  # the DDP no_sync() context open from a forward to its backward

    def __init__(self, *args, defer_sync: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.defer_sync = defer_sync

    def __call__(self, **inputs):
        last = self.micro % self.accumulation == self.accumulation - 1
        if not last and hasattr(self.module, "no_sync"):
            self._no_sync = self.module.no_sync()
            self._no_sync.__enter__()
        elif self.defer_sync and hasattr(self.module, "set_requires_gradient_sync"):
            self.module.set_requires_gradient_sync(last)
        return super().__call__(**inputs)

    def backward(self, loss: torch.Tensor) -> None:
        super().backward(loss)
        if self._no_sync is not None:
            self._no_sync.__exit__(None, None, None)
            self._no_sync = None


def _decoder_layer_class(model: torch.nn.Module) -> type:
    """The transformer block class, FSDP's wrapping unit (transformers names it in
    ``_no_split_modules``: LlamaDecoderLayer, GPT2Block, ...). A multimodal class lists its vision
    tower's modules there too, first (Gemma3ForConditionalGeneration: SiglipVisionEmbeddings, ...):
    the text decoder's own blocks (``get_decoder().layers``) are the units the planner models."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    if isinstance(layers, torch.nn.ModuleList) and len(layers):
        return type(layers[0])
    names = set(getattr(model, "_no_split_modules", None) or [])
    for module in model.modules():
        if type(module).__name__ in names:
            return type(module)
    raise RuntimeError(f"no transformer block class found in {type(model).__name__} ({sorted(names)})")


def torch_engine(job: dict[str, Any], model: torch.nn.Module, device: torch.device) -> TorchEngine:
    """torch DDP or FSDP (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD) as planner.memory.buffers models them."""

    settings = job["torch"]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[settings["compute_dtype"]]
    if settings["pure_16bit"]:
        model = model.to(dtype)
    model = model.to(device)
    if not settings.get("wrapped", True):  # strategy single: the module itself, autocast as DDP's
        wrapped = model
        autocast = None if settings["pure_16bit"] else dtype
    elif settings["sharding"] is None:  # DDP (planner/frameworks/torch/v2.py sharding)
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        wrapped.register_comm_hook(None, COUNTER.ddp_hook())
        autocast = None if settings["pure_16bit"] else dtype
    else:
        COUNTER.wrap_torch_distributed()
        wrapped = _fully_shard(model, settings, dtype, device)
        autocast = None
    optimizer = torch_optimizer(job, wrapped)
    return TorchEngine(wrapped, optimizer, autocast_dtype=autocast,
                       accumulation=int(job.get("gradient_accumulation", 1)), device=device,
                       defer_sync=bool(settings.get("defer_gradient_sync", False)))


def _fully_shard(model: torch.nn.Module, settings: dict[str, Any], dtype, device: torch.device) -> torch.nn.Module:
    """FSDP2 (torch.distributed.fsdp.fully_shard, the per-parameter-sharding FSDP that also runs
    on CPU ranks over gloo; FSDP1 refuses a CPU-only host): every transformer block is a unit,
    then the root (embeddings, final norm, LM head). SHARD_GRAD_OP keeps each unit gathered from
    forward to backward (reshard_after_forward=False); HYBRID_SHARD shards over a node and
    replicates across nodes on a 2-D mesh (replicate, shard)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    world = torch.distributed.get_world_size()
    if settings["sharding"] == "HYBRID_SHARD":
        mesh = init_device_mesh(device.type, (settings["replicas"], settings["shard_size"]),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    mixed = mixed_precision_policy(None if settings["pure_16bit"] else dtype, settings)
    options = dict(mesh=mesh, reshard_after_forward=settings["sharding"] != "SHARD_GRAD_OP", mp_policy=mixed,
                   offload_policy=CPUOffloadPolicy() if settings["offload"] else OffloadPolicy())
    block = _decoder_layer_class(model)
    for module in list(model.modules()):
        if isinstance(module, block):
            fully_shard(module, **options)
    fully_shard(model, **options)
    return model


def mixed_precision_policy(dtype: torch.dtype | None, settings: dict[str, Any]):
    """FSDP2's MixedPrecisionPolicy: parameters gathered in ``dtype`` (None: as stored), gradients
    reduced in it, or in fp32 when the request's reduce_dtype says so (torchtitan's
    mixed_precision_reduce; torch 2.13 _fully_shard/_fsdp_api.py MixedPrecisionPolicy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    reduce = torch.float32 if settings.get("reduce_dtype") == "fp32" else dtype
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce)


LR = 1e-4


def _build(name: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """One optimizer of the registry (planner/recipes/optimizers.py) over ``params``, from the
    library each entry was read from; hyper-parameters change values, not memory."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)
    if name == "adamw-single-tensor":
        return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=LR, momentum=0.9)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    if name in ("adamw-8bit", "adamw-paged-8bit", "lion"):
        import bitsandbytes as bnb  # only the ranks that train with it pay its import

        cls = {"adamw-8bit": bnb.optim.AdamW8bit, "adamw-paged-8bit": bnb.optim.PagedAdamW8bit,
               "lion": bnb.optim.Lion}[name]
        return cls(params, lr=LR)
    if name in ("adamw-torchao-8bit", "adamw-torchao-4bit"):
        from torchao.optim import AdamW4bit, AdamW8bit  # torchao is an extra: imported where used

        return (AdamW8bit if name == "adamw-torchao-8bit" else AdamW4bit)(params, lr=LR)
    raise RuntimeError(f"optimizer {name!r} is not available to the torch strategies' probe")


class Optimizers:
    """Several optimizers stepped one after the other as one (Muon and its AdamW): what the engine
    and resident_by_category read of an optimizer (param_groups, state, step, zero_grad)."""

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = parts

    @property
    def param_groups(self) -> list[dict]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for part in self.parts for k, v in part.state.items()}

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


class InBackward(Optimizers):
    """torchtune's optimizer_in_bwd: one optimizer per parameter, stepped and its gradient freed in
    the parameter's post-accumulate-grad hook; the engine's step() has nothing left to do."""

    def __init__(self, parts: list[torch.optim.Optimizer], params: list[torch.nn.Parameter]):
        super().__init__(parts)
        for param, part in zip(params, parts):
            param.register_post_accumulate_grad_hook(self._stepper(part))

    @staticmethod
    def _stepper(part: torch.optim.Optimizer):
        def hook(_param: torch.Tensor) -> None:
            part.step()
            part.zero_grad(set_to_none=True)
        return hook

    def step(self) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


def _io_parameters(module: torch.nn.Module) -> set[int]:
    """The token embedding's and the LM head's parameters (Muon leaves them to AdamW)."""
    model = getattr(module, "module", module)
    out = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        layer = getattr(model, get)() if hasattr(model, get) else None
        if layer is not None and getattr(layer, "weight", None) is not None:
            out.add(id(layer.weight))
    return out


def torch_optimizer(job: dict[str, Any], module: torch.nn.Module):
    """The request's optimizer over the module's trainable parameters: Muon on the hidden 2-D
    weights with AdamW on the rest (torch's Muon refuses anything else), each parameter its own in
    backward when asked."""
    name = job["torch"]["optimizer"]
    params = [p for p in module.parameters() if p.requires_grad]
    if job["torch"].get("optimizer_in_backward"):
        io = _io_parameters(module) if name == "muon" else set()

        def own(p: torch.nn.Parameter) -> torch.optim.Optimizer:
            if name != "muon":
                return _build(name, [p])
            return torch.optim.Muon([p], lr=2e-2) if p.ndim == 2 and id(p) not in io else _build("adamw", [p])

        return InBackward([own(p) for p in params], params)
    if name == "muon":
        io = _io_parameters(module)
        matrices = [p for p in params if p.ndim == 2 and id(p) not in io]
        rest = [p for p in params if p.ndim != 2 or id(p) in io]
        return Optimizers([torch.optim.Muon(matrices, lr=2e-2)] + ([_build("adamw", rest)] if rest else []))
    return _build(name, params)


def deepspeed_engine(job: dict[str, Any], model: torch.nn.Module):
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad or not job.get("finetune")],
        config=job["ds_config"]
    )
    return engine


class CollectiveCounter:
    """Bytes per collective over one step, for the torch strategies (DeepSpeed's have its comms
    logger). FSDP2 calls torch.distributed's Python functions, so they are wrapped here; DDP's
    Reducer calls the process group from C++, so DDP gets a comm hook that counts each bucket and
    then does what the built-in one does (allreduce_hook: divide by the world, all-reduce)."""

    # all-gathers count their output (the whole unit), reduce-scatters their input (the whole
    # unit's gradients): the payload the time model sends. FSDP2 in torch 2.13 calls the *_single
    # forms (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).
    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "broadcast", "all_to_all_single")

    def __init__(self):
        self.on = False
        self.counts: dict[str, dict[int, int]] = {}
        self.seconds: dict[str, float] = {}
        self._originals: dict[str, Any] = {}

    def add(self, name: str, nbytes: int, seconds: float = 0.0) -> None:
        if self.on:
            sizes = self.counts.setdefault(name, {})
            sizes[nbytes] = sizes.get(nbytes, 0) + 1
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def wrap_torch_distributed(self) -> None:
        import torch.distributed as dist

        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                tensor = tensors[1] if "reduce_scatter" in _name and len(tensors) > 1 else \
                    (tensors[0] if tensors else None)
                if tensor is None or not self.on:
                    return _original(*args, **kwargs)
                # In the counted step each collective is waited for, as DeepSpeed's comms logger
                # does, so that its time is its own.
                start = time.perf_counter()
                work = _original(*args, **kwargs)
                if work is not None and hasattr(work, "wait"):
                    work.wait()
                self.add(_name, tensor.numel() * tensor.element_size(), time.perf_counter() - start)
                return work

            setattr(dist, name, counted)

    def ddp_hook(self):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def hook(state, bucket):
            buffer = bucket.buffer()
            if not self.on:
                return default_hooks.allreduce_hook(state, bucket)
            start = time.perf_counter()
            future = default_hooks.allreduce_hook(state, bucket)
            future.wait()
            self.add("all_reduce (DDP bucket)", buffer.numel() * buffer.element_size(), time.perf_counter() - start)
            return future

        return hook


COUNTER = CollectiveCounter()


def _count_collectives(job: dict[str, Any], engine, device: torch.device) -> dict[str, Any]:
    """One more step, after the measured ones and outside their memory windows, with every
    collective's message size and time counted: DeepSpeed's comms logger
    (deepspeed/utils/comms_logging.py) for ZeRO, CollectiveCounter for torch.
    Returns {op: {"calls": n, "bytes": total payload, "seconds": total time}}."""
    deepspeed_run = uses_deepspeed(job)
    if deepspeed_run:
        import deepspeed.comm as ds_comm

        logger = ds_comm.comms_logger
        logger.comms_dict = {}
        logger.enabled, logger.prof_all, logger.verbose = True, True, False
    else:
        COUNTER.counts, COUNTER.seconds, COUNTER.on = {}, {}, True
    try:
        _optimizer_step(job, engine, device, first_batch=10_000)
    finally:
        if deepspeed_run:
            logger.enabled = False
            # The logger sizes a call by its ``tensor`` argument (deepspeed/comm/utils.py
            # get_tensor_position), an all-gather's INPUT: this rank's partition. Counted here as
            # CollectiveCounter counts it and the time model sends it, the gathered output: the
            # input times the data-parallel group it gathers over (ZeRO's partitions).
            group = int(getattr(engine, "dp_world_size", 1) or 1)
            counts = {name: {int(size) * (group if name.startswith("all_gather") else 1): int(entry[0])
                             for size, entry in sizes.items()}
                      for name, sizes in logger.comms_dict.items()}
            # The logger's latencies are in ms and cumulative per op name: its timer is read with
            # elapsed(reset=False) after each call (deepspeed/comm/comm.py timed_op), so the
            # largest is the op's total in the counted step.
            seconds = {name: max(max(entry[1]) for entry in sizes.values()) / 1000.0
                       for name, sizes in logger.comms_dict.items()}
        else:
            COUNTER.on = False
            counts, seconds = COUNTER.counts, COUNTER.seconds
    return {name: {"calls": sum(sizes.values()), "bytes": sum(size * n for size, n in sizes.items()),
                   "seconds": float(seconds.get(name, 0.0))}
            for name, sizes in sorted(counts.items())}


def _injected_fault(step: int) -> None:
    """PLANNER_FAULT=kind:rank:step makes one rank fail on purpose, so that failure handling
    (a crash, an out-of-memory error, a hang) can be exercised end to end: kind is crash, oom or
    hang (teardown-hang:rank:0 is backend/worker.py's: a process-group teardown that never returns).
    Unset in normal use."""
    spec = os.environ.get("PLANNER_FAULT")
    if not spec:
        return
    kind, rank, at = spec.split(":")
    if int(rank) != int(os.environ.get("RANK", "0")) or int(at) != step:
        return
    if kind == "crash":
        raise RuntimeError(f"injected crash at step {step}")
    if kind == "oom":
        raise MemoryError(f"injected out of memory at step {step}")
    if kind == "hang":
        while True:
            time.sleep(1)


def _optimizer_step(job: dict[str, Any], engine, device: torch.device, first_batch: int,
                    held: list | None = None, offload=None) -> None:
    """One optimizer step: gradient_accumulation micro-batches, synthetic batches numbered from
    first_batch (the engine steps the optimizer at the accumulation boundary). The Trainer's loop
    takes ``.loss`` and lets the outputs go; with keeps_outputs, accelerate's examples' loop
    (``outputs = model(**batch); accelerator.backward(outputs.loss)``): ``held[0]``, the previous
    micro-batch's outputs (a slot the caller keeps across steps, as the loop's variable lives on),
    is let go only when the next forward has returned and the name is rebound. ``offload``: the
    activation offloading context the forward and its loss run in (backend/offload.py), as
    SFTTrainer's compute_loss wraps ``model(**inputs)``."""
    offload = offload if offload is not None else nullcontext()
    for micro in range(int(job.get("gradient_accumulation", 1))):
        tokens = synthetic_batch(job, first_batch + micro, device)
        if job.get("keeps_outputs") and held is not None:
            with offload:
                held[0] = engine(input_ids=tokens, labels=tokens)  # `outputs = model(**batch)`: the previous die here
            engine.backward(held[0].loss)
            _train_metrics(job, held[0], tokens)
            engine.step()
            del tokens
            continue
        with offload:
            loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        del loss, tokens


def _train_metrics(job: dict[str, Any], outputs, labels: torch.Tensor) -> None:
    """composer's train metrics after a micro-batch's backward (planner/recipes/loop.py): the labels shifted in
    place (composer's HuggingFaceModel.eval_forward: ``labels[:, :-1] = labels[:, 1:].clone()``, the last -100),
    then each metric's ``CrossEntropyLoss(reduction="sum")`` over the kept logits (composer metrics/nlp.py
    LanguageCrossEntropy.update), under no_grad and the loop's precision context (``metric_autocast``)."""
    metrics = int(job.get("train_metrics", 0))
    if not metrics:
        return
    labels[:, :-1] = labels[:, 1:].clone()
    labels[:, -1] = -100
    logits = outputs.logits
    dtype = job.get("metric_autocast")
    context = torch.autocast(logits.device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]) \
        if dtype else nullcontext()
    with torch.no_grad(), context:
        for _ in range(metrics):
            loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1),
                                                     ignore_index=-100, reduction="sum")
            del loss


def _train_steps(job: dict[str, Any], engine, device: torch.device, on_step, offload=None) -> list[float]:
    step_seconds: list[float] = []
    total = int(job["warmup_steps"]) + int(job["steps"])
    accumulation = int(job.get("gradient_accumulation", 1))
    held: list = [None]  # the outputs a keeps_outputs loop still references (_optimizer_step)
    for step in range(total):
        _injected_fault(step)
        start = time.perf_counter()
        with torch.profiler.record_function(f"{STEP_MARK}{step}"):
            _optimizer_step(job, engine, device, first_batch=step * accumulation, held=held, offload=offload)
            if device.type == "cuda":
                torch.cuda.synchronize()
            # the step's seconds end here: the barrier and the collection below are the harness's (a
            # gc.collect over a transformers model takes a few hundred ms, which the first CUDA runs
            # of bench/gpu_check.py measured as a constant ~0.3 s in every step)
            step_seconds.append(time.perf_counter() - start)
            # At a step's end, gloo's worker threads may still hold (and later free) the
            # gradients and scratch of the last collectives, and DeepSpeed leaves some tensors in
            # reference cycles: when either lets go varies from run to run. A barrier, then a
            # collection, makes "resident" what the job really keeps between steps, every run.
            torch.distributed.barrier()
            gc.collect()
            # The allocator's total (global, see count_every_thread) is only sampled at
            # allocation events of the profiled thread: make one now, after gloo's threads let go.
            sample = torch.empty(1)
            del sample
        on_step(step, total)
    return step_seconds


def progress_writer(job: dict[str, Any], rank: int):
    path = os.path.join(job["out_dir"], f"progress{rank}.txt")

    def write(step: int, total: int) -> None:
        with open(path, "a") as handle:
            handle.write(f"{step + 1} {total} {time.time():.3f}\n")

    return write


def count_every_thread() -> None:
    """Make the CPU allocator's live total count allocations and frees made on every thread.

    c10's ProfiledCPUMemoryReporter (c10/core/CPUAllocator.cpp) updates its total only on
    threads where memory profiling is on, unless FLAGS_caffe2_report_cpu_memory_usage is set.
    The profiler is on in the training thread alone, so a tensor whose last reference gloo's
    worker thread drops (a reduced gradient bucket, say) was never subtracted: the total kept it
    for good, in about half the ZeRO-1/2 runs, and gloo's own scratch was never added. With the
    flag set the total is global; the profiler still samples it at each allocation event of the
    training thread. The flag is an exported C10 global of libc10, set here through ctypes.
    """
    import ctypes
    import glob

    found = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "*c10.*")))
    if not found:
        raise RuntimeError("libc10 not found beside torch: cannot count frees on gloo's threads")
    library = ctypes.CDLL(found[0])
    ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage").value = True


def run_profiled_cpu(job: dict[str, Any], device: torch.device, progress, make_engine) -> dict[str, Any]:
    """``make_engine(job, model, device)``: the engine the job asks for (backend/rank.py engine_for)."""
    trace = bool(job.get("trace_peak"))
    count_every_thread()
    profiler = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        profile_memory=True,
        # only to name the source line of each allocation live at the peak; trace_stacks False keeps
        # the op names only (the Python stacks of a whole step can take GBs per rank to post-process)
        with_stack=trace and bool(job.get("trace_stacks", True)),
    )
    with profiler:
        model = build_model(job)
        engine = make_engine(job, model, device)
        del model
        offload = activation_offload(job, engine.module)
        step_seconds = _train_steps(job, engine, device, progress, offload)
        collectives = _count_collectives(job, engine, device)
    timeline = summarize_timeline(profiler, int(job["warmup_steps"]))
    timeline["collectives"] = collectives
    if offload.active:  # what TRL copied to the host, per micro-batch (the largest)
        timeline["offloaded_bytes"] = max(offload.micro_batch_bytes)
    timeline["by_category_resident"] = resident_by_category(engine, timeline["resident_bytes"])
    if trace:
        timeline["live_at_peak"] = live_at(profiler, timeline["peak_time_ns"])
        timeline["live_at_end"] = live_at(profiler, timeline["end_time_ns"])
        _write_last_step_events(profiler, job, int(os.environ.get("RANK", "0")))
    timeline["step_seconds"] = _median(step_seconds[int(job["warmup_steps"]):])
    timeline["tokens_per_second"] = _tokens_per_second(job, timeline["step_seconds"])
    timeline["all_step_seconds"] = step_seconds
    return timeline


def run_cuda(job: dict[str, Any], device: torch.device, progress, make_engine) -> dict[str, Any]:
    """``make_engine``: as for run_profiled_cpu."""
    torch.cuda.reset_peak_memory_stats(device)
    model = build_model(job).to(device)
    engine = make_engine(job, model, device)
    del model
    offload = activation_offload(job, engine.module)
    warmup = int(job["warmup_steps"])
    resident_after: list[int] = []

    context_after: list[int] = []

    def on_step(step: int, total: int) -> None:
        resident_after.append(torch.cuda.memory_allocated(device))
        # the device's memory outside torch's allocator at the step's end: used (total - free, the
        # driver's count, torch/cuda/memory.py mem_get_info) minus torch's reserved segments: the CUDA
        # context with the modules this process has loaded, NCCL's buffers, cudaMallocManaged pages
        free, total_bytes = torch.cuda.mem_get_info(device)
        context_after.append(int(total_bytes - free - torch.cuda.memory_reserved(device)))
        if step + 1 == warmup:
            torch.cuda.reset_peak_memory_stats(device)
        progress(step, total)

    step_seconds = _train_steps(job, engine, device, on_step, offload)
    stats = torch.cuda.memory_stats(device)
    peak_allocated = int(torch.cuda.max_memory_allocated(device))
    peak_reserved = int(torch.cuda.max_memory_reserved(device))
    collectives = _count_collectives(job, engine, device)
    seconds = _median(step_seconds[warmup:])
    return {
        "peak_bytes": peak_allocated,
        "resident_bytes": int(resident_after[-1]),
        "reserved_peak_bytes": peak_reserved,
        "context_bytes": max(context_after[warmup:] or context_after),  # the timed steps' largest
        "collectives": collectives,
        "device_name": torch.cuda.get_device_name(device),
        "memory_stats": {k: int(v) for k, v in stats.items() if isinstance(v, (int, float))},
        "by_category_resident": resident_by_category(engine, int(resident_after[-1])),
        "step_seconds": seconds,
        "tokens_per_second": _tokens_per_second(job, seconds),
        "all_step_seconds": step_seconds,
    } | ({"offloaded_bytes": max(offload.micro_batch_bytes)} if offload.active else {})


def _innermost_optimizer(engine) -> torch.optim.Optimizer | None:
    optimizer = engine.optimizer
    for _ in range(4):  # ZeRO / BF16_Optimizer wrap the torch optimizer one level deep
        if optimizer is None or (isinstance(optimizer, (torch.optim.Optimizer, Optimizers))
                                 and not hasattr(optimizer, "optimizer")):
            break
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def resident_by_category(engine, resident_bytes: int) -> dict[str, int]:
    """What stays between steps, attributed by looking at the engine's own tensors.

    Each storage is counted once, in the first category that reaches it: the 16-bit or fp32
    model parameters (ZeRO-3: the rank's ``ds_tensor`` partitions), the fp32 master copies the
    optimizer steps on, the optimizer's states, gradients; the rest of the live total is
    framework buffers (DeepSpeed's flat buffers and buckets, communication scratch).
    """
    seen: set[tuple[int, int]] = set()
    totals = {"parameters": 0, "master_weights": 0, "optimizer_states": 0, "gradients": 0}

    def add(category: str, tensor) -> None:
        if hasattr(tensor, "to_local"):  # FSDP2's DTensor: this rank's shard
            tensor = tensor.to_local()
        if hasattr(tensor, "__tensor_flatten__"):  # torchao's quantized states: codes, scale, qmap
            for inner in tensor.__tensor_flatten__()[0]:
                add(category, getattr(tensor, inner))
            return
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        key = _storage_key(tensor)
        if key[0] == 0 or key in seen:
            return
        seen.add(key)
        totals[category] += key[1]

    module_params = list(engine.module.parameters())
    for param in module_params:
        add("parameters", getattr(param, "ds_tensor", None))
        add("parameters", param.data)
    optimizer = _innermost_optimizer(engine)
    if optimizer is not None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                add("master_weights", param)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.numel() > 1:
                    add("optimizer_states", value)
        for group in optimizer.param_groups:
            for param in group["params"]:
                add("gradients", param.grad)
    for param in module_params:
        add("gradients", param.grad)
    totals["buffers"] = max(0, resident_bytes - sum(totals.values()))
    return totals


def _tokens_per_second(job: dict[str, Any], step_seconds: float) -> float:
    tokens = int(job["micro_batch"]) * int(job["seq_len"]) * int(job.get("gradient_accumulation", 1))
    return tokens / step_seconds if step_seconds > 0 else 0.0


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _profiled_events(profiler):
    """Every event of the profiler's tree (kineto's experimental_event_tree), depth first."""
    stack = list(profiler.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        yield event


def _raw_events(profiler) -> tuple[list[tuple[int, int]], dict[int, tuple[int, int]]]:
    """Allocator totals over time and the step windows, from the profiler's raw event tree.

    Every CPU allocation and free made while profiling carries ``total_allocated``: the live
    total of the c10 CPU allocator right after it (ProfiledCPUMemoryReporter in c10/core/
    CPUAllocator.cpp counts exactly the bytes allocated while memory profiling is on). The
    categorizing ``_memory_profile()`` is not used: on DeepSpeed's graphs it fails with
    "duplicate outputs" (seen with torch 2.13.0 and DeepSpeed 0.19.8), and it is slow.
    """
    from torch._C._profiler import _EventType

    totals: list[tuple[int, int]] = []
    windows: dict[int, tuple[int, int]] = {}
    for event in _profiled_events(profiler):
        kind = event.typed[0]
        if kind == _EventType.Allocation and event.typed[1].device.type == "cpu":
            totals.append((event.start_time_ns, int(event.typed[1].total_allocated)))
        elif kind == _EventType.TorchOp and event.name.startswith(STEP_MARK):
            start = event.start_time_ns
            windows[int(event.name[len(STEP_MARK):])] = (start, start + event.duration_time_ns)
    totals.sort()
    return totals, windows


def summarize_timeline(profiler, warmup_steps: int) -> dict[str, Any]:
    """Live bytes over the run.

    ``resident_bytes`` is the live total when the last step ends (what stays between steps);
    ``peak_bytes`` the highest live total from the first training step on (the first step
    allocates the optimizer states, so it belongs to what a job has to survive);
    ``steady_peak_bytes`` the same over the measured steps only; ``init_peak_bytes`` the highest
    total while the model is built and wrapped, before training.
    """
    totals, windows = _raw_events(profiler)
    if not windows:
        raise RuntimeError("no training step was recorded by the profiler")
    train_start = windows[min(windows)][0]
    steady_first = min(windows) + warmup_steps
    steady_start = windows[steady_first][0] if steady_first in windows else train_start
    last_end = windows[max(windows)][1]
    init_peak = peak = steady_peak = resident = peak_time = 0
    for t, total in totals:
        if t < train_start:
            init_peak = max(init_peak, total)
        elif t <= last_end:
            if total > peak:
                peak, peak_time = total, t
            resident = total
            if t >= steady_start:
                steady_peak = max(steady_peak, total)
    return {
        "peak_bytes": int(peak),
        "steady_peak_bytes": int(steady_peak),
        "resident_bytes": int(resident),
        "init_peak_bytes": int(init_peak),
        "peak_time_ns": int(peak_time),
        "end_time_ns": int(last_end),
        "device_name": "cpu",
    }


def peak_window(totals: list[tuple[int, int]], windows: dict[int, tuple[int, int]]) -> tuple[int, int]:
    """The (start, end) of the training step in which the live total first reaches its highest
    value (_raw_events' totals and step windows), or of the last step when that moment falls
    between steps."""
    first, last = windows[min(windows)][0], windows[max(windows)][1]
    peak, peak_time = -1, None
    for t, total in totals:
        if first <= t <= last and total > peak:
            peak, peak_time = total, t
    return next((w for w in windows.values() if peak_time is not None and w[0] <= peak_time <= w[1]),
                windows[max(windows)])


def _write_last_step_events(profiler, job: dict[str, Any], rank: int, smallest_bytes: int = 65536) -> None:
    """With trace_peak: every allocation and free of at least ``smallest_bytes`` in the step that
    holds the rank's peak (the last step when none does: the peak fell between steps), in order,
    with the live total after it, the site that made it, the address (a free names the address
    its allocation had, so what is live at any moment of the step can be rebuilt) and the ops
    around it (innermost first), to trace{rank}.json in the job's directory (the raw material for
    explaining a miss). Where a race between threads moves the peak from step to step (gloo's
    worker holding a collective's buffers), the last step may not show it."""
    import json

    from torch._C._profiler import _EventType

    start, end = peak_window(*_raw_events(profiler))
    rows = []
    for event in _profiled_events(profiler):
        if event.typed[0] == _EventType.Allocation and start <= event.start_time_ns <= end:
            fields = event.typed[1]
            if abs(fields.alloc_size) >= smallest_bytes:
                rows.append((event.start_time_ns - start, int(fields.alloc_size), int(fields.total_allocated),
                             _allocation_site(event), int(fields.ptr), _enclosing_ops(event)))
    rows.sort()
    with open(os.path.join(job["out_dir"], f"trace{rank}.json"), "w") as handle:
        json.dump(rows, handle)


def _enclosing_ops(event, depth: int = 4) -> str:
    """The names of the torch ops around an allocation, innermost first (what a trace without
    Python stacks can still say: "aten::empty < aten::cat < ...Backward0")."""
    from torch._C._profiler import _EventType

    names, node = [], event.parent
    while node is not None and len(names) < depth:
        if node.typed[0] == _EventType.TorchOp:
            names.append(node.name)
        node = node.parent
    return " < ".join(names)


def _allocation_site(event) -> str:
    """The innermost DeepSpeed / transformers / planner frame above an allocation."""
    from torch._C._profiler import _EventType

    node = event.parent
    fallback = ""
    while node is not None:
        if node.typed[0] == _EventType.PyCall:
            try:
                name = node.name
            except UnicodeDecodeError:  # seen on torch 2.13 for frames of pipelining's p2p threads
                node = node.parent
                continue
            if any(part in name for part in ("deepspeed/", "transformers/", "backend/", "pipelining/")):
                return name.split("site-packages/")[-1]
            fallback = fallback or name
        elif not fallback and node.typed[0] == _EventType.TorchOp:
            fallback = node.name
        node = node.parent
    return fallback or "?"


def live_at(profiler, time_ns: int, top: int = 25) -> list[dict[str, Any]]:
    """Allocations live at one instant, grouped by the function that made them."""
    from torch._C._profiler import _EventType

    live: dict[int, tuple[int, Any]] = {}
    events = []
    for event in _profiled_events(profiler):
        if event.typed[0] == _EventType.Allocation and event.start_time_ns <= time_ns:
            events.append(event)
    for event in sorted(events, key=lambda e: e.start_time_ns):
        fields = event.typed[1]
        if fields.alloc_size > 0:
            live[fields.ptr] = (fields.alloc_size, event)
        else:
            live.pop(fields.ptr, None)
    sites: dict[str, list[int]] = {}
    for size, event in live.values():
        entry = sites.setdefault(_allocation_site(event), [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda item: -item[1][0])[:top]
    return [{"site": site, "bytes": total, "count": count} for site, (total, count) in ranked]

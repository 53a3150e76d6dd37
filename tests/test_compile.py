"""The `compile` field (planner/recipes/compile.py): a compiled block saves at most what eager saves,
measured on CPU with the partitioner inductor uses, so the planner's eager saved set bounds the compiled
run's; the step time takes inductor's fused kernels (planner/time/fusion.py); what is not modelled with
compile is refused, naming the field."""

from __future__ import annotations

from functools import partial

import pytest

from planner.errors import PlannerError
from planner.memory.orchestrator import estimate
from planner.model.activations import block_saved_bytes
from planner.model.architecture import from_hf_config, layer_specs
from planner.schema import EstimateRequest
from planner.time.step import estimate_with_time
from tests.real_runs import GPT2, LLAMA, QWEN3

TOKENS = 97  # a prime: no weight's size is a multiple of it
BLOCKS = {"llama": LLAMA, "qwen3": QWEN3, "gpt2": GPT2}


def _block(config: dict, torch):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.for_model(**dict(config, **({"n_layer": 1} if "n_layer" in config else {"num_hidden_layers": 1})))
    hf._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(hf).to(torch.bfloat16)
    x = torch.randn(1, TOKENS, hf.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    if config["model_type"] == "gpt2":
        return model.transformer.h[0], x, {}
    positions = torch.arange(TOKENS)[None]
    return model.model.layers[0], x, {"position_ids": positions,
                                      "position_embeddings": model.model.rotary_emb(x, positions)}


def _eager_saved(block, x, kwargs, torch) -> int:
    """Bytes of the storages eager autograd saves, the block's parameters and inputs left out."""
    inputs = [p for p in block.parameters()] + [x] + [t for v in kwargs.values()
                                                      for t in (v if isinstance(v, tuple) else (v,))]
    excluded = {t.untyped_storage().data_ptr() for t in inputs}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in excluded:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, **kwargs)
    return sum(seen.values())


def _compiled_saved(block, x, kwargs, torch) -> int:
    """Bytes of the forward graph's outputs beyond the block's own, as the partitioner inductor runs
    (min_cut_rematerialization_partition, compiler="inductor") cuts the joint graph; saved inputs and
    parameters (placeholders) left out."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from functorch.compile import make_boxed_func

    saved = []

    def forward(gm, _):
        placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved.append(sum(o.meta["val"].numel() * o.meta["val"].element_size() for o in outputs[1:]
                         if isinstance(o, torch.fx.Node) and o not in placeholders
                         and isinstance(o.meta.get("val"), torch.Tensor)))
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=partial(min_cut_rematerialization_partition, compiler="inductor"))
    torch._dynamo.reset()
    y = torch.compile(block, backend=backend, fullgraph=True)(x, **kwargs)
    (y[0] if isinstance(y, tuple) else y).sum().backward()
    torch._dynamo.reset()
    assert len(saved) == 1, "one graph: the block compiled whole"
    return saved[0]


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_compiled_block_saves_at_most_eager_and_the_planners_count(name):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    block, x, kwargs = _block(BLOCKS[name], torch)
    eager = _eager_saved(block, x, kwargs, torch)
    compiled = _compiled_saved(block, x, kwargs, torch)
    arch = from_hf_config(BLOCKS[name])
    planned = block_saved_bytes(arch, layer_specs(arch)[0], TOKENS, TOKENS, 1, 2, "sdpa", "cpu")
    # the bound the estimate rests on, and the range planner/recipes/compile.py states (63-74%)
    assert compiled <= eager <= planned
    assert 0.6 <= compiled / eager <= 0.78, (name, compiled, eager)


def _request(**fields) -> EstimateRequest:
    base = {"model_config": LLAMA, "gpu": "h100-80gb", "gpus": 8, "strategy": "fsdp", "seq_len": 2048,
            "micro_batch": 2}
    return EstimateRequest(**(base | fields))


def test_compile_keeps_eager_memory_and_fuses_the_step():
    eager, blocks, model = (estimate_with_time(_request(compile=c)) for c in ("none", "blocks", "model"))
    assert blocks.per_device.peak_bytes == eager.per_device.peak_bytes == model.per_device.peak_bytes
    assert model.time.step_seconds < eager.time.step_seconds and blocks.time.step_seconds < eager.time.step_seconds
    assert any("torch.compile (the whole model" in n for n in model.notes)
    assert not any("torch.compile" in n for n in eager.notes)
    term = {t.name: t.source for t in model.time.terms}["elementwise and loss"]
    assert "torch.compile (model)" in term


@pytest.mark.parametrize("fields, why", [({"pp": 2, "gpus": 8}, "pp=2"),
                                         ({"checkpointing": "selective-op"}, "selective-op"),
                                         ({"activation_offload": True}, "activation_offload"),
                                         ({"finetune": "lora"}, "finetune lora")])
def test_compile_refused_where_not_modelled(fields, why):
    with pytest.raises(PlannerError) as e:
        estimate(_request(compile="blocks", **fields))
    assert e.value.field == "compile" and why in str(e.value)


def test_compile_bad_value_names_the_field():
    with pytest.raises(ValueError, match="compile"):
        _request(compile="max-autotune")


def test_verify_refuses_compile(tmp_path):
    from backend.launch import worker_job

    with pytest.raises(PlannerError) as e:
        worker_job(_request(compile="model", gpu="cpu"), steps=2, warmup_steps=1, out_dir=tmp_path)
    assert e.value.field == "compile"


def test_plan_under_compile_leaves_pipelines_out_and_runs_faster():
    from planner.plan.search import plan
    from planner.schema import PlanRequest

    base = {"model": "llama-3-8b", "gpu": "h100-80gb", "gpus": 8, "nodes": 2, "seq_len": 4096, "global_batch": 64}
    eager, compiled = plan(PlanRequest(**base)), plan(PlanRequest(**base, compile="blocks"))
    assert all(c.parallel.pp == 1 for c in compiled.candidates + compiled.families)
    assert any("compile blocks is modelled without pipeline parallelism" in n for n in compiled.notes)
    assert compiled.recommended.step_seconds < eager.recommended.step_seconds
    with pytest.raises(PlannerError) as e:
        plan(PlanRequest(**base, pp=2, compile="model"))
    assert e.value.field == "compile"

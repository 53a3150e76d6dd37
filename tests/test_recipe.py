"""Recipe is the one precision decoder (issue 10): the code below the request reads a precision's
bytes, dtypes and modes from planner.recipes.precision.RECIPES and never compares its name again."""

import ast
from pathlib import Path

import pytest

from planner.recipes.precision import RECIPES

ROOT = Path(__file__).resolve().parent.parent
# Where a precision's name may be read: the recipe table itself, the request's Literal, and the
# reading of a ds_config's bf16/fp16 blocks into a name.
PARSERS = {"planner/recipes/precision.py": None, "planner/schema.py": None, "planner/frameworks/deepspeed/config.py": {"_precision"}}
# Names no other code has a reason to spell; "fp32" is also a dtype, so it counts only against a precision.
RECIPE_ONLY_NAMES = {name for name in RECIPES if name != "fp32"}


def _strings(node: ast.AST) -> set[str]:
    """The string constants of a constant, or of a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*(_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def _about_precision(node: ast.AST) -> bool:
    """A precision's name (not a field of its decoded Recipe, RECIPES[precision].compute)."""
    text = ast.unparse(node).replace("low_precision", "")  # the fp8/fp4 linears' axis, not a precision recipe
    return not _strings(node) and "precision" in text and "RECIPES[" not in text


def name_comparisons(root: Path) -> list[str]:
    """Every place under planner/ backend/ web/ cli/ bench/ that decodes a precision from its name:
    a comparison with (or membership in) a recipe name, a precision compared with a string, a
    prefix/suffix test on a precision, or a table keyed by recipe names."""
    found = []
    for folder in ("planner", "backend", "web", "cli", "bench"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel in PARSERS and PARSERS[rel] is None:
                continue
            tree = ast.parse(path.read_text())
            skipped = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in (PARSERS.get(rel) or ())
                       for n in ast.walk(f)}
            for node in ast.walk(tree):
                if id(node) in skipped:
                    continue
                hit = False
                if isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    named = set().union(*(_strings(s) for s in sides))
                    hit = bool(named & RECIPE_ONLY_NAMES) or (bool(named) and any(_about_precision(s) for s in sides))
                elif isinstance(node, ast.Dict):
                    hit = bool({k.value for k in node.keys if isinstance(k, ast.Constant)} & RECIPE_ONLY_NAMES)
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    hit = node.func.attr in ("startswith", "endswith") and _about_precision(node.func.value)
                if hit:
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
    return sorted(found, key=lambda f: (f.split(":")[0], int(f.split(":")[1])))


def test_no_precision_is_decoded_from_its_name_outside_the_recipe():
    assert name_comparisons(ROOT) == []


def test_the_check_finds_each_way_of_decoding_a_name(tmp_path):
    (tmp_path / "planner").mkdir()
    (tmp_path / "planner" / "x.py").write_text(
        'a = 4 if request.precision == "fp32" else 2\n'
        'b = precision in ("bf16-mixed", "bf16-pure")\n'
        'c = req.precision.startswith("bf16")\n'
        'd = "bf16" in launch.precision\n'
        'E = {"bf16-mixed": "bf16", "fp16-mixed": "fp16"}\n'
        'f = "precision" in request.model_fields_set\n'  # a field name, not a precision: allowed
        'g = zero.precision != precision\n'  # two decoded names agreeing: allowed
        'h = dtype == "fp32"\n'  # a dtype: allowed
        'i = RECIPES[request.precision].compute == "bf16"\n')  # read from the Recipe: allowed
    parser = next(path for path, functions in PARSERS.items() if functions)  # the DeepSpeed config reader
    (tmp_path / parser).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / parser).write_text(
        'def _precision(c):\n    return "fp32" if c == "fp32" else "bf16-mixed"\n'
        'def build(precision):\n    return precision == "fp16-mixed"\n')
    found = name_comparisons(tmp_path)
    assert [f.split(":")[:2] for f in found] == [[parser, "4"]] + [["planner/x.py", str(n)] for n in (1, 2, 3, 4, 5)]


@pytest.mark.parametrize("name,param,master,compute,autocast,cast,module,scaled", [
    # ZeRO paper Sec. 3.1: 16-bit weights and gradients, an fp32 master; autocast over fp32 parameters
    ("bf16-mixed", 2, 4, 2, "bf16", False, 4, False),
    ("fp16-mixed", 2, 4, 2, "fp16", False, 4, True),
    ("bf16-pure", 2, 0, 2, None, True, 2, False),
    ("fp32", 4, 0, 4, None, False, 4, False),
])
def test_each_recipe_decodes_to_its_bytes_and_modes(name, param, master, compute, autocast, cast, module, scaled):
    r = RECIPES[name]
    assert (r.param_bytes, r.grad_bytes, r.wire_bytes, r.master_bytes, r.compute_bytes) == (param, param, param, master,
                                                                                             compute)
    assert (r.autocast_dtype, r.casts_model, r.module_bytes, r.loss_scaling) == (autocast, cast, module, scaled)
    assert r.reduced_dtype == (None if name == "fp32" else name[:4])


def test_fp32_runs_at_the_tf32_rate_where_the_gpu_has_it():
    assert RECIPES["fp32"].peak_dtype({"tf32": 495.0, "fp32": 67.0}) == "tf32"
    assert RECIPES["fp32"].peak_dtype({"fp32": 19.5}) == "fp32"
    assert RECIPES["bf16-pure"].peak_dtype({"tf32": 495.0, "bf16": 989.0}) == "bf16"

"""A fence around DeepSpeed's private state: only ``megatransformer/training/deepspeed/`` may read it.

DeepSpeed keeps its partitions in attributes its documentation never names, most of them without Python's leading
underscore (``fp32_partitioned_groups_flat``, ``grad_position``, a ZeRO-3 parameter's ``ds_numel``), so an underscore
rule alone would miss them. The rule: no module outside the package reads, as an attribute or through
``getattr``/``hasattr``/``setattr``, a name DeepSpeed sets on its optimizer wrappers or on parameters, or a private
one of ``zero.Init`` or its groups (the list below, read from DeepSpeed 0.19.8's ZeRO, bf16 and fp16 optimizers,
``zero.Init`` and ``utils/groups.py``) or any ``ds_*`` attribute (ZeRO-3's on every parameter). A new reading of
DeepSpeed's internals goes into the package, where an upgrade is checked."""

from __future__ import annotations

import ast

from support import REPO

PACKAGE = REPO / "megatransformer"
FENCED = PACKAGE / "training" / "deepspeed"
PRIVATE = {
    "_hp_mapping",
    "_z3_optimizer",
    "_get_param_partition_rank",
    "_get_fp32_opt_state_partition",
    "_reassign_or_swap_out_partitioned_parameters",
    "_lazy_init_hp_params_optimizer_state",
    "_hp_optimizer_states_linked",
    "_get_data_parallel_rank",
    "_init_tp_mesh_device",
    "_convert_to_zero_parameters",
    "convert_to_zero_parameters",
    "fp32_partitioned_groups_flat",
    "single_partition_of_fp32_groups",
    "fp32_groups_flat_partition",
    "fp32_groups_gradient_flat_partition",
    "fp32_groups_flat",
    "fp32_groups",
    "fp16_groups",
    "bit16_groups",
    "bf16_groups",
    "grad_position",
    "get_param_id",
    "real_dp_process_group",
    "dp_process_group",
    "sub_group_to_group_id",
    "partition_count",
    "get_grads_for_norm",
    "clear_hp_grads",
    "update_lp_params",
}


def private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each read of DeepSpeed's private state in ``tree``."""

    def private(name: str) -> bool:
        return name in PRIVATE or name.startswith("ds_")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            found.append((node.lineno, node.attr))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
        ):
            found.append((node.lineno, node.args[1].value))
    return found


def test_only_the_deepspeed_package_reads_deepspeeds_private_state():
    outside = [p for p in sorted(PACKAGE.rglob("*.py")) if FENCED not in p.parents]
    reads = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in outside
        for line, name in private_reads(ast.parse(path.read_text()))
    ]
    assert not reads, "move these into megatransformer/training/deepspeed/:\n" + "\n".join(reads)


def test_the_fence_sees_attribute_and_getattr_reads():
    code = "a = opt.grad_position[0]\nb = getattr(p, 'ds_numel', 0)\nc = hasattr(p, '_hp_mapping')\nd = x.shape"
    assert sorted(name for _, name in private_reads(ast.parse(code))) == ["_hp_mapping", "ds_numel", "grad_position"]
    assert private_reads(ast.parse((FENCED / "partitions.py").read_text())) == []  # (reads through internals.py)


def test_the_checkpointer_finds_partitions_only_through_the_map():
    """The checkpointer's pieces are the partition map's fragments (``partitions.py``), their live state read
    through ``masters.py``: no second description of DeepSpeed's partitions from its attributes."""
    checkpointer = PACKAGE / "training" / "checkpointing" / "checkpointer.py"
    imported = {
        node.module for node in ast.walk(ast.parse(checkpointer.read_text())) if isinstance(node, ast.ImportFrom)
    }
    assert "megatransformer.training.deepspeed.internals" not in imported

"""What crosses into the device ops, checked while tracing (shapes are static, so the
checks cost nothing per step): no batch, table or gradient that does not fit the
plan reaches a kernel, where it would read out of bounds or return garbage."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..preprocessing import PreprocessedBatch, StackBuffers, signature_differences
from ..preprocessing._limits import MINIBATCHING_FACTOR
from ..specs import OptimizerSpec
from ..stacking import StackingPlan
from ._backend import FlatBuffers
from ._layout import StackLayout
from ._minibatching import check_sizes

VARIABLES_REMEDY = "Pass the variables made for this plan (tilecore.ops.init_tables(plan, key))."
"""What to do when the variables the ops are given are not the plan's stacks."""
_REMEDY = ("Preprocess the batch with the plan you pass to the ops (after an FDO or limit "
           "change, preprocess again with the new plan).")


def check_names(what: str, kind: str, given: Any, expected: Iterable[str], remedy: str) -> None:
    """`given` is a mapping keyed by exactly the names `expected` (a plan's stacks or
    features): a TypeError or one ValueError listing the missing and unknown names, never a
    KeyError from inside the ops (or a misspelt name's values silently left out)."""
    if not isinstance(given, Mapping):
        raise TypeError(f"{what}: {kind} must map names to arrays, got {type(given).__name__}. "
                        f"{remedy}")
    names = set(expected)
    missing, unknown = sorted(names - set(given)), sorted(set(given) - names)
    if missing or unknown:
        raise ValueError(f"{what}: {kind} are keyed by {sorted(given)}, the plan's are "
                         f"{sorted(names)} (missing {missing}, unknown {unknown}). {remedy}")


def check_call(plan: StackingPlan, batch: PreprocessedBatch, mesh: Mesh | None, axis: str,
               what: str) -> None:
    """The batch was made for `plan`, holds its stacks, and the mesh is the plan's."""
    devices = plan.topology.global_devices
    if mesh is None and devices != 1:
        raise ValueError(f"{what}: the plan spans {devices} devices; pass the mesh they form.")
    if mesh is not None:
        check_mesh(plan, mesh, axis, what)
    if jax.process_count() > 1:
        # Processes with different plans would pair collectives of different sizes (gloo
        # aborts without a Python error): they agree first, once per plan, and fail together.
        from ..distributed._together import ensure_agreed

        ensure_agreed(plan)
    if not isinstance(batch, PreprocessedBatch):
        raise TypeError(f"{what}: the batch must be the PreprocessedBatch that "
                        f"tilecore.preprocess returns, got {type(batch).__name__}.")
    _check_minibatch_count(plan, batch.num_minibatches, what)
    if not isinstance(batch.stacks, Mapping):
        raise TypeError(f"{what}: the batch's stacks must map stack names to StackBuffers, got "
                        f"{type(batch.stacks).__name__}. {_REMEDY}")
    missing = sorted(set(plan.stacks) - set(batch.stacks))
    extra = sorted(set(batch.stacks) - set(plan.stacks))
    if missing or extra:
        raise ValueError(
            f"{what}: the batch holds stacks {sorted(batch.stacks)} but the plan has "
            f"{sorted(plan.stacks)} (missing {missing}, unknown {extra}). {_REMEDY}")
    junk = {name: type(b).__name__ for name, b in batch.stacks.items()
            if not isinstance(b, StackBuffers)}
    if junk:
        raise TypeError(f"{what}: the batch's stacks must hold StackBuffers, got {junk}. "
                        f"{_REMEDY}")
    made_for = getattr(batch, "made_for", None)
    if made_for is not None:
        if not (isinstance(made_for, tuple) and all(
                isinstance(item, tuple) and len(item) == 2 for item in made_for)):
            raise TypeError(f"{what}: the batch's made_for must be None (a batch built by "
                            "hand) or the signature preprocessing wrote, got "
                            f"{made_for!r:.80}. {_REMEDY}")
        differences = signature_differences(made_for, plan)
        if differences:
            raise ValueError(
                f"{what}: the batch was preprocessed for another plan; "
                f"{'; '.join(differences[:4])}"
                f"{f' (and {len(differences) - 4} more)' if len(differences) > 4 else ''}. "
                f"{_REMEDY}")


def check_mesh(plan: StackingPlan, mesh: Mesh, axis: str, what: str) -> None:
    """`axis` is an axis of `mesh` over the plan's devices, split evenly between the
    processes: refused up front, naming both, rather than by JAX's "Resource axis ... is
    not found in mesh" or a layout split the wrong number of ways."""
    if axis not in mesh.shape:
        raise ValueError(f"{what}: the mesh has axes {tuple(mesh.shape)}, not {axis!r}; "
                         "pass axis= the mesh axis the tables are sharded over.")
    devices = plan.topology.global_devices
    if mesh.shape[axis] != devices:
        raise ValueError(
            f"{what}: the mesh splits {axis!r} over {mesh.shape[axis]} devices but the "
            f"plan was built for {devices}; build the plan for this mesh "
            f"(Topology(global_devices={mesh.shape[axis]}, ...)) or use its mesh.")
    if jax.process_count() > 1:
        check_even_processes(mesh, what)


def check_even_processes(mesh: Mesh, what: str) -> None:
    """Every process holds as many of the mesh's devices: each process preprocesses its
    own equal share of the batch for its local devices."""
    per_process: dict[int, int] = {}
    for device in mesh.devices.flat:
        per_process[device.process_index] = per_process.get(device.process_index, 0) + 1
    if len(set(per_process.values())) > 1:
        raise ValueError(
            f"{what}: the processes hold different numbers of the mesh's devices "
            f"({dict(sorted(per_process.items()))}, process → devices); tilecore needs the "
            "same number on every process (each preprocesses an equal share of the batch).")


def _check_minibatch_count(plan: StackingPlan, count: Any, what: str) -> None:
    """A minibatch count known on the host (an int or NumPy array; a device array is read
    on the device only) is in [1, 64] for a minibatching plan, 1 for a plain one: the
    kernels would read minibatches that do not exist, or none."""
    if isinstance(count, jax.Array):
        return
    values = np.asarray(count)
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"{what}: the batch's num_minibatches must be integers, got {count!r}.")
    most = MINIBATCHING_FACTOR if plan.config.enable_minibatching else 1
    if values.size and not (values.min() >= 1 and values.max() <= most):
        raise ValueError(f"{what}: the batch's num_minibatches is {count!r}; a batch of this "
                         f"plan has 1 to {most}. {_REMEDY}")


def check_buffers(flat: FlatBuffers, layout: StackLayout) -> None:
    """One device's flat buffers have the dtypes and sizes of the stack's layout."""
    rp, ids, samples, gains = flat
    dtypes = {"row_pointers": rp.dtype, "embedding_ids": ids.dtype, "sample_ids": samples.dtype,
              "gains": gains.dtype}
    wrong = {name: str(dtype) for name, dtype in dtypes.items()
             if dtype != (np.float32 if name == "gains" else np.int32)}
    if wrong:
        raise ValueError(f"Stack {layout.name!r}: the batch's buffers {wrong} must be int32 "
                         f"(gains float32), as preprocessing writes them. {_REMEDY}")
    sizes = {"embedding_ids": ids.shape[0], "sample_ids": samples.shape[0],
             "gains": gains.shape[0]}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"Stack {layout.name!r}: one device's COO buffers differ in size "
                         f"({sizes}); they must be one batch's buffers. {_REMEDY}")
    if layout.minibatched:
        check_sizes(rp, ids, layout)
        return
    s = layout.sc_per_device
    want = {"row_pointers": s * layout.pointers_per_sc, "COO entries": s * layout.slot}
    got = {"row_pointers": rp.shape[0], "COO entries": ids.shape[0]}
    if got != want:
        raise ValueError(
            f"Stack {layout.name!r}: each device's buffers hold {got} but the plan's layout "
            f"has {want} ({s} SparseCores x {layout.pointers_per_sc} pointers, x "
            f"{layout.slot} entries): the batch was preprocessed for another plan (batch "
            f"size, limits, devices or minibatching), or for another device count. {_REMEDY}")


def check_table(table: jax.Array, layout: StackLayout, what: str = "table") -> None:
    """A device's shard of a stack's table (or slot) is `[S·R, dim]`."""
    want = (layout.rows_per_device, layout.dim)
    if tuple(table.shape) != want:
        raise ValueError(
            f"Stack {layout.name!r}: each device's {what} shard is {tuple(table.shape)} but the "
            f"plan's is {want} ({layout.sc_per_device} SparseCores x {layout.rows_per_shard} "
            f"rows, width {layout.dim}); rows outside it would be lost. Create the variables "
            "with tilecore.ops.init_tables(plan, key) (or shard) for this plan and mesh.")


def check_table_dtype(table: jax.Array, layout: StackLayout) -> None:
    """A stack's table is stored in the stack's `weights_dtype`."""
    if np.dtype(table.dtype) != layout.weights_dtype:
        name = layout.weights_dtype.name
        raise ValueError(
            f"Stack {layout.name!r}: the table is {_dtype_text(table.dtype)} but its tables "
            f"are stored as {name} (TableSpec weights_dtype). Create the variables with "
            f"tilecore.ops.init_tables(plan, key), or cast the table: "
            f"table.astype(jnp.{name}).")


def check_slot_dtypes(slots: Any, layout: StackLayout,
                      optimizer: OptimizerSpec | None = None) -> None:
    """A stack's optimizer slots are float32, whatever the table's storage (the update
    rules accumulate in them; a bfloat16 or int32 accumulator was taken on XLA's path,
    its values rounded, and reached the CPU kernels as an FFI operand error)."""
    names = optimizer.slot_names if optimizer is not None else ()
    for k, slot in enumerate(slots):
        if np.dtype(slot.dtype) != np.float32:
            label = f"slot {k}" + (f" ({names[k]!r})" if k < len(names) else "")
            raise ValueError(
                f"Stack {layout.name!r}: {label} is {_dtype_text(slot.dtype)} but optimizer "
                "slots are float32. Create the variables with tilecore.ops.init_tables(plan, "
                "key), or cast the slot: slot.astype(jnp.float32).")


def _dtype_text(dtype: Any) -> str:
    """A dtype's name, with its byte order when that is not the host's (`>f4` and `<f4`
    are both named float32)."""
    dtype = np.dtype(dtype)
    return dtype.name if dtype.isnative else f"{dtype.name} of byte order {dtype.str!r}"


def check_variables(variables: Any, layout: StackLayout,
                    optimizer: OptimizerSpec | None = None) -> None:
    """A stack's table and slots fit the layout (and, given it, the optimizer's slots)."""
    if optimizer is not None and len(variables.slots) != len(optimizer.slot_names):
        raise ValueError(
            f"Stack {layout.name!r}: the variables carry {len(variables.slots)} slot(s) but "
            f"{type(optimizer).__name__} keeps {len(optimizer.slot_names)} "
            f"({', '.join(optimizer.slot_names) or 'none'}); create them with "
            "tilecore.ops.init_tables(plan, key) for this plan.")
    check_table(variables.table, layout)
    check_table_dtype(variables.table, layout)
    for k, slot in enumerate(variables.slots):
        check_table(slot, layout, f"slot {k}")
    check_slot_dtypes(variables.slots, layout, optimizer)


def check_grads(grads: jax.Array, layout: StackLayout) -> None:
    """One device's stacked activation gradients are `[S·samples_per_sc, dim]`."""
    want = layout.sc_per_device * layout.samples_per_sc * layout.dim
    if int(np.prod(grads.shape)) != want:
        raise ValueError(
            f"Stack {layout.name!r}: each device's activation gradients are "
            f"{tuple(grads.shape)} but the plan's stacked activations are "
            f"[{layout.sc_per_device * layout.samples_per_sc}, {layout.dim}]; pass the "
            "gradients of the activations lookup returned for this batch.")


def check_clip(what: str, clip: Any) -> None:
    """`clip` maps names to (min, max) pairs of numbers with min <= max (NaN refused)."""
    if not isinstance(clip, Mapping):
        raise TypeError(f"{what} must map stack names to (min, max), got {clip!r}.")
    for name, bounds in clip.items():
        pair = tuple(bounds) if isinstance(bounds, tuple | list) else ()
        if len(pair) != 2 or not all(
                isinstance(b, int | float | np.number) and not isinstance(b, bool)
                and not np.isnan(b) for b in pair) or not pair[0] <= pair[1]:
            raise ValueError(f"{what}[{name!r}] must be (min, max) with min <= max; got "
                             f"{bounds!r}.")


def check_step(step: Any) -> None:
    """A concrete step is a 0-based int32 count whose successor is one too (a negative
    one makes Adam's bias correction divide by zero; Adam and LaProp count updates from
    `step + 1`, which at 2**31 - 1 wrapped to -2**31: NaN rows). Traced steps pass."""
    try:
        value = np.asarray(step)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return  # traced: its value is only known on the device
    if value.shape != () or not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"step must be an integer scalar (the 0-based global step), got "
                         f"{step!r}.")
    if not 0 <= int(value) < 2**31 - 1:
        raise ValueError(f"step must be in [0, 2**31 - 1), got step={int(value)}: it is the "
                         "0-based count of updates applied so far (an int32, as is the "
                         "1-based count step + 1 that Adam and LaProp use).")

"""Resharding MoE checkpoints: per-process state dicts of world size N -> those of world size M.

Everything goes through the *global form*: the state dict a single process holding all E
experts would save (``batched_fc1_w [E, H, M]``, llama_ffn's flat ``[E * P]`` ...).  Expert
parameters are first taken apart into whole experts (joining the slices of shared experts),
then put together again for the new placement (cutting them where experts are shared).
Parameters outside the experts are the same on every process and are copied.

Used by the ``tutel.checkpoint.gather`` / ``scatter`` command lines, by
``tutel.checkpoint.load_resharded`` and by ``moe_layer.load_state_dict`` (which accepts the
global form directly).
"""
import collections
import logging
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

import torch

from .layouts import FLAT, PADDED, ShapeError, layout_of
from ..rules.placement import Placement
from .state_dicts import (
    COUNT_SUFFIX,
    EXPERTS,
    expert_names,
    find_moe_layers,
    is_expert_key,
    new_state,
    recorded_placement,
    set_placement,
)

logger = logging.getLogger("tutel")

State = Mapping[str, torch.Tensor]


class ExpertCoverageError(ValueError):
    """The given files do not hold every global expert exactly once."""


class ExpertTensors(NamedTuple):
    """One expert parameter of one layer, taken apart: its layout and {expert index: whole expert}."""

    layout: object
    experts: Dict[int, torch.Tensor]


# ----------------------------------------------------------------------------- sizes


def _model_dim(state: State, prefix: str) -> Optional[int]:
    """The layer's model_dim, read from its gate weights (top: wg [E, M]; cosine_top: projector [P, M])."""
    for key, value in state.items():
        if key.startswith(prefix + "gates.") and key.endswith(("wg.weight", "cosine_projector.weight")):
            return int(value.shape[-1])
    return None


def _flat_expert_size(shard: int, shares: int, model_dim: Optional[int], what: str) -> int:
    """A llama_ffn expert's size P (a multiple of model_dim) from its slices of ceil(P / shares) values."""
    if model_dim is None:
        raise ShapeError(f"{what}: cannot tell the expert's size from {shares} slices of {shard} values: the "
                         f"checkpoint has no gate weight giving model_dim (load_resharded takes it from the model)")
    candidates = [p for p in range(shard * shares - shares + 1, shard * shares + 1) if p % model_dim == 0]
    if len(candidates) != 1:
        raise ShapeError(f"{what}: {shares} slices of {shard} values can hold an expert of any of {candidates} "
                         f"values (multiples of model_dim={model_dim}); load_resharded takes the size from the model")
    return candidates[0]


def expert_full_sizes(state: State, prefix: str, shares: int,
                      known: Optional[Mapping[str, int]] = None) -> Dict[str, Optional[int]]:
    """Per expert parameter name, the size of one whole expert where joining slices needs it:
    ffn's fc2 bias (output_dim) and llama_ffn's flat weights (P); None where it does not."""
    sizes: Dict[str, Optional[int]] = {}
    for name in expert_names(state, prefix):
        value = state[prefix + EXPERTS + name]
        layout = layout_of(name, value)
        if known and name in known:
            sizes[name] = int(known[name])
        elif layout is PADDED and prefix + EXPERTS + "batched_fc2_w" in state:
            sizes[name] = int(state[prefix + EXPERTS + "batched_fc2_w"].shape[-1])
        elif layout is FLAT and shares > 1 and name.startswith("W_fc"):
            sizes[name] = _flat_expert_size(value.numel(), shares, _model_dim(state, prefix),
                                            f"`{prefix}{EXPERTS}{name}`")
        else:
            sizes[name] = None
    return sizes


# ----------------------------------------------------------------------------- coverage


def layer_name(prefix: str) -> str:
    """How messages name the MoE layer at `prefix`."""
    return f"`{prefix[:-1]}`" if prefix else "(the top-level module)"


def _describe_piece(expert: int, piece: int, shares: int) -> str:
    return f"expert {expert}" if shares == 1 else f"expert {expert} (slice {piece + 1}/{shares})"


def source_ranks(states: Sequence[Optional[State]], labels: Sequence[str], prefix: str,
                 placement: Placement, wanted: Optional[Set[int]] = None) -> Dict[tuple, Tuple[int, int]]:
    """{(expert, slice): (index of the source holding it, position in that source)}, checking that every wanted expert is
    held exactly once.  A source's rank is the one its placement record names, else its
    position; None stands for a missing file."""
    holders: Dict[tuple, List[Tuple[int, int]]] = {}
    for index, state in enumerate(states):
        if state is None:
            continue
        record = recorded_placement(state, prefix)
        rank = index
        if record is not None:
            rank, world_size = record
            if world_size != placement.world_size:
                raise ExpertCoverageError(
                    f"{labels[index]} holds MoE layer {layer_name(prefix)} as saved by rank {rank} of {world_size} processes, "
                    f"but {placement.world_size} files were given: give the files of all {world_size} processes")
        for position, piece in enumerate(placement.pieces(rank)):
            holders.setdefault(piece, []).append((index, position))
    wanted_pieces = [(e, s) for e in range(placement.num_experts) for s in range(placement.sharded_count)
                     if wanted is None or e in wanted]
    missing = [piece for piece in wanted_pieces if piece not in holders]
    duplicated = [piece for piece in wanted_pieces if len(holders.get(piece, ())) > 1]
    if missing or duplicated:
        shares = placement.sharded_count
        problems = []
        if missing:
            problems.append("missing: " + ", ".join(
                f"{_describe_piece(e, s, shares)} (rank {placement.owners(e)[s]}'s share"
                f"{_file_note(labels[placement.owners(e)[s]], placement.owners(e)[s])})" for e, s in missing))
        if duplicated:
            problems.append("duplicated: " + ", ".join(
                f"{_describe_piece(e, s, shares)} (in {' and '.join(labels[i] for i, _ in holders[(e, s)])})"
                for e, s in duplicated))
        raise ExpertCoverageError(f"expert coverage check failed for MoE layer {layer_name(prefix)} ({placement.num_experts} "
                                  f"experts over {placement.world_size} processes): " + "; ".join(problems))
    return {piece: indices[0] for piece, indices in holders.items()}


def _file_note(label: str, rank: int) -> str:
    return "" if label == f"rank {rank}" else f", {label}"


def _warn_identical_experts(experts: Dict[str, ExpertTensors], prefix: str, unrecorded: bool) -> None:
    """Warns when two experts are bit-identical: the sign of a file copied from another rank
    (checked for files without a placement record, whose ranks are only their positions)."""
    if not unrecorded or not experts:
        return
    tables = [param.experts for param in experts.values()]
    seen: Dict[tuple, int] = {}
    for expert in sorted(tables[0]):
        fingerprint = tuple(float(table[expert].double().sum()) for table in tables)
        other = seen.setdefault(fingerprint, expert)
        if other != expert and all(torch.equal(table[other], table[expert]) for table in tables):
            logger.warning("MoE layer %s: experts %d and %d are bit-identical. If a rank's file is a copy of "
                           "another rank's, the resharded checkpoint holds the wrong experts.", layer_name(prefix),
                           other, expert)


# ----------------------------------------------------------------------------- experts


def whole_experts(states: Sequence[Optional[State]], labels: Sequence[str], prefix: str, num_experts: int,
                  wanted: Optional[Set[int]] = None,
                  known_sizes: Optional[Mapping[str, int]] = None) -> Dict[str, ExpertTensors]:
    """{expert parameter name: its layout and whole experts} from per-rank states
    (index = rank; None = missing) of one MoE layer; only `wanted` experts (default all)."""
    placement = Placement(num_experts, len(states))
    owner = source_ranks(states, labels, prefix, placement, wanted)
    reference_index = next(i for i, state in enumerate(states) if state is not None)
    reference = states[reference_index]
    names = expert_names(reference, prefix)
    sizes = expert_full_sizes(reference, prefix, placement.sharded_count, known_sizes)
    experts: Dict[str, ExpertTensors] = {}
    for name in names:
        key = prefix + EXPERTS + name
        shape = tuple(reference[key].shape)
        for index in {index for index, _ in owner.values()}:
            if key not in states[index]:
                raise ValueError(f"{labels[index]} lacks `{key}` (present in {labels[reference_index]})")
            if tuple(states[index][key].shape) != shape:
                raise ShapeError(f"`{key}` has shape {tuple(states[index][key].shape)} in {labels[index]} but "
                                 f"{shape} in {labels[reference_index]}")
        layout = layout_of(name, reference[key])
        per_expert: Dict[int, torch.Tensor] = {}
        for expert in range(num_experts):
            if wanted is not None and expert not in wanted:
                continue
            what = f"`{key}` of expert {expert}"
            if placement.sharded_count == 1:
                index, position = owner[(expert, 0)]
                per_expert[expert] = layout.split_experts(states[index][key], placement.local_experts, what)[position]
            else:
                pieces = [states[owner[(expert, s)][0]][key] for s in range(placement.sharded_count)]
                per_expert[expert] = layout.join_slices(pieces, sizes[name], what)
        experts[name] = ExpertTensors(layout, per_expert)
    unrecorded = any(state is not None and recorded_placement(state, prefix) is None for state in states)
    if placement.sharded_count == 1:
        _warn_identical_experts(experts, prefix, unrecorded)
    return experts


def stored_for_rank(param: ExpertTensors, what: str, placement: Placement, rank: int) -> torch.Tensor:
    """What process `rank` of `placement` stores for one expert parameter."""
    pieces = placement.pieces(rank)
    if placement.sharded_count == 1:
        return param.layout.stack_experts([param.experts[expert] for expert, _ in pieces]).contiguous()
    expert, piece = pieces[0]
    return param.layout.cut_slice(param.experts[expert], placement.sharded_count, piece, what).contiguous()


def global_experts(state: State, prefix: str, num_experts: int) -> Dict[str, ExpertTensors]:
    """Whole experts of one layer of a global-form state (all experts on one process)."""
    record = recorded_placement(state, prefix)
    if record is not None and record[1] != 1:
        raise ValueError(f"MoE layer {layer_name(prefix)} of this checkpoint was saved by rank {record[0]} of {record[1]} "
                         f"processes: it is one process's share, not a gathered checkpoint (use "
                         f"tutel.checkpoint.gather or load_resharded)")
    experts = {}
    for name in expert_names(state, prefix):
        key = prefix + EXPERTS + name
        value = state[key]
        layout = layout_of(name, value)
        try:
            split = layout.split_experts(value, num_experts, f"`{key}`")
        except ShapeError as error:
            raise ShapeError(f"{error}: a gathered checkpoint holds all {num_experts} experts of the layer (is "
                             f"this one process's file?)") from None
        experts[name] = ExpertTensors(layout, dict(enumerate(split)))
    return experts


# ----------------------------------------------------------------------------- whole state dicts


def check_shared_params(states: Sequence[Optional[State]], labels: Sequence[str], layers: Mapping[str, int]) -> int:
    """Checks that every file has the same keys and warns about non-expert values that differ
    between files (the first file's are kept).  Returns the index of the first present file."""
    present = [i for i, state in enumerate(states) if state is not None]
    if not present:
        raise ValueError("no checkpoint file was found")
    first = present[0]
    keys = set(states[first])
    differing = []
    for index in present[1:]:
        other = set(states[index])
        if other != keys:
            extra, lacking = sorted(other - keys)[:5], sorted(keys - other)[:5]
            raise ValueError(f"{labels[index]} and {labels[first]} hold different keys (only in {labels[index]}: "
                             f"{extra}; only in {labels[first]}: {lacking})")
        for key in keys:
            if is_expert_key(key, layers):
                continue
            a, b = states[first][key], states[index][key]
            if isinstance(a, torch.Tensor) and not (isinstance(b, torch.Tensor) and a.shape == b.shape
                                                    and a.dtype == b.dtype and torch.equal(a, b)):
                differing.append((key, labels[index]))
    if differing:
        listed = ", ".join(f"`{key}` ({label})" for key, label in differing[:8])
        logger.warning("%d parameter(s) outside the experts differ between the files; keeping %s's values. "
                       "They should be equal on every process: %s%s", len(differing), labels[first], listed,
                       " ..." if len(differing) > 8 else "")
    return first


def gather_state_dicts(states: Sequence[Optional[State]], labels: Optional[Sequence[str]] = None,
                       default_num_global_experts: Optional[int] = None):
    """The global form of the per-rank state dicts `states` (index = rank; None = a missing file).

    Checks that every global expert is present exactly once (``ExpertCoverageError`` names the
    missing and duplicated experts), that all files hold the same keys and shapes, and warns
    when parameters outside the experts differ between files (rank 0's are kept).

    Args:
        states: the N per-rank state dicts.
        labels: how errors name each state (default 'rank r').
        default_num_global_experts: expert count of legacy checkpoints without
            ``_num_global_experts`` (the key is added to the result).
    Returns:
        an OrderedDict like a single process holding all experts would save.
    """
    labels = list(labels) if labels is not None else [f"rank {r}" for r in range(len(states))]
    first_present = next((s for s in states if s is not None), None)
    if first_present is None:
        raise ValueError(f"no checkpoint file was found (looked for {', '.join(labels)})")
    layers = find_moe_layers(first_present, default_num_global_experts)
    for index, state in enumerate(states):
        if state is not None and find_moe_layers(state, default_num_global_experts) != layers:
            raise ValueError(f"{labels[index]} has other MoE layers or expert counts than {labels[0]}: "
                             f"{find_moe_layers(state, default_num_global_experts)} vs {layers}")
    first = check_shared_params(states, labels, layers)
    experts = {prefix: whole_experts(states, labels, prefix, count) for prefix, count in layers.items()}
    one = {prefix: Placement(count, 1) for prefix, count in layers.items()}
    result = new_state(states[first])
    for key, value in states[first].items():
        prefix = next((p for p in layers if key.startswith(p + EXPERTS)), None)
        if prefix is None:
            result[key] = value
        else:
            result[key] = stored_for_rank(experts[prefix][key[len(prefix + EXPERTS):]], f"`{key}`", one[prefix], 0)
    for prefix, count in layers.items():
        result.setdefault(prefix + COUNT_SUFFIX, torch.tensor(count))
    set_placement(result, layers, 0, 1)
    return result


def scatter_state_dict(state: State, world_size: int) -> List["collections.OrderedDict"]:
    """The per-rank state dicts of `world_size` processes from a global-form `state`.

    Works for any world size that divides the expert count or is a multiple of it (then
    processes share experts: ffn weights are cut along the hidden dim, which must divide
    evenly; biases and flat llama_ffn weights are zero-padded like the layer pads them)."""
    layers = find_moe_layers(state)
    placements = {prefix: Placement(count, world_size) for prefix, count in layers.items()}
    experts = {prefix: global_experts(state, prefix, count) for prefix, count in layers.items()}
    results = []
    for rank in range(world_size):
        result = new_state(state)
        for key, value in state.items():
            prefix = next((p for p in layers if key.startswith(p + EXPERTS)), None)
            if prefix is None:
                result[key] = value
            else:
                result[key] = stored_for_rank(experts[prefix][key[len(prefix + EXPERTS):]], f"`{key}`",
                                              placements[prefix], rank)
        set_placement(result, layers, rank, world_size)
        results.append(result)
    return results


def reshard_state_dicts(states: Sequence[Optional[State]], world_size: int,
                        labels: Optional[Sequence[str]] = None) -> List["collections.OrderedDict"]:
    """Per-rank state dicts of N processes -> those of `world_size` processes (via the global form)."""
    return scatter_state_dict(gather_state_dicts(states, labels), world_size)


"""Checkpoint resharding in one process: every N -> M conversion is exact and matches what the
layers of world size M hold; the expert coverage check; loading refuses what does not fit."""
import collections
import logging

import pytest
import torch

from checkpoint_models import LAYERS, build_model, mismatches, outputs, tokens
from tutel import checkpoint, moe

WORLD_SIZES = (1, 2, 4, 8)


def _equal(a, b):
    assert list(a) == list(b)
    different = [k for k in a if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]))]
    assert not different, different


@pytest.fixture(scope="module")
def original():
    model = build_model(1)
    return model, model.state_dict()


@pytest.mark.parametrize("saved", WORLD_SIZES)
def test_every_world_size_to_every_other_is_exact(original, saved):
    _, state = original
    parts = checkpoint.scatter_state_dict(state, saved)
    assert len(parts) == saved
    for target in WORLD_SIZES:
        _equal_lists(checkpoint.reshard_state_dicts(parts, target), checkpoint.scatter_state_dict(state, target))
    _equal(checkpoint.gather_state_dicts(parts), state)


def _equal_lists(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        _equal(x, y)


def test_scattered_shapes_are_what_the_layers_hold(original):
    _, state = original
    for world in (2, 4, 8):
        expected_shapes = {}
        for name, (count, experts) in LAYERS.items():
            share = world // count if world > count else 1
            local = count // world if world <= count else 1
            hidden, out = experts["hidden_size_per_expert"], experts.get("output_dim", 6)
            if experts["type"] == "ffn":
                expected_shapes[f"{name}.experts.batched_fc1_w"] = (local, hidden // share, 6)
                if experts.get("has_fc2_bias", True):
                    expected_shapes[f"{name}.experts.batched_fc2_bias"] = (local, -(-out // share))
            else:
                expected_shapes[f"{name}.experts.W_fc3"] = (-(-local * hidden * 6 // share),)
        part = checkpoint.scatter_state_dict(state, world)[world - 1]
        for key, shape in expected_shapes.items():
            assert tuple(part[key].shape) == shape, (world, key)


def test_gathered_checkpoint_loads_and_computes_the_same(original):
    model, state = original
    parts = [collections.OrderedDict(part) for part in checkpoint.scatter_state_dict(state, 4)]  # no records
    resumed = build_model(1, seed=5)
    resumed.load_state_dict(checkpoint.gather_state_dicts(parts))
    assert not mismatches(outputs(resumed, tokens()), outputs(model, tokens()))


def test_dtypes_are_kept_exactly():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=6,
                          experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8})
    state = layer.to(torch.bfloat16).state_dict()
    parts = checkpoint.scatter_state_dict(state, 4)
    assert parts[1]["experts.batched_fc1_w"].dtype == torch.bfloat16
    _equal(checkpoint.gather_state_dicts(parts), state)


# ------------------------------------------------------------------ the expert coverage check


def _two_files():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=6,
                          experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 8})
    return checkpoint.scatter_state_dict(layer.state_dict(), 2)


def test_coverage_names_a_missing_expert():
    parts = _two_files()
    with pytest.raises(checkpoint.ExpertCoverageError, match=r"missing: expert 2 \(rank 1's share, b.pt\), expert 3"):
        checkpoint.gather_state_dicts([parts[0], None], labels=["a.pt", "b.pt"])


def test_coverage_names_a_duplicated_expert():
    parts = _two_files()
    with pytest.raises(checkpoint.ExpertCoverageError) as raised:
        checkpoint.gather_state_dicts([parts[0], parts[0]], labels=["a.pt", "b.pt"])
    message = str(raised.value)
    assert "duplicated: expert 0 (in a.pt and b.pt), expert 1 (in a.pt and b.pt)" in message
    assert "missing: expert 2" in message


def test_coverage_of_shared_expert_slices():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=6,
                          experts={"type": "ffn", "num_experts_per_device": 2, "hidden_size_per_expert": 8})
    parts = checkpoint.scatter_state_dict(layer.state_dict(), 4)  # 2 processes per expert
    with pytest.raises(checkpoint.ExpertCoverageError, match=r"missing: expert 1 \(slice 2/2\) \(rank 3's share\)"):
        checkpoint.gather_state_dicts(parts[:3] + [None])


def test_files_from_another_world_size_are_named():
    parts = _two_files()
    with pytest.raises(checkpoint.ExpertCoverageError, match="saved by rank 0 of 2 processes, but 4 files"):
        checkpoint.gather_state_dicts(parts + parts)


def test_unrecorded_copies_of_a_file_are_reported(caplog):
    parts = [collections.OrderedDict(part) for part in _two_files()]  # Tutel files: placed by position
    with caplog.at_level(logging.WARNING, logger="tutel"):
        checkpoint.gather_state_dicts([parts[0], parts[0]])
    assert "experts 0 and 2 are bit-identical" in caplog.text


def test_shared_parameters_that_differ_are_reported_and_rank_0_kept(caplog):
    parts = _two_files()
    parts[1]["gates.0.wg.weight"] = parts[1]["gates.0.wg.weight"] + 1
    with caplog.at_level(logging.WARNING, logger="tutel"):
        merged = checkpoint.gather_state_dicts(parts)
    assert "`gates.0.wg.weight` (rank 1)" in caplog.text
    assert torch.equal(merged["gates.0.wg.weight"], parts[0]["gates.0.wg.weight"])


def test_files_with_other_keys_or_shapes_fail():
    parts = _two_files()
    del parts[1]["gates.0.wg.weight"]
    with pytest.raises(ValueError, match="hold different keys"):
        checkpoint.gather_state_dicts(parts)
    parts = _two_files()
    parts[1]["experts.batched_fc1_w"] = torch.zeros(2, 4, 6)
    with pytest.raises(ValueError, match=r"`experts.batched_fc1_w` has shape \(2, 4, 6\) in rank 1 but \(2, 8, 6\)"):
        checkpoint.gather_state_dicts(parts)


# ------------------------------------------------------------------ invalid conversions


def test_invalid_world_sizes_and_inputs_fail_clearly():
    layer = moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=6,
                          experts={"type": "ffn", "num_experts_per_device": 4, "hidden_size_per_expert": 6})
    state = layer.state_dict()
    with pytest.raises(ValueError, match="4 experts cannot be placed on 3 processes"):
        checkpoint.scatter_state_dict(state, 3)
    with pytest.raises(ValueError, match="6 rows of shape \\(6, 6\\) cannot be split evenly over 4"):
        checkpoint.scatter_state_dict(state, 16)
    with pytest.raises(ValueError, match="saved by rank 1 of 2 processes: it is one process's share"):
        checkpoint.scatter_state_dict(checkpoint.scatter_state_dict(state, 2)[1], 2)
    with pytest.raises(ValueError, match="should hold 4 expert"):
        checkpoint.scatter_state_dict(collections.OrderedDict(checkpoint.scatter_state_dict(state, 2)[1]), 2)


def test_legacy_checkpoints_need_the_expert_count():
    parts = [collections.OrderedDict((k, v) for k, v in part.items() if not k.endswith("_num_global_experts"))
             for part in _two_files()]
    with pytest.raises(ValueError, match="--default_num_global_experts"):
        checkpoint.gather_state_dicts(parts)
    merged = checkpoint.gather_state_dicts(parts, default_num_global_experts=4)
    assert int(merged["_num_global_experts"]) == 4 and merged["experts.batched_fc1_w"].shape == (4, 8, 6)


def test_llama_slices_need_the_model_to_tell_an_ambiguous_size(tmp_path):
    layer = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=6,
                          experts={"type": "llama_ffn", "num_experts_per_device": 1, "hidden_size_per_expert": 7})
    state = layer.state_dict()
    parts = checkpoint.scatter_state_dict(state, 8)  # 42 values in 8 slices of 6: 42 or 48?
    with pytest.raises(ValueError, match=r"any of \[42, 48\] values"):
        checkpoint.gather_state_dicts(parts)
    for rank, part in enumerate(parts):
        torch.save(part, tmp_path / f"r{rank}.pt")
    resumed = moe.moe_layer(gate_type={"type": "top", "k": 1}, model_dim=6,
                            experts={"type": "llama_ffn", "num_experts_per_device": 1, "hidden_size_per_expert": 7})
    checkpoint.load_resharded(resumed, str(tmp_path / "r{rank}.pt"), saved_world_size=8)
    _equal(resumed.state_dict(), state)


# ------------------------------------------------------------------ loading into a layer


def _layer(count=4, **experts):
    return moe.moe_layer(gate_type={"type": "top", "k": 2}, model_dim=6,
                         experts={"type": "ffn", "num_experts_per_device": count, "hidden_size_per_expert": 8, **experts})


def test_loading_a_wrong_shape_names_the_parameter_and_shapes():
    state = _layer().state_dict()
    state["experts.batched_fc1_w"] = torch.zeros(3, 8, 6)
    with pytest.raises(ValueError, match=r"`experts.batched_fc1_w`: checkpoint shape \(3, 8, 6\) \(144 elements\) "
                                         r"does not fit the layer's shape \(4, 8, 6\)"):
        _layer().load_state_dict(state)


def test_loading_another_expert_count_fails():
    with pytest.raises(ValueError, match="number of global experts mismatch"):
        _layer(2).load_state_dict(_layer(4).state_dict())


def test_loading_another_world_sizes_file_points_to_load_resharded():
    part = checkpoint.scatter_state_dict(_layer().state_dict(), 2)[0]
    with pytest.raises(ValueError, match="saved by rank 0 of 2 processes and this layer runs on 1.*load_resharded"):
        _layer().load_state_dict(part)


def test_tutel_reshaped_tensors_and_legacy_files_still_load(caplog):
    source = _layer()
    state = collections.OrderedDict((k, v.reshape(v.shape[0], -1) if k.endswith("fc1_w") else v)
                                    for k, v in source.state_dict().items())
    target = _layer()
    target.load_state_dict(state)  # same number of elements: viewed, as Tutel did
    _equal(target.state_dict(), source.state_dict())
    del state["_num_global_experts"]
    with caplog.at_level(logging.WARNING, logger="tutel"):
        _layer().load_state_dict(state)
    assert "legacy format" in caplog.text


def test_load_resharded_reports_missing_files_and_other_expert_counts(tmp_path):
    for rank, part in enumerate(checkpoint.scatter_state_dict(_layer().state_dict(), 2)):
        torch.save(part, tmp_path / f"r{rank}.pt")
    with pytest.raises(FileNotFoundError, match="r2.pt, .*r3.pt"):
        checkpoint.load_resharded(_layer(), str(tmp_path / "r{rank}.pt"), saved_world_size=4)
    with pytest.raises(ValueError, match="has 2 global experts but the checkpoint has 4"):
        checkpoint.load_resharded(_layer(2), str(tmp_path / "r{rank}.pt"), saved_world_size=2)
    with pytest.raises(ValueError, match="has no `{rank}`"):
        checkpoint.load_resharded(_layer(), str(tmp_path / "r0.pt"), saved_world_size=2)

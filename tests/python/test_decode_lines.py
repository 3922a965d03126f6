"""tutel.ops.decode_lines: the measured lines between the decode kernel and the grouped path.

The file tutel ships is well formed; a malformed one is refused with the file and the entry named;
writing and reading give the same lines back; and decode_experts_supported follows the line in
effect for the device's capability and the dtype, on fake CUDA tensors (the path a GPU takes).
"""
import json

import pytest
import torch

import tutel.ops.decode_lines as decode_lines
from tutel.ops.decode_experts import DECODE_MAX_CHOICES, DECODE_MAX_TOKENS, decode_experts_supported
from tutel.ops.decode_lines import DecodeLine, lines_in_effect, merge_lines, read_lines, write_lines

from launch_count import fake_cuda


def _line(rows, capability="9.0", dtype="bfloat16", device_name="a GPU"):
    return DecodeLine(capability=capability, dtype=dtype, max_rows_per_expert=rows, device_name=device_name,
                      source="decode_line_cuda.json, finished then: python benchmarks/decode_line.py")


def test_the_shipped_lines_file_is_well_formed():
    table = read_lines()
    for (capability, dtype), line in table.items():
        major, minor = capability.split(".")
        assert major.isdigit() and minor.isdigit() and isinstance(getattr(torch, dtype), torch.dtype)
        assert line.source.startswith("benchmarks/results/decode_line_") and line.device_name


def test_written_lines_read_back_the_same_sorted(tmp_path):
    path = str(tmp_path / "lines.json")
    lines = [_line(4.0, "9.0", "float16"), _line(None, "8.0"), _line(0.5, "9.0", "bfloat16"), _line(0, "9.0", "float32")]
    write_lines(lines, path)
    table = read_lines(path)
    assert list(table) == [("8.0", "bfloat16"), ("9.0", "bfloat16"), ("9.0", "float16"), ("9.0", "float32")]
    assert table[("9.0", "float16")] == lines[0] and table[("8.0", "bfloat16")].max_rows_per_expert is None
    assert table[("9.0", "float32")].max_rows_per_expert == 0.0
    with open(path) as handle:
        assert "about" in json.load(handle)


def test_merging_replaces_the_line_of_the_same_device_and_dtype_only():
    table = {(line.capability, line.dtype): line for line in (_line(1.0), _line(2.0, "8.0"))}
    merged = merge_lines(table, [_line(3.0), _line(None, dtype="float16")])
    assert {key: line.max_rows_per_expert for key, line in merged.items()} == {
        ("9.0", "bfloat16"): 3.0, ("8.0", "bfloat16"): 2.0, ("9.0", "float16"): None}
    assert table[("9.0", "bfloat16")].max_rows_per_expert == 1.0  # the table given is left as it was


@pytest.mark.parametrize("change, message", [
    (lambda entry: entry.pop("source"), "exactly the fields"),
    (lambda entry: entry.update(extra=1), "exactly the fields"),
    (lambda entry: entry.update(max_rows_per_expert=-1.0), "max_rows_per_expert"),
    (lambda entry: entry.update(max_rows_per_expert=True), "max_rows_per_expert"),
    (lambda entry: entry.update(max_rows_per_expert="2"), "max_rows_per_expert"),
    (lambda entry: entry.update(max_rows_per_expert=float("inf")), "max_rows_per_expert"),
    (lambda entry: entry.update(dtype="bf16"), "`dtype` must name a torch dtype"),
    (lambda entry: entry.update(dtype="Tensor"), "`dtype` must name a torch dtype"),
    (lambda entry: entry.update(capability=""), "`capability` must be a non-empty string"),
    (lambda entry: entry.update(device_name=3), "`device_name` must be a non-empty string"),
])
def test_a_malformed_entry_is_refused_naming_the_file_and_entry(tmp_path, change, message):
    entry = _line(1.0)._asdict()
    change(entry)
    path = tmp_path / "lines.json"
    path.write_text(json.dumps({"lines": [_line(2.0, dtype="float16")._asdict(), entry]}))
    with pytest.raises(ValueError, match=rf"lines\.json: lines\[1\]: .*{message}"):
        read_lines(str(path))


@pytest.mark.parametrize("payload", [[], {"lines": {}}, {"about": "no lines"}])
def test_a_file_without_a_lines_list_is_refused(tmp_path, payload):
    path = tmp_path / "lines.json"
    path.write_text(json.dumps(payload))
    with pytest.raises(ValueError, match="lines.json: must be an object with a `lines` list"):
        read_lines(str(path))


def test_a_second_line_for_one_device_and_dtype_is_refused(tmp_path):
    path = tmp_path / "lines.json"
    path.write_text(json.dumps({"lines": [_line(1.0)._asdict(), _line(2.0, device_name="another")._asdict()]}))
    with pytest.raises(ValueError, match=r"lines\[1\]: a second line for capability 9.0 and dtype bfloat16"):
        read_lines(str(path))


def test_the_capability_is_the_one_the_cuda_path_takes():
    """Not CUDA: none.  Fake CUDA tensors on a PyTorch without CUDA stand for the device the
    backend says they do (tutel.ops.backend.FAKE_CUDA_CAPABILITY, a Hopper GPU); outside a fake
    mode there is none to ask."""
    assert decode_lines.device_capability("cpu") is None
    if not torch.cuda.is_available():
        assert decode_lines.device_capability("cuda") is None
        with fake_cuda():
            assert decode_lines.device_capability("cuda") == "9.0"
            with lines_in_effect([_line(0.0)]):  # so a trace here takes that device's line
                assert not decode_experts_supported(1, 8, torch.bfloat16, "cuda", experts=128)


@pytest.fixture
def on_capability_9_0(monkeypatch):
    """Every CUDA device reports compute capability 9.0, a real GPU running the tests included (the
    fake CUDA devices of a CPU build stand for 9.0 already)."""
    monkeypatch.setattr(decode_lines, "device_capability",
                        lambda device: "9.0" if torch.device(device).type == "cuda" else None)


@pytest.mark.parametrize("rows, experts, k, last_decode_tokens", [
    (1.0, 128, 8, 16),   # Qwen3-30B-A3B's shape: 16 tokens fill 128 experts once each
    (0.5, 128, 8, 8),
    (4.0, 8, 2, 16),     # Mixtral's
    (2.5, 8, 2, 10),     # a line between two token counts: the last count within it
    (0.0, 8, 2, 0),      # the grouped path wins everywhere measured: only empty calls stay
    (None, 8, 2, DECODE_MAX_TOKENS),  # no bound: the kernel's own limits
    (100.0, 128, 16, DECODE_MAX_CHOICES // 16),  # the kernel's limits still hold past a generous line
])
def test_the_kernel_is_chosen_up_to_the_measured_line(on_capability_9_0, rows, experts, k, last_decode_tokens):
    with fake_cuda(), lines_in_effect([_line(rows)]):
        chosen = [t for t in range(DECODE_MAX_TOKENS + 2)
                  if decode_experts_supported(t, k, torch.bfloat16, "cuda", experts=experts)]
    assert chosen == list(range(last_decode_tokens + 1))


def test_a_line_applies_to_its_own_device_and_dtype_only(on_capability_9_0):
    others = [_line(0.0, capability="8.0"), _line(0.0, dtype="float16")]
    with fake_cuda(), lines_in_effect([_line(0.5)] + others):
        assert not decode_experts_supported(16, 8, torch.bfloat16, "cuda", experts=128)  # 1.0 rows > 0.5
        assert decode_experts_supported(8, 8, torch.bfloat16, "cuda", experts=128)
        assert decode_experts_supported(16, 8, torch.float32, "cuda", experts=128)  # no float32 line
        assert not decode_experts_supported(1, 8, torch.float16, "cuda", experts=128)  # its own line: 0
        # A caller that does not know the expert count gets the kernel's limits alone.
        assert decode_experts_supported(16, 8, torch.bfloat16, "cuda")
        assert not decode_experts_supported(16, 8, torch.bfloat16, "cpu", experts=128)


def test_without_a_capability_the_kernels_limits_alone_apply(monkeypatch):
    monkeypatch.setattr(decode_lines, "device_capability", lambda device: None)  # a device with no capability known
    with fake_cuda(), lines_in_effect([_line(0.0)]):
        assert decode_experts_supported(DECODE_MAX_TOKENS, 8, torch.bfloat16, "cuda", experts=128)


def test_lines_in_effect_restores_the_lines_before_it():
    before = decode_lines._lines_override
    with pytest.raises(RuntimeError, match="inside"):
        with lines_in_effect([_line(1.0)]):
            with lines_in_effect([]):
                assert decode_lines._lines_override == {}
            assert list(decode_lines._lines_override) == [("9.0", "bfloat16")]
            raise RuntimeError("inside")
    assert decode_lines._lines_override is before

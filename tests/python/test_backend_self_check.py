"""The per-device backend choice and its self-check, exercised on the CPU: the CPU
operators stand in for the CUDA kernels, and wrong results are injected into them.
A disagreement or failure warns once, naming the kernel and the device, and that
operator falls back to the composite one; the environment variables force a backend
or turn the check off."""
import warnings
from types import SimpleNamespace

import pytest
import torch

from tutel.ops import backend, composite
from tutel.ops.backend import COMPOSITE, KERNELS, DeviceBackends
from tutel.ops.self_check import OPERATORS, compare_operators

native = torch.ops.tutel
CPU = torch.device("cpu")
ROUNDED_SUMS = ("expert_row_sums", "grouped_rows_linear", "grouped_rows_linear_backward", "decode_experts",
                "decode_quantized_experts", "quantized_grouped_linear")


@pytest.fixture(autouse=True)
def _default_environment(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_VARIABLE, raising=False)
    monkeypatch.delenv(backend.SELF_CHECK_VARIABLE, raising=False)


def perturbed(operator: str, how: str = "first output"):
    """The CPU operators, except that `operator` returns a wrong result: its first output
    moved by one unit (the next float, or +1), or, with how="dots", its dot products by 1%.  An
    operator that writes its first argument in place has that argument moved; the row sums, the
    grouped products and decode_experts' sums, which are compared to rounding, are moved by 5%."""
    def wrong(*args):
        outputs = getattr(native, operator)(*args)
        if outputs is None:  # in place: the written argument is the result
            args[0].copy_(torch.nextafter(args[0], torch.full_like(args[0], float("inf"))))
            return None
        outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        number = 1 if how == "dots" else 0
        value = outputs[number]
        if how == "dots":
            value = value * 1.01 + 1e-3
        elif operator in ROUNDED_SUMS:
            value = value * 1.05 + 0.05
        elif value.is_floating_point():
            value = torch.nextafter(value, torch.full_like(value, float("inf")))
        else:
            value = value + 1
        outputs[number] = value
        return tuple(outputs) if len(outputs) > 1 else outputs[0]

    return SimpleNamespace(**{**{name: getattr(native, name) for name in OPERATORS}, operator: wrong})


def choose(kernels, **kwargs):
    """A fresh chooser and its operators for the CPU device, with the warnings it gave."""
    chooser = DeviceBackends(kernels, kernels_unavailable=kwargs.pop("kernels_unavailable", lambda: None), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = chooser.operators(CPU)
    return chooser, chosen, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_agreeing_kernels_are_used_without_a_warning():
    chooser, chosen, warned = choose(native)
    assert warned == []
    for name in OPERATORS:
        assert getattr(chosen, name) is getattr(native, name)
        assert chooser.choices()["cpu"][name] == (KERNELS, "self-check passed")


def test_the_comparison_passes_for_the_cpu_operators_against_the_composite_ones():
    assert compare_operators(native, composite, CPU) == {name: None for name in OPERATORS}


def test_the_reference_products_are_exact_whatever_the_caller_set():
    """The composite grouped products are the reference: they run at float32's full precision during
    the comparison, with the caller's matmul settings back afterwards."""
    matmul = torch.backends.cuda.matmul
    saved = (torch.get_float32_matmul_precision(), matmul.allow_fp16_reduced_precision_reduction)
    seen = []

    class Recording(SimpleNamespace):
        def grouped_rows_linear(self, *args):
            seen.append((torch.get_float32_matmul_precision(), matmul.allow_fp16_reduced_precision_reduction))
            return composite.grouped_rows_linear(*args)

    reference = Recording(**{name: getattr(composite, name) for name in OPERATORS if name != "grouped_rows_linear"})
    try:
        torch.set_float32_matmul_precision("medium")
        matmul.allow_fp16_reduced_precision_reduction = True
        assert compare_operators(native, reference, CPU, operators=["grouped_rows_linear"]) == \
            {"grouped_rows_linear": None}
        assert seen and set(seen) == {("highest", False)}
        assert (torch.get_float32_matmul_precision(), matmul.allow_fp16_reduced_precision_reduction) == \
            ("medium", True)
    finally:
        torch.set_float32_matmul_precision(saved[0])
        matmul.allow_fp16_reduced_precision_reduction = saved[1]


@pytest.mark.parametrize("operator", OPERATORS)
def test_a_wrong_kernel_warns_once_naming_it_and_the_device_and_falls_back(operator):
    kernels = perturbed(operator)
    chooser, chosen, warned = choose(kernels)
    assert len(warned) == 1
    message = str(warned[0].message)
    assert f"kernel of {operator} disagreed" in message and "on cpu" in message
    assert "python -m tutel.check" in message
    assert getattr(chosen, operator) is getattr(composite, operator)
    for other in OPERATORS:
        if other != operator:
            assert getattr(chosen, other) is getattr(native, other)
    assert chooser.choices()["cpu"][operator].implementation == COMPOSITE
    assert "self-check failed" in chooser.choices()["cpu"][operator].reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second use of the device neither checks nor warns again
        assert chooser.operators(CPU) is chosen


@pytest.mark.parametrize("operator", ["gather_slots", "scatter_slots"])
def test_wrong_dot_products_are_found(operator):
    _, chosen, warned = choose(perturbed(operator, how="dots"))
    assert len(warned) == 1 and "dot products differ" in str(warned[0].message)
    assert getattr(chosen, operator) is getattr(composite, operator)


def test_several_wrong_kernels_give_one_warning_naming_each():
    kernels = perturbed("route_topk")
    kernels.cumsum_sub_one = perturbed("cumsum_sub_one").cumsum_sub_one
    _, chosen, warned = choose(kernels)
    assert len(warned) == 1
    assert "kernels of route_topk, cumsum_sub_one disagreed" in str(warned[0].message)
    assert chosen.route_topk is composite.route_topk and chosen.cumsum_sub_one is composite.cumsum_sub_one


def test_a_kernel_that_raises_is_replaced():
    def no_image(*args):
        raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU: no kernel image is available")

    kernels = SimpleNamespace(**{name: getattr(native, name) for name in OPERATORS})
    kernels.gather_slots = no_image
    _, chosen, warned = choose(kernels)
    assert len(warned) == 1 and "raised RuntimeError: CUDA_ERROR_NO_BINARY_FOR_GPU" in str(warned[0].message)
    assert chosen.gather_slots is composite.gather_slots


def test_kernels_that_cannot_load_are_replaced_without_running_them():
    def never(*args, **kwargs):
        raise AssertionError("the self-check must not run")

    chooser, chosen, warned = choose(native, kernels_unavailable=lambda: "NVRTC cannot be loaded: not found",
                                     check=never)
    assert len(warned) == 1
    assert "cannot be used on cpu (NVRTC cannot be loaded: not found)" in str(warned[0].message)
    assert all(getattr(chosen, name) is getattr(composite, name) for name in OPERATORS)


def test_the_environment_turns_the_check_off(monkeypatch):
    monkeypatch.setenv(backend.SELF_CHECK_VARIABLE, "0")
    kernels = perturbed("scatter_slots")
    chooser, chosen, warned = choose(kernels)
    assert warned == []
    assert chosen.scatter_slots is kernels.scatter_slots  # unchecked: the wrong one is used
    assert chooser.choices()["cpu"]["scatter_slots"].implementation == KERNELS


@pytest.mark.parametrize("value,expected", [("composite", COMPOSITE), ("nvrtc", KERNELS), ("NVRTC", KERNELS)])
def test_the_environment_forces_a_backend_without_a_check(monkeypatch, value, expected):
    monkeypatch.setenv(backend.BACKEND_VARIABLE, value)
    kernels = perturbed("route_topk")
    chooser, chosen, warned = choose(kernels)
    assert warned == []
    for name in OPERATORS:
        assert chooser.choices()["cpu"][name].implementation == expected
    assert chosen.route_topk is (composite.route_topk if expected == COMPOSITE else kernels.route_topk)


def test_a_bad_backend_name_is_rejected(monkeypatch):
    monkeypatch.setenv(backend.BACKEND_VARIABLE, "cuda")
    with pytest.raises(ValueError, match="TUTEL_CUDA_BACKEND='cuda' is not allowed; use one of auto, nvrtc, composite"):
        DeviceBackends(native, kernels_unavailable=lambda: None).operators(CPU)


def test_forget_makes_the_next_use_choose_again():
    chooser, _, _ = choose(perturbed("assign_locations"))
    chooser.forget()
    assert chooser.choices() == {}
    with pytest.warns(RuntimeWarning, match="assign_locations"):
        chooser.operators(CPU)


def test_cpu_tensors_use_the_compiled_cpu_operators_and_other_devices_the_composite_ones():
    assert backend.operators_for(CPU) is native
    assert backend.operators_for(torch.device("meta")) is native  # the shape functions
    assert backend.operators_for(torch.device("mps")) is composite
    assert backend.operators_for(torch.device("xpu", 1)) is composite


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_real_kernels_pass_the_self_check():
    backend.CUDA_BACKENDS.forget()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        chosen = backend.operators_for(torch.device("cuda", 0))
    assert all(getattr(chosen, name) is getattr(native, name) for name in OPERATORS)


def test_the_self_check_leaves_the_random_state_alone():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    compare_operators(native, composite, CPU)
    assert torch.equal(torch.rand(3), expected)


def test_cuda_devices_without_usable_kernels_get_the_composite_operators(monkeypatch):
    """The real availability check and the real CUDA chooser; no tensor is put on the device."""
    import tutel.cuda

    reason = backend.cuda_kernels_unavailable()
    if tutel.cuda.is_built():
        assert reason is None or reason.startswith("NVRTC cannot be loaded: ")
        return
    assert reason == "tutel was built without CUDA support"
    monkeypatch.setattr(backend, "CUDA_BACKENDS", DeviceBackends(native))
    with pytest.warns(RuntimeWarning, match=r"cannot be used on cuda:0 \(tutel was built without CUDA support\)"):
        chosen = backend.operators_for(torch.device("cuda", 0))
    assert all(getattr(chosen, name) is getattr(composite, name) for name in OPERATORS)
    assert tutel.cuda.operator_backends() == {
        "cuda:0": {name: (COMPOSITE, "tutel was built without CUDA support") for name in OPERATORS}}


@pytest.mark.parametrize("value", ["composite", "nvrtc"])
def test_the_environment_variable_reaches_the_cuda_chooser(monkeypatch, value):
    monkeypatch.setattr(backend, "CUDA_BACKENDS", DeviceBackends(native))
    monkeypatch.setenv(backend.BACKEND_VARIABLE, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = backend.operators_for(torch.device("cuda", 1))
    implementation = composite if value == "composite" else native
    assert all(getattr(chosen, name) is getattr(implementation, name) for name in OPERATORS)


@pytest.mark.parametrize("value,expected", [(None, "kernels"), ("composite", "composite")])
def test_while_tracing_nothing_is_checked_or_kept(monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv(backend.BACKEND_VARIABLE, value)
    monkeypatch.setattr(backend, "is_compiling", lambda: True)
    kernels = perturbed("gather_slots")
    chooser = DeviceBackends(kernels, kernels_unavailable=lambda: None)
    assert chooser.operators(CPU) is (kernels if expected == "kernels" else composite)
    assert chooser.choices() == {}
    monkeypatch.setattr(backend, "is_compiling", lambda: False)
    with pytest.warns(RuntimeWarning, match="gather_slots") if value is None else warnings.catch_warnings():
        chooser.operators(CPU)  # the first eager call chooses
    assert "cpu" in chooser.choices()

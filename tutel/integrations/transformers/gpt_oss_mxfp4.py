"""gpt-oss' experts held as packed MXFP4 and run by tutel: ``use_mxfp4_experts(model, ...)``.

gpt-oss checkpoints store each decoder layer's experts as MXFP4 (OCP MX v1.0: E2M1 codes, one E8M0
scale per 32 elements) with float32 biases::

    model.layers.{i}.mlp.experts.gate_up_proj_blocks  (E, 2I, H / 32, 16) uint8  gate and up rows interleaved
    model.layers.{i}.mlp.experts.gate_up_proj_scales  (E, 2I, H / 32)     uint8
    model.layers.{i}.mlp.experts.gate_up_proj_bias    (E, 2I)             float32
    model.layers.{i}.mlp.experts.down_proj_blocks     (E, H, I / 32, 16)  uint8
    model.layers.{i}.mlp.experts.down_proj_scales     (E, H, I / 32)      uint8
    model.layers.{i}.mlp.experts.down_proj_bias       (E, H)              float32

and their unit is a clamped SwiGLU, h = (clamp(u, -7, 7) + 1) * g' * sigmoid(1.702 g'), g' = min(g, 7).
transformers keeps those bytes only where its Triton kernels run (``Mxfp4GptOssExperts``, in a
swizzled layout of the kernels' own); elsewhere, a CPU above all, it dequantizes them to bfloat16
at load (``GptOssExperts``), four times the bytes.

``use_mxfp4_experts`` replaces every gpt-oss experts module of a model by ``TutelGptOssMxfp4Experts``:
the packed bytes, scales and biases as buffers under the checkpoint's own names (so
``model.state_dict()`` holds them, and ``save_pretrained`` writes what the checkpoint holds),
nothing else, and a forward that runs ``tutel.experts.routed_quantized_experts``: tutel's
decode_quantized_experts operator at decoding sizes, its quantized_grouped_linear products over the
rows grouped by expert otherwise, float32 accumulation.  The packed weights come
from the checkpoint's tensors (``expert_tensors``), from transformers' ``Mxfp4GptOssExperts`` of a
model loaded quantized (on a GPU), or, with ``quantize=True``, from the float experts quantized
again (lossy: see ``use_mxfp4_experts``).

The experts run on the CPU and on CUDA (``model.to(device)`` moves the buffers), where nothing is
read back to the host.  Inference only.
"""
from collections.abc import Mapping
from typing import Dict, List, Optional, Tuple

import torch

from ...experts.quantized import routed_quantized_experts
from ...ops.gated_units import GatedUnit
from ...ops.quantized_experts import Float32Copies
from ...quant import Mxfp4Weights
from ...quant.codes import E8M0_NAN
from ...quant.mxfp4 import MX_BLOCK

GATE_UP, DOWN = "gate_up_proj", "down_proj"
# The checkpoint's tensors of one experts module, by their names below it
TENSOR_NAMES = tuple(f"{proj}_{part}" for proj in (GATE_UP, DOWN) for part in ("blocks", "scales", "bias"))
WHERE = "use_mxfp4_experts"


def _shape(tensor: torch.Tensor) -> Tuple[int, ...]:
    return tuple(tensor.shape)


class TutelGptOssMxfp4Experts(torch.nn.Module):
    """gpt-oss' experts of one decoder layer as packed MXFP4, run by tutel on the CPU or CUDA.

    Args:
        gate_up_proj_blocks: (E, 2I, H / 32, 16) uint8 (or the same bytes as (E, 2I, H / 2)): the
            gate and up rows interleaved (even rows gate), two E2M1 codes a byte.
        gate_up_proj_scales: (E, 2I, H / 32) E8M0 bytes.
        gate_up_proj_bias: (E, 2I) floating point, laid out like the rows.
        down_proj_blocks: (E, H, I / 32, 16) uint8 (or (E, H, I / 2)).
        down_proj_scales: (E, H, I / 32) E8M0 bytes.
        down_proj_bias: (E, H) floating point.
        alpha, limit: the clamped SwiGLU's slope and clamp bound (gpt-oss: 1.702 and 7.0).

    The tensors become buffers of these names, the blocks in the checkpoint's 4-D layout and the
    biases in float32 (no copy of a contiguous uint8 tensor; on the blocks' device).

    Raises:
        ValueError: a tensor of the wrong shape or dtype, or an E8M0 scale byte 255 (NaN), naming
            the tensor, its shape or dtype, and what is expected.
        TypeError: an argument that is no tensor.
    """

    def __init__(self, gate_up_proj_blocks: torch.Tensor, gate_up_proj_scales: torch.Tensor,
                 gate_up_proj_bias: torch.Tensor, down_proj_blocks: torch.Tensor, down_proj_scales: torch.Tensor,
                 down_proj_bias: torch.Tensor, *, alpha: float = 1.702, limit: float = 7.0) -> None:
        super().__init__()
        given = dict(zip(TENSOR_NAMES, (gate_up_proj_blocks, gate_up_proj_scales, gate_up_proj_bias,
                                        down_proj_blocks, down_proj_scales, down_proj_bias)))
        gate_up = _stack(GATE_UP, given, "interleaved")
        down = _stack(DOWN, given, None)
        experts, rows, hidden = gate_up.shape
        intermediate = rows // 2
        expected = {DOWN: (experts, hidden, intermediate), f"{GATE_UP}_bias": (experts, rows),
                    f"{DOWN}_bias": (experts, hidden)}
        if down.shape != expected[DOWN]:
            raise ValueError(f"{DOWN}_blocks: shape {_shape(down_proj_blocks)} holds (experts, out, in) = "
                             f"{down.shape}; the gate_up_proj stack {gate_up.shape} (E, 2I, H) needs "
                             f"{expected[DOWN]} (E, H, I), blocks ({experts}, {hidden}, {intermediate // MX_BLOCK}, "
                             f"{MX_BLOCK // 2})")
        for name in (f"{GATE_UP}_bias", f"{DOWN}_bias"):
            bias = given[name]
            if not isinstance(bias, torch.Tensor):
                raise TypeError(f"{name}: expected a tensor, got {type(bias).__name__}")
            if not bias.dtype.is_floating_point:
                raise ValueError(f"{name}: dtype {bias.dtype}; expected a floating point bias (float32 in gpt-oss)")
            if _shape(bias) != expected[name]:
                raise ValueError(f"{name}: shape {_shape(bias)}; expected {expected[name]}")
        device = gate_up.device
        for name in TENSOR_NAMES[1:]:
            if given[name].device != device:
                raise ValueError(f"{name}: on {given[name].device}, {GATE_UP}_blocks on {device}; expected one "
                                 f"device for all the experts' tensors")
        self.num_experts, self.hidden_size, self.intermediate_size = experts, hidden, intermediate
        self.unit = GatedUnit(alpha=float(alpha), up_offset=1.0, limit=float(limit), interleaved=True)
        self.register_buffer(f"{GATE_UP}_blocks", gate_up.gpt_oss_blocks().contiguous())
        self.register_buffer(f"{GATE_UP}_scales", gate_up.scales.contiguous())
        self.register_buffer(f"{GATE_UP}_bias", gate_up_proj_bias.to(torch.float32).contiguous())
        self.register_buffer(f"{DOWN}_blocks", down.gpt_oss_blocks().contiguous())
        self.register_buffer(f"{DOWN}_scales", down.scales.contiguous())
        self.register_buffer(f"{DOWN}_bias", down_proj_bias.to(torch.float32).contiguous())
        # Checked once: each call puts these templates over the buffers as they are then (no value read).
        self._templates = (gate_up.to("meta"), down.to("meta"))
        self._float32 = Float32Copies()  # 16-bit biases as the operators add them (not in the state_dict)

    @property
    def alpha(self) -> float:
        """The clamped SwiGLU's slope."""
        return self.unit.alpha

    @property
    def limit(self) -> float:
        """The clamped SwiGLU's clamp bound."""
        return self.unit.limit

    def stacks(self) -> Tuple[Mxfp4Weights, Mxfp4Weights]:
        """(gate_up, down): tutel.quant stacks over the module's buffers (views, no copies)."""
        gate_up, down = self._templates
        return tuple(template.with_tensors({
            "packed": getattr(self, f"{proj}_blocks").reshape(template.experts, template.out_features, -1),
            "scales": getattr(self, f"{proj}_scales")}) for proj, template in ((GATE_UP, gate_up), (DOWN, down)))

    def forward(self, hidden_states: torch.Tensor, router_indices: Optional[torch.Tensor] = None,
                routing_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
        """gpt-oss' experts as transformers' ``GptOssExperts.forward`` takes them.

        Args:
            hidden_states: [T, H] tokens on the buffers' device (float32, bfloat16, float16;
                float64 on the CPU).
            router_indices: [T, k] chosen experts (ids outside [0, E) contribute nothing).
            routing_weights: [T, k] their routing weights.

        Returns:
            [T, H] in hidden_states' dtype.

        Raises:
            TypeError, ValueError: arguments that do not fit, naming them.
            NotImplementedError: a call autograd would record.
            ValueError: tokens or routing on another device than the buffers (TypeError: float64 tokens
                on CUDA).
        """
        for name, value in (("router_indices", router_indices), ("routing_weights", routing_weights)):
            if value is None:
                raise TypeError(f"{type(self).__name__}.forward: `{name}` is required (gpt-oss' MLP passes the "
                                f"router's indices and scores)")
        gate_up, down = self.stacks()
        # (biases a model's .to(dtype) made 16-bit are widened once, not on every call)
        return routed_quantized_experts(hidden_states, router_indices, routing_weights, gate_up, down, gate=self.unit,
                                        up_bias=self._float32.of("up", getattr(self, f"{GATE_UP}_bias")),
                                        down_bias=self._float32.of("down", getattr(self, f"{DOWN}_bias")))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # load_state_dict copies values into the buffers, whose checks ran once, in the constructor:
        # the scales' values are checked here, before any is copied (shapes and dtypes: by PyTorch).
        for proj in (GATE_UP, DOWN):
            key = f"{prefix}{proj}_scales"
            scales = state_dict.get(key)
            if isinstance(scales, torch.Tensor) and scales.element_size() == 1 and \
                    bool((scales.view(torch.uint8) == E8M0_NAN).any()):
                raise ValueError(f"{key}: holds the E8M0 byte {E8M0_NAN} (NaN); E8M0 scales must be bytes "
                                 f"0..{E8M0_NAN - 1}")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"alpha={self.alpha}, limit={self.limit}, mxfp4")


def _stack(proj: str, tensors: Mapping, gate_up_rows: Optional[str], prefix: str = "") -> Mxfp4Weights:
    """The MXFP4 stack of `proj`'s blocks and scales in `tensors`, its errors naming the tensors."""
    blocks, scales = tensors[f"{proj}_blocks"], tensors[f"{proj}_scales"]
    for name, tensor in ((f"{proj}_blocks", blocks), (f"{proj}_scales", scales)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{prefix}{name}: expected a tensor, got {type(tensor).__name__}")
    try:
        return Mxfp4Weights(blocks, scales, gate_up_rows=gate_up_rows)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{prefix}{proj}_blocks {_shape(blocks)} {blocks.dtype} and {prefix}{proj}_scales "
                          f"{_shape(scales)} {scales.dtype} are no MXFP4 stack: {error}") from None


# -- the model's experts -------------------------------------------------------------------------


def _gpt_oss_classes():
    """(float experts, MLP, MXFP4 experts or None, MXFP4 MLP or None) of the installed transformers."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssMLP
    try:
        from transformers.integrations.mxfp4 import Mxfp4GptOssExperts, Mxfp4GptOssMLP
    except ImportError:  # (a release without transformers' MXFP4 integration)
        Mxfp4GptOssExperts = Mxfp4GptOssMLP = None
    return GptOssExperts, GptOssMLP, Mxfp4GptOssExperts, Mxfp4GptOssMLP


def gpt_oss_experts(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """(name, module) of every gpt-oss MLP of `model` (transformers' ``GptOssMLP`` or
    ``Mxfp4GptOssMLP``, or any module whose ``experts`` is gpt-oss experts: ``GptOssExperts``,
    ``Mxfp4GptOssExperts`` or ``TutelGptOssMxfp4Experts``)."""
    experts_classes = tuple(c for c in _gpt_oss_classes()[0::2] if c is not None) + (TutelGptOssMxfp4Experts,)
    return [(name, module) for name, module in model.named_modules()
            if isinstance(getattr(module, "experts", None), experts_classes)]


def _checkpoint_tensors(expert_tensors: Mapping, name: str) -> Dict[str, torch.Tensor]:
    """The six tensors of the experts below MLP `name`, looked up as ``{name}.experts.X`` or, for
    a bare ``GptOssModel`` whose names lack the causal LM's ``model.``, ``model.{name}.experts.X``."""
    prefixes = [f"{name}.experts." if name else "experts."]
    if not prefixes[0].startswith("model."):
        prefixes.append("model." + prefixes[0])
    for prefix in prefixes:
        if f"{prefix}{TENSOR_NAMES[0]}" in expert_tensors:
            break
    else:
        prefix = prefixes[0]
    missing = [prefix + part for part in TENSOR_NAMES if prefix + part not in expert_tensors]
    if missing:
        keys = [key for key in expert_tensors if isinstance(key, str) and ".experts." in key][:3]
        raise ValueError(f"{WHERE}: expert_tensors has no {missing[0]!r}"
                         f"{f' (and {len(missing) - 1} more of this layer)' if len(missing) > 1 else ''}: it must map "
                         f"the checkpoint's names of every gpt-oss experts tensor ({', '.join(TENSOR_NAMES)}) to "
                         f"tensors; experts keys it has: {keys or 'none'}")
    return {part: expert_tensors[prefix + part] for part in TENSOR_NAMES}


def _check_checkpoint_shapes(tensors: Dict[str, torch.Tensor], name: str, experts: int, hidden: int,
                             intermediate: int) -> None:
    """ValueError naming the tensor unless each has the shape the model's experts need."""
    expected = {
        f"{GATE_UP}_blocks": (experts, 2 * intermediate, hidden // MX_BLOCK, MX_BLOCK // 2),
        f"{GATE_UP}_scales": (experts, 2 * intermediate, hidden // MX_BLOCK),
        f"{GATE_UP}_bias": (experts, 2 * intermediate),
        f"{DOWN}_blocks": (experts, hidden, intermediate // MX_BLOCK, MX_BLOCK // 2),
        f"{DOWN}_scales": (experts, hidden, intermediate // MX_BLOCK),
        f"{DOWN}_bias": (experts, hidden),
    }
    for part, shape in expected.items():
        tensor = tensors[part]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{WHERE}: expert_tensors[{name}.experts.{part!r}]: expected a tensor, got "
                            f"{type(tensor).__name__}")
        # The blocks may also come as (E, N, K / 2), the bytes of transformers' Mxfp4GptOssExperts.
        flat = part.endswith("_blocks") and _shape(tensor) == shape[:2] + (shape[2] * shape[3],)
        if _shape(tensor) != shape and not flat:
            raise ValueError(f"{WHERE}: {name}.experts.{part}: shape {_shape(tensor)}; the model's experts "
                             f"(E={experts}, H={hidden}, I={intermediate}) need {shape}")


def _unswizzled(module: torch.nn.Module, name: str, proj: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of one projection of a loaded ``Mxfp4GptOssExperts``: its Triton tensors
    unswizzled as transformers' own ``Mxfp4ReverseDeserialize`` does for saving them."""
    weight = getattr(module, proj, None)
    config = getattr(module, f"{proj}_precision_config", None)
    scale = getattr(config, "weight_scale", None)
    if not all(hasattr(t, "storage") and hasattr(t.storage, "layout") for t in (weight, scale)):
        raise ValueError(f"{WHERE}: {name}.experts ({type(module).__name__}) holds no loaded MXFP4 weights of `{proj}` "
                         f"(transformers' Triton tensors and `{proj}_precision_config`); pass expert_tensors= the "
                         f"checkpoint's tensors (safetensors.torch.load_file of its files)")
    scales = scale.storage.layout.unswizzle_data(scale.storage.data).transpose(-1, -2)
    blocks = weight.storage.layout.unswizzle_data(weight.storage.data).transpose(-1, -2)
    return blocks.reshape(*scales.shape, -1), scales


def _quantized(module: torch.nn.Module, name: str) -> Dict[str, torch.Tensor]:
    """The float experts `module` (transformers' GptOssExperts: gate_up_proj (E, H, 2I), down_proj
    (E, I, H), x @ W) quantized to MXFP4 in the checkpoint's layout."""
    tensors = {}
    for proj in (GATE_UP, DOWN):
        weight = getattr(module, proj)
        if weight.device.type == "meta":
            raise ValueError(f"{WHERE}: {name}.experts.{proj} is on the meta device (no values) to quantize; "
                             f"pass expert_tensors= the checkpoint's tensors")
        stack = Mxfp4Weights.quantize(weight.detach().transpose(1, 2),
                                      gate_up_rows="interleaved" if proj == GATE_UP else None)
        tensors[f"{proj}_blocks"], tensors[f"{proj}_scales"] = stack.gpt_oss_blocks(), stack.scales
        tensors[f"{proj}_bias"] = getattr(module, f"{proj}_bias").detach()
    return tensors


def _replacement(name: str, mlp: torch.nn.Module, expert_tensors: Optional[Mapping],
                 quantize: bool) -> Optional[TutelGptOssMxfp4Experts]:
    """The tutel experts for MLP `name`, or None where it holds them already and nothing new is given."""
    experts = mlp.experts
    float_class, _, mxfp4_class, _ = _gpt_oss_classes()
    if isinstance(experts, TutelGptOssMxfp4Experts) and expert_tensors is None:
        return None
    if isinstance(experts, TutelGptOssMxfp4Experts):
        device = experts.gate_up_proj_blocks.device
    else:
        device = getattr(experts, f"{GATE_UP}_bias").device
    sizes = tuple(getattr(experts, size, None) for size in ("num_experts", "hidden_size", "intermediate_size"))
    if not all(isinstance(size, int) for size in sizes):
        raise ValueError(f"{WHERE}: {name}.experts ({type(experts).__name__}) lacks integer num_experts, hidden_size "
                         f"and intermediate_size; got {sizes}")
    for size, value in zip(("hidden_size", "intermediate_size"), sizes[1:]):
        if value % MX_BLOCK:
            raise ValueError(f"{WHERE}: {name}.experts: {size}={value} is no multiple of {MX_BLOCK}, which MXFP4's "
                             f"scale blocks need")
    if expert_tensors is not None:
        tensors = _checkpoint_tensors(expert_tensors, name)
        _check_checkpoint_shapes(tensors, name, *sizes)
        if device.type == "meta":
            device = tensors[f"{GATE_UP}_blocks"].device
    elif mxfp4_class is not None and isinstance(experts, mxfp4_class):
        tensors = {}
        for proj in (GATE_UP, DOWN):
            tensors[f"{proj}_blocks"], tensors[f"{proj}_scales"] = _unswizzled(experts, name, proj)
            tensors[f"{proj}_bias"] = getattr(experts, f"{proj}_bias").detach()
        _check_checkpoint_shapes(tensors, name, *sizes)
    elif quantize:
        tensors = _quantized(experts, name)
    else:
        raise ValueError(f"{WHERE}: {name}.experts ({type(experts).__name__}) holds float weights, not gpt-oss' MXFP4 "
                         f"bytes (transformers dequantizes them at load on a CPU); pass expert_tensors= the "
                         f"checkpoint's tensors (e.g. safetensors.torch.load_file of its files), or quantize=True "
                         f"to quantize these float weights to MXFP4 again (lossy)")
    try:
        return TutelGptOssMxfp4Experts(**{part: tensor.to(device) for part, tensor in tensors.items()},
                                       alpha=getattr(experts, "alpha", 1.702), limit=getattr(experts, "limit", 7.0))
    except (TypeError, ValueError) as error:
        raise type(error)(f"{WHERE}: {name}.experts: {error}") from None


def use_mxfp4_experts(model: torch.nn.Module, expert_tensors: Optional[Mapping] = None, *,
                      quantize: bool = False) -> torch.nn.Module:
    """Gives every gpt-oss decoder layer of `model` tutel experts holding the packed MXFP4 weights
    (``TutelGptOssMxfp4Experts``: blocks, scales and float32 biases as buffers under the
    checkpoint's names, nothing else); returns `model`.

    Where the weights come from, in this order:

    * `expert_tensors`: a mapping of the checkpoint's tensor names
      (``model.layers.{i}.mlp.experts.gate_up_proj_blocks``, ``..._scales``, ``..._bias``,
      ``down_proj_*``) to tensors, as ``safetensors.torch.load_file`` gives them (other keys are
      ignored; a ``GptOssModel``'s own names, without ``model.``, are accepted too).  For a model
      transformers dequantized at load (a CPU), or any other;
    * transformers' ``Mxfp4GptOssExperts`` of a model loaded quantized (a GPU with Triton): their
      Triton tensors unswizzled as transformers does for saving them.  Their ``Mxfp4GptOssMLP``
      becomes a ``GptOssMLP`` over the same router (its forward calls the experts module);
    * with ``quantize=True``, float experts (``GptOssExperts``) quantized to MXFP4 again by
      ``tutel.quant.Mxfp4Weights.quantize`` (OCP MX's rule).  A lossy re-quantization: weights
      transformers dequantized from an MXFP4 checkpoint (bfloat16 holds them exactly) come back
      as the same values, though a block's scale byte may differ from the checkpoint's; any other
      weights (fine-tuned, trained in float) are rounded to MXFP4.  Prefer `expert_tensors`.

    The buffers lie on the device of the experts they replace (the tensors' own device for
    experts on the meta device); the replaced modules and their float weights are dropped.  The
    experts run on the CPU and on CUDA.  Every layer is checked before any is replaced.  Layers already
    converted are left as they are unless `expert_tensors` is given.

    Raises:
        ValueError: `model` has no gpt-oss experts; a layer holds only float experts and neither
            `expert_tensors` nor ``quantize=True`` is given; `expert_tensors` lacks a layer's
            tensor, or one has the wrong shape (naming the tensor, its shape and the expected) or
            dtype, or holds no valid MXFP4 (an E8M0 scale byte 255); hidden or intermediate size
            no multiple of 32.
        TypeError: `model` is no module, `expert_tensors` no mapping, `quantize` no bool, or a value
            of `expert_tensors` no tensor.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{WHERE}: `model` must be a torch.nn.Module (a transformers gpt-oss model), got "
                        f"{type(model).__name__}")
    if expert_tensors is not None and not isinstance(expert_tensors, Mapping):
        raise TypeError(f"{WHERE}: `expert_tensors` must be a mapping of the checkpoint's tensor names to tensors "
                        f"(e.g. safetensors.torch.load_file's dict) or None, got {type(expert_tensors).__name__}")
    if not isinstance(quantize, bool):
        raise TypeError(f"{WHERE}: `quantize` must be a bool, got {type(quantize).__name__}")
    mlps = gpt_oss_experts(model)
    if not mlps:
        raise ValueError(f"{WHERE}: {type(model).__name__} has no gpt-oss experts (a module whose `experts` is "
                         f"transformers' GptOssExperts or Mxfp4GptOssExperts)")
    replacements = [(name, mlp, _replacement(name, mlp, expert_tensors, quantize)) for name, mlp in mlps]
    _, mlp_class, _, mxfp4_mlp_class = _gpt_oss_classes()
    for name, mlp, experts in replacements:
        if experts is None:
            continue
        if mxfp4_mlp_class is not None and isinstance(mlp, mxfp4_mlp_class):
            # Its forward hands the experts Triton routing data; GptOssMLP's calls experts(x, indices, scores).
            config = getattr(model, "config", None)
            if config is None:
                raise ValueError(f"{WHERE}: {name} ({type(mlp).__name__}) is replaced by a GptOssMLP, which needs the "
                                 f"model's config; {type(model).__name__} has no `config`")
            with torch.device("meta"):
                plain = mlp_class(config)
            plain.router, plain.experts = mlp.router, experts
            model.set_submodule(name, plain)
        else:
            mlp.experts = experts
    return model

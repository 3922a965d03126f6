"""The model of the checkpoint resharding tests: one MoE layer per expert layout, each with a
fixed number of global experts, so the same checkpoint fits 1, 2 and 4 processes (whole
experts on few processes, shared experts on many)."""
import torch

from tutel import moe

MODEL_DIM = 6
TOKENS = 24

# name: (global experts, expert dict)
LAYERS = {
    "ffn_e4": (4, {"type": "ffn", "hidden_size_per_expert": 8}),
    "ffn_e2_out5": (2, {"type": "ffn", "hidden_size_per_expert": 8, "output_dim": 5}),
    "ffn_e1_out5": (1, {"type": "ffn", "hidden_size_per_expert": 8, "output_dim": 5}),
    "ffn_e1_nobias": (1, {"type": "ffn", "hidden_size_per_expert": 8, "output_dim": 7,
                          "has_fc1_bias": False, "has_fc2_bias": False}),
    "llama_e4": (4, {"type": "llama_ffn", "hidden_size_per_expert": 8}),
    "llama_e1": (1, {"type": "llama_ffn", "hidden_size_per_expert": 5}),
}


def experts_per_process(num_experts: int, world_size: int) -> int:
    """num_experts_per_device giving `num_experts` global experts on `world_size` processes."""
    return num_experts // world_size if world_size <= num_experts else -(world_size // num_experts)


def build_model(world_size: int, seed: int = 0) -> torch.nn.ModuleDict:
    torch.manual_seed(seed)
    layers = {}
    for name, (count, experts) in LAYERS.items():
        experts = dict(experts, num_experts_per_device=experts_per_process(count, world_size))
        layers[name] = moe.moe_layer(gate_type={"type": "top", "k": min(2, count), "capacity_factor": 0.0},
                                     model_dim=MODEL_DIM, experts=experts)
    return torch.nn.ModuleDict(layers).double()


def outputs(model: torch.nn.ModuleDict, tokens: torch.Tensor) -> dict:
    """Each layer's output on the same tokens (dropless: no token depends on the others).

    float64: the expert matmuls see other batch sizes on other world sizes, which may round
    float32 sums differently; float64 outputs are bit-identical."""
    model.eval()
    with torch.no_grad():
        return {name: layer(tokens) for name, layer in model.items()}


def tokens() -> torch.Tensor:
    return torch.randn(TOKENS, MODEL_DIM, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def mismatches(actual: dict, expected: dict) -> list:
    """Names of the layers whose outputs are not bit-identical, with the largest difference."""
    return [f"{name}: max |diff| = {(actual[name] - expected[name]).abs().max().item():.3g}"
            for name in expected if not torch.equal(actual[name], expected[name])]

"""Built-in gates, selected in ``moe_layer(gate_type={'type': <module name>, ...})``.

Each module exposes ``Gate``: a torch.nn.Module built as
``Gate(model_dim=..., num_global_experts=..., **options)`` with a ``top_k``
attribute and ``forward(x [T, model_dim]) -> logits [T, E]``.
"""
from .cosine_top import CosineTopKGate
from .top import LinearTopKGate

TopKGate = LinearTopKGate

__all__ = ["CosineTopKGate", "LinearTopKGate", "TopKGate"]

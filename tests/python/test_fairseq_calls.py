"""The calls the fairseq recipe (examples/fairseq_moe) adds to fairseq, made on stand-ins of
fairseq's decoder layers and source files (fairseq itself does not install here: see its README)."""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tutel import system

RECIPE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "fairseq_moe")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"fairseq_recipe_{name}", os.path.join(RECIPE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tutel_moe = _load("tutel_moe")
apply_patch = _load("apply_patch")


class DecoderLayerStandIn(torch.nn.Module):
    """The feed-forward statements of fairseq's TransformerDecoderLayer.forward, with residual."""

    def __init__(self, embed_dim, ffn_dim):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(embed_dim, ffn_dim), torch.nn.Linear(ffn_dim, embed_dim)
        self.activation_fn = F.gelu
        self.activation_dropout_module = torch.nn.Dropout(0.1)

    def forward(self, x):
        residual = x
        x = self.activation_fn(self.fc1(x))
        x = self.activation_dropout_module(x)
        x = self.fc2(x)
        return residual + x


@pytest.fixture(autouse=True)
def _clean_cache(monkeypatch):
    system.cache().reset()
    for name in ("MOE", "L_AUX_WT", "NO_OVERFLOW"):
        monkeypatch.delenv(name, raising=False)
    yield
    system.cache().reset()


def test_every_moe_th_layer_becomes_a_tutel_moe_layer(monkeypatch):
    monkeypatch.setenv("MOE", "2")
    layers = torch.nn.ModuleList(DecoderLayerStandIn(8, 16) for _ in range(4))
    assert tutel_moe.install_tutel_moe(layers) == 2
    assert [isinstance(layer.fc1, tutel_moe.TutelMoeFFN) for layer in layers] == [False, True, False, True]
    block = layers[1].fc1.moe
    gate = block.gates[0]
    # k=2 is clamped to the expert count: one process holds one expert
    assert (gate.top_k, gate.capacity_factor, gate.gate_noise, gate.fp32_gate) == (1, 0.0, 1.0, True)
    assert block.num_global_experts == 1 and block.experts.hidden_size_per_expert == 16  # one per process
    assert all(getattr(p, "expert", False) and p._tutel_expert for p in block.experts.parameters())
    assert not any(hasattr(p, "expert") for p in block.gates.parameters())
    layers.half()
    assert gate.wg.weight.dtype == torch.float32  # fp32_gate keeps the gate in float32


def test_forward_on_time_batch_channels_and_l_aux_through_the_cache(monkeypatch):
    monkeypatch.setenv("L_AUX_WT", "0.5")
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(DecoderLayerStandIn(8, 16) for _ in range(4))
    tutel_moe.install_tutel_moe(layers, every=2)
    x = torch.randn(5, 3, 8)  # [time, batch, channels]
    layers.eval()  # no gate noise, no dropout: compare with the block computed by hand
    h = x
    for layer in layers:
        h = layer(h)
    assert h.shape == x.shape
    cached = system.cache().get()
    assert len(cached) == 2 and cached[0] is layers[1].fc1.moe.l_aux and cached[1] is layers[3].fc1.moe.l_aux
    block = layers[1].fc1.moe
    expected = block(layers[0](x))  # the MoE block alone, as the layer's fc1
    torch.testing.assert_close(layers[1](layers[0](x)) - layers[0](x), expected)
    loss = torch.tensor(10.0)
    total = tutel_moe.add_l_aux(loss, tokens=15)
    torch.testing.assert_close(total, loss + 0.5 * 15 * (cached[0] + cached[1]))


def test_without_moe_layers_nothing_changes():
    layers = torch.nn.ModuleList(DecoderLayerStandIn(8, 16) for _ in range(3))
    assert tutel_moe.install_tutel_moe(layers) == 0  # MOE unset
    loss = torch.tensor(3.0)
    assert tutel_moe.add_l_aux(loss, 7) is loss


def test_training_gradients_reach_gate_and_experts(monkeypatch):
    layers = torch.nn.ModuleList([DecoderLayerStandIn(8, 16), DecoderLayerStandIn(8, 16)])
    tutel_moe.install_tutel_moe(layers, every=2)
    layers.train()
    out = layers[1](layers[0](torch.randn(4, 2, 8)))
    tutel_moe.add_l_aux(out.square().sum(), tokens=8).backward()
    block = layers[1].fc1.moe
    assert block.gates[0].wg.weight.grad is not None and block.experts.batched_fc1_w.grad.abs().sum() > 0


def test_no_overflow_zeroes_non_finite_gradients(monkeypatch):
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.tensor([1.0, float("inf"), float("nan"), -2.0])
    tutel_moe.zero_non_finite_grads({"cpu": param})
    assert torch.isinf(param.grad[1])  # NO_OVERFLOW unset: untouched
    monkeypatch.setenv("NO_OVERFLOW", "1")
    tutel_moe.zero_non_finite_grads({"cpu": param})
    assert param.grad.tolist() == [1.0, 0.0, 0.0, -2.0]


STAND_INS = {
    "fairseq/models/transformer.py": (
        "import math\n\nclass TransformerEncoder(object):\n    def __init__(self):\n        self.layers = []\n"
        "        self.layers.extend([1])\n\n\nclass TransformerDecoder(object):\n    def __init__(self, n):\n"
        "        self.layers = []\n        self.layers.extend(\n            [\n                n + i\n"
        "                for i in range(n)\n            ]\n        )\n        self.after = True\n"),
    "fairseq/criterions/cross_entropy.py": (
        "import math\n\n\nclass Criterion(object):\n    def forward(self, model, sample, reduce=True):\n"
        "        loss, _ = self.compute_loss(model, None, sample, reduce=reduce)\n        return loss\n"),
    "fairseq/optim/fp16_optimizer.py": (
        "from collections import (\n    defaultdict,\n)\n\n\nclass Mixin(object):\n    def clip_grad_norm(self):\n"
        "        self._sync_fp16_grads_to_fp32()\n        return 0\n"),
}


def _write_tree(root):
    for relative, text in STAND_INS.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "fairseq" / "modules").mkdir(parents=True, exist_ok=True)


def test_apply_patch_inserts_the_calls_once(tmp_path):
    _write_tree(tmp_path)
    result = subprocess.run([sys.executable, os.path.join(RECIPE, "apply_patch.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "fairseq" / "modules" / "tutel_moe.py").exists()
    decoder = (tmp_path / "fairseq/models/transformer.py").read_text().split("\n")
    end = decoder.index("        )")
    assert decoder[end + 1] == "        install_tutel_moe(self.layers)  # tutel-moe"
    assert decoder.count("        install_tutel_moe(self.layers)  # tutel-moe") == 1  # not in the encoder
    assert decoder[1] == "from fairseq.modules.tutel_moe import install_tutel_moe  # tutel-moe"
    criterion = (tmp_path / "fairseq/criterions/cross_entropy.py").read_text()
    assert ('reduce=reduce)\n        loss = add_l_aux(loss, sample["ntokens"])  # tutel-moe\n        return loss'
            in criterion)
    optimizer = (tmp_path / "fairseq/optim/fp16_optimizer.py").read_text()
    assert optimizer.startswith("from collections import (\n    defaultdict,\n)\nfrom fairseq.modules.tutel_moe")
    assert "_fp32()\n        zero_non_finite_grads(self.fp32_params)  # tutel-moe\n" in optimizer
    for relative in STAND_INS:
        compile((tmp_path / relative).read_text(), relative, "exec")
    before = {relative: (tmp_path / relative).read_text() for relative in STAND_INS}
    apply_patch.apply(str(tmp_path))  # a second run changes nothing
    assert before == {relative: (tmp_path / relative).read_text() for relative in STAND_INS}


def test_apply_patch_refuses_another_fairseq(tmp_path):
    _write_tree(tmp_path)
    (tmp_path / "fairseq/criterions/cross_entropy.py").write_text("import math\n")
    before = (tmp_path / "fairseq/models/transformer.py").read_text()
    with pytest.raises(ValueError, match="no line matching .*compute_loss.*commit b5e7b25"):
        apply_patch.apply(str(tmp_path))
    assert (tmp_path / "fairseq/models/transformer.py").read_text() == before  # nothing written

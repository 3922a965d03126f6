"""The code on docs/integrations/transformers.md runs as written, and its error example is the
message the code raises."""
import os
import re

import pytest
import torch

from transformers_test_setup import one_intra_op_thread  # noqa: F401  (autouse fixture)

pytest.importorskip("transformers")

PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "integrations", "transformers.md")


def _blocks(language):
    with open(PAGE) as handle:
        return re.findall(rf"^```{language}\n(.*?)^```", handle.read(), flags=re.S | re.M)


def test_the_documented_code_runs():
    (code,) = _blocks("python")
    namespace = {}
    exec(compile(code, "docs/integrations/transformers.md", "exec"), namespace)
    for name in ("model", "other"):
        assert namespace[name].config._experts_implementation == "tutel", name
    assert torch.isfinite(namespace["loss"])
    experts = namespace["model"].model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.abs().sum() > 0


def test_the_documented_error_is_the_one_raised():
    from tiny_transformers_experts import make_inputs, make_pair
    from tutel.integrations.transformers import UnsupportedExpertsLayout
    (message,) = [block.strip() for block in _blocks("text") if "UnsupportedExpertsLayout" not in block]
    _, module = make_pair("mixtral")
    module.has_bias = True
    with pytest.raises(UnsupportedExpertsLayout) as error:
        module(*make_inputs(3, 2))
    assert str(error.value) == message

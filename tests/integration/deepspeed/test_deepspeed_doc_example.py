"""The Python example of docs/integrations/deepspeed.md runs as written."""
import os
import re

import torch

from tutel import moe

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "integrations", "deepspeed.md")


def test_documented_example_runs(deepspeed_world):
    with open(DOC) as handle:
        blocks = re.findall(r"```python\n(.*?)```", handle.read(), flags=re.S)
    assert len(blocks) == 1, "the page should hold exactly one Python example"
    namespace = {}
    exec(compile(blocks[0], DOC, "exec"), namespace)
    layer, x, output = namespace["layer"], namespace["x"], namespace["output"]
    assert output.shape == x.shape and torch.isfinite(output).all()
    assert isinstance(layer.deepspeed_moe._tutel_dispatcher, moe.TutelMoeFastDispatcher)
    assert all(p.grad is not None for p in layer.parameters())

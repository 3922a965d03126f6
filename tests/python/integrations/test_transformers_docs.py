"""The code on docs/integrations/transformers.md runs as written, and its error example is the
message the code raises."""
import os
import re
import subprocess
import sys

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


def test_the_first_snippet_says_that_tutel_needs_the_import_and_how_transformers_refuses_it():
    """transformers offers no place for a hint of its own: without the import it refuses the name
    and lists its backends, so the page's first snippet says what that refusal means."""
    code = ("import transformers\n"
            "config = transformers.Qwen3MoeConfig(vocab_size=10, hidden_size=8, intermediate_size=8, "
            "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, moe_intermediate_size=4, "
            "num_experts=4, num_experts_per_tok=2)\n"
            "try:\n"
            "    transformers.AutoModelForCausalLM.from_config(config, experts_implementation='tutel')\n"
            "except ValueError as error:\n"
            "    print(error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    refusal = result.stdout.strip()
    assert result.returncode == 0 and refusal.startswith('Specified `experts_implementation="tutel"` is not '
                                                         'supported'), result.stdout + result.stderr
    (snippet,) = _blocks("python")
    lines = snippet.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("import tutel.integrations.transformers"))
    note = []  # the comment lines right below the import
    for line in lines[at + 1:]:
        if not line.startswith("#"):
            break
        note.append(line[1:].strip())
    note = " ".join(note)
    assert "without this import" in note.lower() and refusal.split(". ")[0] + "." in note, note

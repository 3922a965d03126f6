"""replace_moe_blocks with expert parallelism over the launch's processes (gloo).

Every rank builds the same tiny float64 model of each family, keeps an untouched copy, replaces
the MoE blocks (each rank keeping its half of the experts) and runs its own tokens.  On every rank
the logits, the gradients of the parameters outside the MoE blocks and the greedy generation equal
the original model's on that rank's tokens (one process, all experts), and each rank's expert
gradients equal the original's summed over the ranks (an expert serves every rank's tokens).
The ranks' checkpoint files load into a one-process model with tutel.checkpoint.load_resharded.
A block whose experts the processes cannot split is named.
"""
import os
import shutil
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integrations"))

import replace_models as rm  # noqa: E402
from dist_checks import CheckList, close, expect_error, rank, world  # noqa: E402
from dist_harness import init_gloo  # noqa: E402
from tutel.integrations.transformers import replace_moe_blocks  # noqa: E402
from tutel.integrations.transformers.block_layouts import UnsupportedMoeBlock  # noqa: E402

checks = CheckList()
TOL = 1e-10
# Expert counts two processes can split: 6 or 8 experts in every family.
SPLITTABLE = {"mixtral": dict(num_local_experts=6), "qwen2_moe": {}, "qwen3_moe": dict(num_experts=8), "olmoe": {},
              "deepseek_v3": {}, "glm4_moe": {}, "gpt_oss": dict(num_local_experts=6), "llama4": {}}


def check_expert_grads(original, layer, family, name):
    """Each rank's expert gradients equal the original's summed over the ranks (its experts only)."""
    experts = original.get_submodule(name).experts
    for param in experts.parameters():
        dist.all_reduce(param.grad)
    for attribute, grad in rm.expert_grads_as_layer(experts, family, rank(), world()).items():
        close(getattr(layer.experts, attribute).grad, grad, f"{family} {name} {attribute} grad", TOL)


def check_family(family):
    model = rm.build(family, **SPLITTABLE[family])
    original = rm.build(family, **SPLITTABLE[family])
    blocks = rm.block_names(model)
    assert replace_moe_blocks(model) == len(blocks)
    for name in blocks:
        layer = model.get_submodule(name)
        assert layer.world_size == world() and layer.num_local_experts * world() == layer.num_global_experts

    ids = rm.tokens(100 + rank())  # every rank its own tokens
    expected, expected_grads = rm.logits_and_grads(original, ids, blocks)
    logits, grads = rm.logits_and_grads(model, ids, blocks)
    close(logits, expected, f"{family} logits", TOL)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        close(grad, expected_grads[name], f"{family} {name} grad", TOL)
    for name in blocks:
        check_expert_grads(original, model.get_submodule(name), family, name)
    assert torch.equal(rm.greedy(model, ids), rm.greedy(original, ids)), f"{family}: generation differs"


def _family_check(family):
    def check():
        check_family(family)
    check.__name__ = f"expert_parallel_{family}_equals_one_process"
    return check


for _family in rm.FAMILIES:
    checks.add(_family_check(_family))


@checks.add
def expert_parallel_checkpoint_loads_on_one_process():
    """After a training step with the experts split, each rank saves its state_dict; a model built
    with another initialisation and replaced on a one-process group loads the two files with
    tutel.checkpoint.load_resharded and computes what the expert-parallel model computes."""
    import tempfile
    from tutel import checkpoint
    from tutel.examples.transformers_replace_ep import average_gradients
    family = "deepseek_v3"
    model = rm.build(family)
    replace_moe_blocks(model)
    ids = rm.tokens(200 + rank())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, labels=ids).loss.backward()
    average_gradients(model, world())  # replicated parameters stay equal on every rank
    optimizer.step()
    expected = model(ids).logits.detach()
    folder = [tempfile.mkdtemp() if rank() == 0 else None]
    dist.broadcast_object_list(folder)
    pattern = os.path.join(folder[0], "model-{rank}-of-{size}.pt")
    torch.save(model.state_dict(), pattern.format(rank=rank(), size=world()))
    dist.barrier()
    alone = [dist.new_group([r]) for r in range(world())][rank()]
    single = rm.build(family, seed=9)
    replace_moe_blocks(single, group=alone)
    assert single.model.layers[1].mlp.num_local_experts == single.model.layers[1].mlp.num_global_experts == 8
    checkpoint.load_resharded(single, pattern, saved_world_size=world())
    close(single(ids).logits, expected, "one-process model loaded from the expert-parallel checkpoint", TOL)
    dist.barrier()
    if rank() == 0:
        shutil.rmtree(folder[0])


@checks.add
def experts_that_do_not_split_are_named():
    model = rm.build("mixtral", num_local_experts=5)
    expect_error(UnsupportedMoeBlock, ["'model.layers.0.mlp'", "num_experts=5", f"{world()} processes"],
                 replace_moe_blocks, model)
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def run_all():
    """Joins the process group (gloo) and runs every check."""
    init_gloo()
    from dist_checks import run
    run([checks])

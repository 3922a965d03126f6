"""Trains a tiny transformers MoE language model whose MoE blocks are tutel moe_layers, with the
experts split over the processes (expert parallelism).

    python -m tutel.examples.transformers_replace_ep
    python -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.transformers_replace_ep

The model (random initialisation, a small config, nothing downloaded) learns synthetic token
sequences that follow a fixed rule (each token determines the next), so its loss falls within a
few dozen steps.  ``replace_moe_blocks`` swaps every sparse-MoE block for a moe_layer holding the
same weights; under torchrun every process keeps its share of the experts (CPU, gloo) and trains
on its own batches.  Gradients of the replicated parameters (attention, norms, routers, shared
experts) are averaged over the processes; an expert's gradient already gathers every process's
tokens, so it is only divided by the process count: each step then follows the gradient of the
mean loss over all processes' batches.
"""
import argparse
import os
from typing import List, Optional

import torch
import torch.distributed as dist

FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=FAMILIES, default="qwen3_moe", help="transformers MoE family")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=8, help="sequences per process and step")
    parser.add_argument("--seq_len", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--l_aux_wt", type=float, default=0.01, help="weight of the layers' balance losses")
    parser.add_argument("--capacity_factor", type=float, default=0.0, help="0: dropless (the default)")
    return parser.parse_args(argv)


def tiny_model(family: str, vocab: int) -> torch.nn.Module:
    """A 2-layer MoE causal LM of `family` with 8 experts, randomly initialised."""
    import transformers
    common = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    if family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32, num_experts=8,
                                             num_experts_per_tok=2, norm_topk_prob=True)
    elif family == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    else:  # multi-head latent attention: its own head sizes
        common.pop("head_dim")
        common["num_key_value_heads"] = common["num_attention_heads"]
        config = transformers.DeepseekV3Config(**common, intermediate_size=64, moe_intermediate_size=32,
                                               n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                               n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16,
                                               q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=6)
    return transformers.AutoModelForCausalLM.from_config(config)


def synthetic_batch(generator: torch.Generator, batch: int, length: int, vocab: int) -> torch.Tensor:
    """Sequences starting at a random token, each next token = (5 * token + 3) mod vocab."""
    tokens = [torch.randint(0, vocab, (batch,), generator=generator)]
    for _ in range(length - 1):
        tokens.append((5 * tokens[-1] + 3) % vocab)
    return torch.stack(tokens, dim=1)


def average_gradients(model: torch.nn.Module, world_size: int) -> None:
    """Gradient of the mean loss over the processes: replicated parameters are all-reduced,
    experts (marked ``_tutel_expert``) already hold every process's contribution."""
    if world_size == 1:
        return
    for param in model.parameters():
        if param.grad is None:
            continue
        if not getattr(param, "_tutel_expert", False):
            dist.all_reduce(param.grad)
        param.grad.div_(world_size)


def main(argv: Optional[List[str]] = None) -> List[float]:
    """Trains and prints the loss; returns the per-step losses (averaged over the processes)."""
    args = parse_args(argv)
    from tutel import moe
    from tutel.integrations.transformers import replace_moe_blocks
    from tutel.integrations.transformers.replace import moe_aux_loss

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group(backend="gloo")
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)

    vocab = 61
    torch.manual_seed(0)  # the same initial model on every process
    model = tiny_model(args.family, vocab)
    replaced = replace_moe_blocks(model, capacity_factor=args.capacity_factor)
    local_experts = next(m for m in model.modules() if isinstance(m, moe.moe_layer)).num_local_experts
    if rank == 0:
        print(f"{args.family}: replaced {replaced} MoE blocks by moe_layers; {world_size} process(es), "
              f"{local_experts} of 8 experts each", flush=True)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(1000 + rank)  # every process its own batches
    losses = []
    for step in range(args.steps):
        ids = synthetic_batch(generator, args.batch_size, args.seq_len, vocab)
        output = model(input_ids=ids, labels=ids)
        loss = output.loss + args.l_aux_wt * moe_aux_loss(model)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(model, world_size)
        optimizer.step()
        moe.update_selection_biases(model)  # aux-loss-free balancing (DeepSeek-V3's routers); else a no-op
        reported = output.loss.detach().clone()
        if distributed:
            dist.all_reduce(reported)
            reported /= world_size
        losses.append(reported.item())
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}", flush=True)
    if distributed:
        dist.destroy_process_group()
    return losses


if __name__ == "__main__":
    main()

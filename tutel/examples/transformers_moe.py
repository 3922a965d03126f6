"""Trains a tiny Hugging Face transformers MoE language model from scratch, experts run by tutel.

    python -m tutel.examples.transformers_moe                          # Mixtral-style, 300 steps, CPU
    python -m tutel.examples.transformers_moe --family qwen3_moe --steps 500 --output-dir runs/qwen3

The model is one of transformers' own MoE families (Mixtral, Qwen3-MoE, OLMoE or gpt-oss), built
from a small config with random weights and ``experts_implementation="tutel"``: the family's
router picks the experts, tutel runs them.  It learns, character by character, the short stories
in tutel/examples/data/river_town.txt (written for this project and placed in the public
domain), so nothing is downloaded.  It prints the loss as it goes (with a progress bar), writes
the loss curve to OUTPUT_DIR/transformers_moe_loss.png (needs matplotlib) and ends by writing a
few lines of text that continue a prompt.
"""
import argparse
import math
import os
import time
from typing import Dict, Iterable, List, Sequence, Tuple

import torch

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "river_town.txt")
PAD, BOS = 0, 1  # token ids before the characters
SPECIALS = 2

# family -> (transformers config class, its options for a model of about 0.4 M parameters)
FAMILIES: Dict[str, Tuple[str, dict]] = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                                      head_dim=16, router_jitter_noise=0.0)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=96, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=True, head_dim=16)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=96, num_experts=8, num_experts_per_tok=2)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                                     head_dim=16, sliding_window=32,
                                     rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="mixtral")
    parser.add_argument("--experts-implementation", default="tutel",
                        help='"tutel" (default), or one of transformers\' own ("eager", "grouped_mm") to compare')
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64, help="characters per training sequence")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=25, help="print the mean loss every N steps")
    parser.add_argument("--output-dir", default="transformers_moe_out", help="where the loss plot is written")
    parser.add_argument("--prompt", default="The river ")
    parser.add_argument("--generate", type=int, default=200, help="characters to write after training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.log_every < 1 or args.seq_len < 2 or args.batch_size < 1:
        parser.error("--steps, --log-every and --batch-size must be >= 1 and --seq-len >= 2")
    return args


class CharVocabulary:
    """Characters of the text <-> token ids (after PAD and BOS)."""

    def __init__(self, text: str):
        self.chars = sorted(set(text))
        self.index = {c: i + SPECIALS for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars) + SPECIALS

    def encode(self, text: str) -> List[int]:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters not in the training text: {unknown}")
        return [self.index[c] for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i - SPECIALS] for i in ids if i >= SPECIALS)


def build_model(family: str, vocab_size: int, experts_implementation: str, max_len: int) -> torch.nn.Module:
    """A randomly initialised causal LM of `family` whose experts run with `experts_implementation`."""
    import transformers
    if experts_implementation == "tutel":
        import tutel.integrations.transformers  # noqa: F401  (registers "tutel")
    class_name, options = FAMILIES[family]
    config = getattr(transformers, class_name)(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_len, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=None,
        tie_word_embeddings=True, **options)
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation=experts_implementation)


def batches(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator):
    """Endless random windows of the text, each starting with BOS: (inputs, labels) [B, seq_len]."""
    while True:
        starts = torch.randint(0, len(data) - seq_len, (batch_size,), generator=generator)
        windows = torch.stack([data[s:s + seq_len - 1] for s in starts.tolist()])
        yield torch.cat([torch.full((batch_size, 1), BOS, dtype=windows.dtype), windows], dim=1)


def progress(steps: int, enabled: bool) -> Iterable[int]:
    """range(steps), under a tqdm progress bar when `enabled` and tqdm is installed."""
    if enabled:
        try:
            from tqdm import tqdm
            return tqdm(range(steps), desc="training", unit="step")
        except ImportError:
            print("tqdm is not installed: no progress bar (pip install tqdm)", flush=True)
    return range(steps)


def train(model: torch.nn.Module, data: torch.Tensor, args) -> List[float]:
    """AdamW with a short warm-up and cosine decay; returns the loss of every step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(step, args.steps) / args.steps))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    generator = torch.Generator().manual_seed(args.seed)
    stream = batches(data, args.batch_size, args.seq_len, generator)
    losses: List[float] = []
    model.train()
    bar = progress(args.steps, not args.no_progress)
    for step in bar:
        ids = next(stream).to(args.device)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            recent = losses[-args.log_every:]
            message = f"step {step + 1}/{args.steps}  loss {sum(recent) / len(recent):.4f}"
            if hasattr(bar, "write"):
                bar.write(message)  # above the progress bar
            else:
                print(message, flush=True)
    return losses


def save_plot(losses: Sequence[float], path: str, title: str) -> bool:
    """The loss per step and its running mean, as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    window = max(1, len(losses) // 30)
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
              for i in range(len(losses))]
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(range(1, len(losses) + 1), losses, alpha=0.35, label="loss per step")
    axis.plot(range(1, len(losses) + 1), smooth, label=f"mean of {window} steps")
    axis.set_xlabel("step")
    axis.set_ylabel("cross-entropy (nats per character)")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)
    return True


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with open(DATA, encoding="utf-8") as handle:
        text = handle.read()
    vocabulary = CharVocabulary(text)
    data = torch.tensor(vocabulary.encode(text), dtype=torch.long)
    model = build_model(args.family, len(vocabulary), args.experts_implementation, args.seq_len + args.generate + 64)
    model.to(args.device)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{type(model).__name__}: {parameters / 1e6:.2f} M parameters, experts_implementation="
          f"{model.config._experts_implementation!r}, {len(text)} characters of text, {len(vocabulary)} tokens",
          flush=True)
    started = time.perf_counter()
    losses = train(model, data, args)
    head, tail = losses[:args.log_every], losses[-args.log_every:]
    print(f"loss: first {args.log_every} steps {sum(head) / len(head):.4f}, last {args.log_every} steps "
          f"{sum(tail) / len(tail):.4f} ({time.perf_counter() - started:.1f} s)", flush=True)
    os.makedirs(args.output_dir, exist_ok=True)
    plot = os.path.join(args.output_dir, "transformers_moe_loss.png")
    if save_plot(losses, plot, f"{type(model).__name__}, experts_implementation={args.experts_implementation}"):
        print(f"loss curve written to {plot}", flush=True)
    else:
        print("matplotlib is not installed: no loss curve (pip install matplotlib)", flush=True)
    if args.generate > 0:
        model.eval()
        prompt = torch.tensor([[BOS] + vocabulary.encode(args.prompt)], device=args.device)
        torch.manual_seed(args.seed)  # the same text for the same run
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=args.generate, do_sample=True, temperature=0.8, top_k=20,
                                 pad_token_id=PAD)
        print("generated:\n" + vocabulary.decode(out[0].tolist()[1:]), flush=True)


if __name__ == "__main__":
    main()

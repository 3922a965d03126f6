"""Training an image classifier whose head is an MoE layer (shared by moe_mnist and moe_cifar10).

The flags, the printed lines and the optimiser follow Tutel's examples (themselves PyTorch's
MNIST example): Adadelta with a StepLR schedule, ``Train Epoch: ...`` every ``--log-interval``
batches, ``Test set: Validate Accuracy: (Top-1) x%, ...`` after every epoch (the test set is
evaluated with several top-k values) and ``Peak validation accuracy = x%`` at the end.  Besides:
a tqdm progress bar over each epoch's batches (when stderr is a terminal, or with
``--progress``), messages through the logging module, and a PNG of the loss curve (with
matplotlib, when installed).
"""
import argparse
import logging
import os
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F

logger = logging.getLogger("tutel.examples")


def setup_logging() -> None:
    """Warnings from everything, progress messages from the examples."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logger.setLevel(logging.INFO)


@dataclass
class Dataset:
    """Images [N, C, H, W] (float, normalised) and labels [N] (int64) of one split."""

    images: torch.Tensor
    labels: torch.Tensor


def add_training_flags(parser: argparse.ArgumentParser, epochs: int, plot: str) -> None:
    """Tutel's example flags, plus the MoE and output options of these examples."""
    parser.add_argument("--batch-size", type=int, default=64, help="training batch size")
    parser.add_argument("--test-batch-size", type=int, default=1000, help="evaluation batch size")
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--lr", type=float, default=1.0, help="Adadelta learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, help="StepLR decay per epoch")
    parser.add_argument("--dry-run", action="store_true", default=False, help="one batch per epoch")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10, help="batches between `Train Epoch` lines")
    parser.add_argument("--no-moe", action="store_true", default=False, help="a dense feed-forward head instead")
    parser.add_argument("--num-local-experts", type=int, default=4, help="experts per process")
    parser.add_argument("--l-aux-wt", type=float, default=0.01, help="weight of the load-balancing loss")
    parser.add_argument("--device", type=str, default="cuda" if torch.cuda.is_available() else "cpu",
                        choices=["cpu", "cuda"])
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="intra-op threads on the CPU (these small models run fastest on one)")
    parser.add_argument("--progress", action="store_true", default=False,
                        help="show a progress bar even when stderr is not a terminal")
    parser.add_argument("--plot", type=str, default=plot, help="loss-curve PNG to write ('' for none)")


class MoEHead(torch.nn.Module):
    """features -> MoE layer (top-1, dropless, noisy gate; each expert an MLP with dropout) -> log-probs."""

    def __init__(self, model_dim: int, hidden: int, classes: int, args, seed: int):
        super().__init__()
        from tutel import moe
        self.use_moe = not args.no_moe
        if self.use_moe:
            self.moe = moe.moe_layer(
                gate_type={"type": "top", "k": 1, "capacity_factor": 0.0, "gate_noise": 1.0},
                model_dim=model_dim,
                experts={"type": "ffn", "num_experts_per_device": args.num_local_experts,
                         "hidden_size_per_expert": hidden, "output_dim": classes,
                         "activation_fn_with_self": lambda x, experts: F.dropout(F.relu(x), 0.2, experts.training)},
                scan_expert_func=lambda name, param: setattr(param, "skip_allreduce", True),
                seeds=(1, seed, 1))
        else:
            self.dense = torch.nn.Sequential(torch.nn.Linear(model_dim, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                             torch.nn.Linear(hidden, classes))

    def forward(self, features: torch.Tensor, top_k: Optional[int] = None) -> torch.Tensor:
        if not self.use_moe:
            return F.log_softmax(self.dense(features), dim=1)
        return F.log_softmax(self.moe(features, top_k=top_k), dim=1)

    def aux_loss(self) -> torch.Tensor:
        return self.moe.l_aux if self.use_moe else torch.zeros(())

    def eval_top_ks(self) -> List[int]:
        """The top-k values the test set is evaluated with: 1, 2, 8 (at most the expert count)."""
        if not self.use_moe:
            return [1]
        return sorted({min(k, self.moe.num_global_experts) for k in (1, 2, 8)})


class Classifier(torch.nn.Module):
    def __init__(self, trunk: torch.nn.Module, head: MoEHead):
        super().__init__()
        self.trunk, self.head = trunk, head

    def forward(self, images: torch.Tensor, top_k: Optional[int] = None) -> torch.Tensor:
        return self.head(self.trunk(images).flatten(1), top_k=top_k)


def _progress(iterable, total: int, description: str, force: bool):
    """tqdm over `iterable` when stderr is a terminal (or `force`) and tqdm is installed."""
    if not (force or sys.stderr.isatty()):
        return iterable
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=description, leave=False)


def _batches(data: Dataset, batch_size: int, shuffle: bool, generator: Optional[torch.Generator], rank: int = 0,
             world_size: int = 1):
    """(images, labels) batches; with several processes each takes every world_size-th batch."""
    order = torch.randperm(len(data.labels), generator=generator) if shuffle else torch.arange(len(data.labels))
    starts = list(range(0, len(order), batch_size))[rank::world_size]
    return [(data.images[order[s:s + batch_size]], data.labels[order[s:s + batch_size]]) for s in starts]


def evaluate(model: Classifier, data: Dataset, batch_size: int, device) -> List[float]:
    """Test accuracy (%) for each of the head's evaluation top-k values."""
    model.eval()
    accuracies = []
    with torch.no_grad():
        for top_k in model.head.eval_top_ks():
            correct = 0
            for images, labels in _batches(data, batch_size, False, None):
                prediction = model(images.to(device), top_k=top_k).argmax(dim=1)
                correct += int((prediction == labels.to(device)).sum())
            accuracies.append(100.0 * correct / len(data.labels))
    return accuracies


def save_loss_curve(path: str, losses: Sequence[float], accuracies: Sequence[float], title: str) -> None:
    """Training loss per batch and Top-1 test accuracy per epoch, as a PNG (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: the loss curve is not drawn (pip install matplotlib)")
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(range(1, len(losses) + 1), losses)
    left.set_xlabel("batch")
    left.set_ylabel("training loss (NLL)")
    left.set_yscale("log")
    right.plot(range(1, len(accuracies) + 1), accuracies, marker="o")
    right.set_xlabel("epoch")
    right.set_ylabel("test accuracy, top-1 (%)")
    figure.suptitle(title)
    figure.tight_layout()
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    figure.savefig(path, dpi=80)
    plt.close(figure)
    logger.info("loss curve written to %s", path)


def train(args, build_trunk: Callable[[], torch.nn.Module], feature_dim: int, hidden: int, classes: int,
          train_data: Dataset, test_data: Dataset, title: str) -> float:
    """Trains and evaluates every epoch; returns the peak Top-1 test accuracy (%)."""
    from tutel import system
    from tutel.examples._common import average_gradients, shared_parameters
    parallel = system.init_data_model_parallel(backend="nccl" if args.device == "cuda" else "gloo")
    device, rank, world = parallel.local_device, parallel.global_rank, parallel.global_size
    if device.type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    torch.manual_seed(args.seed)
    model = Classifier(build_trunk(), MoEHead(feature_dim, hidden, classes, args, seed=rank + 1)).to(device)
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    shared = shared_parameters(model)
    generator = torch.Generator().manual_seed(args.seed)
    losses: List[float] = []
    accuracies: List[float] = []
    peak = 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        batches = _batches(train_data, args.batch_size, True, generator, rank, world)
        if args.dry_run:
            batches = batches[:1]
        seen = correct = 0
        total = len(train_data.labels)
        for index, (images, labels) in enumerate(_progress(batches, len(batches), f"epoch {epoch}", args.progress)):
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            output = model(images)
            loss = F.nll_loss(output, labels)
            (loss + args.l_aux_wt * model.head.aux_loss()).backward()
            average_gradients(shared, world)
            optimizer.step()
            losses.append(loss.item())
            seen += len(labels)
            correct += int((output.argmax(dim=1) == labels).sum())
            if index % args.log_interval == 0 or index == len(batches) - 1:
                parallel.dist_print("Train Epoch: %d [%d/%d (%.0f%%)]\tLoss: %.6f\tTrain Accuracy: %d/%d (%.2f%%)" % (
                    epoch, min(index * args.batch_size * world + len(labels), total), total,
                    100.0 * (index + 1) / len(batches), loss.item(), correct, seen, 100.0 * correct / seen))
        scheduler.step()
        results = evaluate(model, test_data, args.test_batch_size, device)
        accuracies.append(results[0])
        peak = max(peak, results[0])
        parallel.dist_print("\nTest set: Validate Accuracy: " + ", ".join(
            "(Top-%d) %.2f%%" % (k, value) for k, value in zip(model.head.eval_top_ks(), results)) + "\n")
    parallel.dist_print("Peak validation accuracy = %.2f%%" % peak)
    if args.plot and rank == 0:
        save_loss_curve(args.plot, losses, accuracies, title)
    return peak

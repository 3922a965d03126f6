"""Trains a convolutional classifier with an MoE head on CIFAR-10.

    python3 -m tutel.examples.moe_cifar10 --data-dir ~/data

--data-dir holds CIFAR-10's "python version" (cifar-10-python.tar.gz from
https://www.cs.toronto.edu/~kriz/cifar.html, extracted): the pickled batches data_batch_1 ..
data_batch_5 and test_batch, in the directory itself or in its cifar-10-batches-py/.
Nothing is downloaded: without the files the script says where to get them and stops.
"""
import argparse
import os
import pickle
from typing import List, Optional, Tuple

import numpy
import torch

from tutel.examples._classifier import Dataset, add_training_flags, logger, setup_logging, train

TRAIN_BATCHES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_BATCH = "test_batch"
WHERE = ("CIFAR-10 is not in {directory}: download the \"CIFAR-10 python version\" (cifar-10-python.tar.gz) from "
         "https://www.cs.toronto.edu/~kriz/cifar.html and extract it there (tar xzf cifar-10-python.tar.gz -C "
         "{directory}), which creates {directory}/cifar-10-batches-py/ with data_batch_1..5 and test_batch")
# Per-channel mean and standard deviation of the CIFAR-10 training images.
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_flags(parser, epochs=20, plot="moe_cifar10_loss.png")
    parser.add_argument("--data-dir", type=str, default="./data", help="directory with CIFAR-10's python batches")
    return parser.parse_args(argv)


def batch_directory(directory: str) -> str:
    """The folder holding the batches: `directory` or its cifar-10-batches-py/; SystemExit saying
    where to get them when neither has them."""
    for folder in (os.path.join(directory, "cifar-10-batches-py"), directory):
        if all(os.path.exists(os.path.join(folder, name)) for name in TRAIN_BATCHES[:1] + [TEST_BATCH]):
            return folder
    raise SystemExit(WHERE.format(directory=directory))


def read_batch(path: str) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """One pickled batch: b'data' [N, 3072] uint8 (1024 red, 1024 green, 1024 blue values of a 32x32
    image, row by row) and b'labels' (N ints in 0..9)."""
    with open(path, "rb") as handle:
        batch = pickle.load(handle, encoding="bytes")
    data = numpy.asarray(batch[b"data"], dtype=numpy.uint8)
    labels = numpy.asarray(batch[b"labels"], dtype=numpy.int64)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or len(labels) != len(data):
        raise ValueError(f"{path}: expected data [N, 3072] and N labels, got {data.shape} and {labels.shape}")
    return data.reshape(-1, 3, 32, 32), labels


def _dataset(paths: List[str]) -> Dataset:
    parts = [read_batch(path) for path in paths]
    images = torch.from_numpy(numpy.concatenate([p[0] for p in parts])).float() / 255.0
    images = (images - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)
    return Dataset(images, torch.from_numpy(numpy.concatenate([p[1] for p in parts])))


def load_cifar10(directory: str) -> Tuple[Dataset, Dataset]:
    folder = batch_directory(directory)
    present = [name for name in TRAIN_BATCHES if os.path.exists(os.path.join(folder, name))]
    if len(present) < len(TRAIN_BATCHES):
        logger.warning("only %s of the 5 training batches are in %s", ", ".join(present), folder)
    return _dataset([os.path.join(folder, name) for name in present]), _dataset([os.path.join(folder, TEST_BATCH)])


def build_trunk() -> torch.nn.Module:
    """Two 3x3 convolutions, each followed by a 2x2 max-pool: 32x32x3 -> 64x6x6 = 2304 features."""
    return torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                               torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Dropout(0.25))


def main(argv=None) -> Optional[float]:
    setup_logging()
    args = parse_args(argv)
    train_data, test_data = load_cifar10(args.data_dir)
    logger.info("CIFAR-10: %d training and %d test images", len(train_data.labels), len(test_data.labels))
    return train(args, build_trunk, 2304, 512, 10, train_data, test_data, "moe_cifar10")


if __name__ == "__main__":
    main()

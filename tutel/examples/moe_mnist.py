"""Trains a convolutional classifier with an MoE head on handwritten digits.

    python3 -m tutel.examples.moe_mnist                       # scikit-learn's 8x8 digits, no download
    python3 -m tutel.examples.moe_mnist --mnist-dir ~/mnist   # a local copy of MNIST (IDX files)
    python3 -m torch.distributed.run --nproc_per_node=2 -m tutel.examples.moe_mnist --device cpu

Without --mnist-dir it uses the 1,797 8x8 digit images bundled with scikit-learn
(sklearn.datasets.load_digits), 80% for training and a fixed 20% (360 images) for testing.
With --mnist-dir it reads the four MNIST IDX files (train-images-idx3-ubyte,
train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, optionally
.gz), from that directory or its MNIST/raw/ (torchvision's layout).
"""
import argparse
import gzip
import logging
import os
from typing import Optional, Tuple

import numpy
import torch

from tutel.examples._classifier import Dataset, add_training_flags, setup_logging, train

logger = logging.getLogger("tutel.examples")

MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_training_flags(parser, epochs=20, plot="moe_mnist_loss.png")
    parser.add_argument("--mnist-dir", type=str, default=None, help="directory with the MNIST IDX files")
    return parser.parse_args(argv)


def _read_idx(path: str) -> numpy.ndarray:
    """An IDX file (the MNIST format): magic (0, 0, type 0x08, dims), sizes, then uint8 data."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(dims))
    data = numpy.frombuffer(raw, dtype=numpy.uint8, offset=4 + 4 * dims)
    if data.size != int(numpy.prod(shape)):
        raise ValueError(f"{path}: header says {shape} but the file holds {data.size} values")
    return data.reshape(shape)


def _find(directory: str, name: str) -> str:
    for folder in (directory, os.path.join(directory, "MNIST", "raw")):
        for candidate in (name, name + ".gz"):
            if os.path.exists(os.path.join(folder, candidate)):
                return os.path.join(folder, candidate)
    raise FileNotFoundError(f"{name}[.gz] is not in {directory} (nor in {directory}/MNIST/raw)")


def _normalise(images: numpy.ndarray, scale: float) -> torch.Tensor:
    tensor = torch.from_numpy(images.astype(numpy.float32) / scale).unsqueeze(1)
    return (tensor - 0.1307) / 0.3081  # MNIST's mean and standard deviation, as in PyTorch's example


def load_mnist(directory: str) -> Tuple[Dataset, Dataset]:
    splits = []
    for split in ("train", "test"):
        images_file, labels_file = (_find(directory, name) for name in MNIST_FILES[split])
        images, labels = _read_idx(images_file), _read_idx(labels_file)
        splits.append(Dataset(_normalise(images, 255.0), torch.from_numpy(labels.astype(numpy.int64))))
    return splits[0], splits[1]


def load_digits(seed: int = 0) -> Tuple[Dataset, Dataset]:
    """scikit-learn's 8x8 digits (values 0..16): a fixed 80/20 split."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError:
        raise SystemExit("moe_mnist needs scikit-learn for its bundled digits: install tutel's examples extra "
                         "(pip install --no-build-isolation \".[examples]\" in the tutel checkout) or "
                         "pip install scikit-learn; or give a local MNIST copy: --mnist-dir DIR") from None
    digits = sklearn_digits()
    images = _normalise(digits.images, 16.0)
    labels = torch.from_numpy(digits.target.astype(numpy.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    test_count = len(labels) // 5
    test, training = order[:test_count], order[test_count:]
    return Dataset(images[training], labels[training]), Dataset(images[test], labels[test])


def build_trunk() -> torch.nn.Module:
    """Two 3x3 convolutions and a 2x2 max-pool (28x28 MNIST -> 9216 features, 8x8 digits -> 256)."""
    return torch.nn.Sequential(torch.nn.Conv2d(1, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),
                               torch.nn.MaxPool2d(2), torch.nn.Dropout(0.25))


def main(argv=None) -> Optional[float]:
    setup_logging()
    args = parse_args(argv)
    if args.mnist_dir:
        train_data, test_data = load_mnist(args.mnist_dir)
        source = f"MNIST from {args.mnist_dir}"
    else:
        train_data, test_data = load_digits()
        source = "scikit-learn's 8x8 digits"
    side = train_data.images.shape[-1]
    features = 64 * ((side - 4) // 2) ** 2
    logger.info("%s: %d training and %d test images of %dx%d", source, len(train_data.labels),
                len(test_data.labels), side, side)
    return train(args, build_trunk, features, 128, 10, train_data, test_data, f"moe_mnist ({source})")


if __name__ == "__main__":
    main()

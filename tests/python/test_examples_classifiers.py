"""moe_mnist and moe_cifar10 learn, print Tutel's lines, read their data formats and draw the loss curve."""
import gzip
import importlib.util
import logging
import os
import pickle
import re
import subprocess
import sys

import numpy

from install_checks import require

TRAIN = re.compile(r"^Train Epoch: (\d+) \[(\d+)/(\d+) \((\d+)%\)\]\tLoss: ([0-9.]+)\tTrain Accuracy: (\d+)/(\d+) "
                   r"\(([0-9.]+)%\)$", re.M)
TEST = re.compile(r"^Test set: Validate Accuracy: ((?:\(Top-\d+\) [0-9.]+%(?:, )?)+)$", re.M)
PEAK = re.compile(r"^Peak validation accuracy = ([0-9.]+)%$", re.M)
PNG = b"\x89PNG\r\n\x1a\n"


def _run(module, *args, cwd=None):
    result = subprocess.run([sys.executable, "-m", f"tutel.examples.{module}", "--device", "cpu", *args],
                            capture_output=True, text=True, timeout=300, cwd=cwd,
                            env=dict(os.environ, PYTHONPATH=os.getcwd()))
    return result


def test_moe_mnist_without_scikit_learn_names_the_examples_extra(tmp_path):
    """Without scikit-learn, moe_mnist says how to get it: the `examples` extra that setup.py declares."""
    blocked = ("import runpy, sys; sys.modules['sklearn'] = None; sys.argv = ['moe_mnist', '--device', 'cpu']; "
               "runpy.run_module('tutel.examples.moe_mnist', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path, env=dict(os.environ, PYTHONPATH=os.getcwd()))
    assert result.returncode != 0 and 'pip install --no-build-isolation ".[examples]"' in result.stderr, result.stderr
    setup_py = open(os.path.join(os.path.dirname(__file__), "..", "..", "setup.py")).read()
    match = re.search(r'extras_require=\{"examples": \[([^\]]*)\]', setup_py)
    assert match and '"scikit-learn' in match.group(1), "setup.py must declare the examples extra"


def test_moe_mnist_learns_the_bundled_digits(tmp_path):
    require(importlib.util.find_spec("sklearn") is not None, "scikit-learn", "pip install '.[examples]'")
    plot = tmp_path / "curve.png"
    result = _run("moe_mnist", "--epochs", "6", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    tests = TEST.findall(result.stdout)
    assert len(tests) == 6 and all(line.startswith("(Top-1) ") for line in tests), result.stdout
    assert "(Top-2)" in tests[0] and "(Top-4)" in tests[0]  # 4 experts: top-8 is evaluated as top-4
    assert float(PEAK.search(result.stdout).group(1)) >= 95.0, result.stdout
    train = TRAIN.findall(result.stdout)
    assert train and {int(t[2]) for t in train} == {1438} and train[-1][1] == "1438"
    assert "scikit-learn's 8x8 digits: 1438 training and 359 test images" in result.stderr
    assert plot.read_bytes()[:8] == PNG


def _write_idx(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "wb") as handle:
        handle.write(header + array.astype(numpy.uint8).tobytes())


def test_moe_mnist_reads_a_local_mnist_copy(tmp_path):
    rng = numpy.random.default_rng(0)
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    _write_idx(raw / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (40, 28, 28)))
    _write_idx(raw / "train-labels-idx1-ubyte", rng.integers(0, 10, (40,)))
    _write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (12, 28, 28)))
    _write_idx(raw / "t10k-labels-idx1-ubyte.gz", rng.integers(0, 10, (12,)))
    result = _run("moe_mnist", "--mnist-dir", str(tmp_path), "--epochs", "2", "--batch-size", "16", "--no-moe",
                  "--plot", "", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "MNIST from %s: 40 training and 12 test images of 28x28" % tmp_path in result.stderr
    assert len(TEST.findall(result.stdout)) == 2 and PEAK.search(result.stdout)
    assert not list(tmp_path.glob("*.png"))


def _write_cifar(folder, count, rng):
    folder.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (count, 3072)).astype(numpy.uint8),
                 b"labels": rng.integers(0, 10, count).tolist(), b"batch_label": name.encode()}
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle)


def test_moe_cifar10_reads_the_python_batches(tmp_path):
    _write_cifar(tmp_path / "cifar-10-batches-py", 8, numpy.random.default_rng(1))
    result = _run("moe_cifar10", "--data-dir", str(tmp_path), "--epochs", "2", "--batch-size", "16",
                  "--log-interval", "1", "--progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "CIFAR-10: 40 training and 8 test images" in result.stderr
    train = TRAIN.findall(result.stdout)
    assert [(t[0], t[1], t[2]) for t in train] == [("1", "16", "40"), ("1", "32", "40"), ("1", "40", "40"),
                                                   ("2", "16", "40"), ("2", "32", "40"), ("2", "40", "40")]
    assert len(TEST.findall(result.stdout)) == 2 and PEAK.search(result.stdout)
    assert "epoch 1" in result.stderr  # the progress bar
    assert (tmp_path / "moe_cifar10_loss.png").read_bytes()[:8] == PNG


def test_moe_cifar10_says_where_to_get_the_data(tmp_path):
    result = _run("moe_cifar10", "--data-dir", str(tmp_path / "nothing"))
    assert result.returncode == 1
    assert "cifar-10-python.tar.gz" in result.stderr and "https://www.cs.toronto.edu/~kriz/cifar.html" in result.stderr


def test_loss_curve_is_skipped_without_matplotlib(tmp_path, monkeypatch, caplog):
    from tutel.examples import _classifier
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with caplog.at_level(logging.WARNING, logger="tutel.examples"):
        _classifier.save_loss_curve(str(tmp_path / "curve.png"), [1.0, 0.5], [50.0], "title")
    assert "matplotlib is not installed" in caplog.text and not (tmp_path / "curve.png").exists()

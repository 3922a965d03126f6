#!/usr/bin/env bash
# Sets up what the demo needs (tests/setup_build.sh: PyTorch's CPU build if none is installed, a C++
# compiler, ninja, numpy, scikit-learn and matplotlib), builds tutel in place and trains a classifier
# with an MoE head on scikit-learn's bundled handwritten digits, on the CPU: the test accuracy printed
# after every epoch climbs past 95%.  Durations: README.md.  The test tools come with tests/run_all.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/setup_build.sh
python3 -m tutel.examples.moe_mnist --device cpu --epochs 10 --plot build/demo/moe_mnist_loss.png "$@"

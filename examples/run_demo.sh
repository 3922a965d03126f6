#!/usr/bin/env bash
# Sets up this machine (PyTorch CPU build, compiler tools, scikit-learn), builds tutel in place and
# trains a classifier with an MoE head on scikit-learn's bundled handwritten digits, on the CPU:
# the test accuracy printed after every epoch climbs past 95% (about half a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/setup_env.sh
python3 -m tutel.examples.moe_mnist --device cpu --epochs 10 --plot build/demo/moe_mnist_loss.png "$@"

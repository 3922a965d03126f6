#!/usr/bin/env bash
# Sets up this machine (PyTorch CPU build, compiler tools), builds tutel in place and trains a
# small MoE model on the CPU: the loss printed at every step falls.
set -euo pipefail
cd "$(dirname "$0")/.."
source tests/setup_env.sh
python3 -m tutel.examples.helloworld --device cpu --batch_size 8 --num_tokens 256 --model_dim 512 \
  --hidden_size 1024 --num_local_experts 4 --top 2 --num_steps 20 "$@"

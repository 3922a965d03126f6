#!/usr/bin/env bash
# Trains transformer_lm_gpt2_tiny on WikiText-103 with tutel MoE layers in every MOE-th decoder
# layer, on the GPUs of one host (see README.md for the setup).
#
#   MOE=2 L_AUX_WT=0.01 bash run_fairseq.sh            # FP16=1 trains in fp16 (NO_OVERFLOW=1 also zeroes inf grads)
set -euo pipefail
DATA="${DATA:-data-bin/wikitext-103}"
GPUS="${GPUS:-8}"
export MOE="${MOE:-2}" L_AUX_WT="${L_AUX_WT:-0.01}"
FP16_FLAGS=()
if [ "${FP16:-0}" = "1" ]; then
  FP16_FLAGS=(--fp16 --fp16-init-scale 4 --fp16-scale-window 256)
fi
# legacy_ddp: fairseq's legacy DDP leaves parameters marked `expert` out of the all-reduce.
python3 -m torch.distributed.run --nproc_per_node="${GPUS}" "$(command -v fairseq-train)" "${DATA}" \
  --ddp-backend legacy_ddp --task language_modeling --tokens-per-sample 256 --batch-size 8 \
  --arch transformer_lm_gpt2_tiny --optimizer adam --adam-betas "(0.9,0.98)" --lr 0.0001 \
  --lr-scheduler polynomial_decay --warmup-updates 4000 --max-update 100000 --log-format simple \
  --log-interval 100 "${FP16_FLAGS[@]}" "$@"

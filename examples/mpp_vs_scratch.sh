#!/usr/bin/env bash
# Masked patch prediction at demo scale (paper Appendix B.1.2).
#
# Pre-trains the demo ViT on the built-in digits without their labels, then
# fine-tunes it with the normal fine-tune config (configs/finetune.py: SGD,
# momentum 0.9, cosine, clipping at 1) on 10% and on all of the labels, and
# fine-tunes the same model from scratch the same way. Prints the test
# accuracies (all 359 test digits).
#
#   bash examples/mpp_vs_scratch.sh [OUT_DIR]
set -euo pipefail
out=${1:-workdirs/mpp_vs_scratch}
demo_scale=(--config.pp.crop=16 --config.batch=128 --config.batch_eval=512
            --config.dtype=float32 --config.total_steps=500 --config.warmup_steps=50
            --config.progress_every=100 --config.eval_every=500 --config.checkpoint_every=500)

python -m vit_jax.main --config=configs/mpp_demo.py --workdir="$out/mpp"
for labels in 10% 100%; do
  for start in mpp scratch; do
    pretrained=$([ "$start" = mpp ] && echo "$out/mpp" || echo "")
    python -m vit_jax.main --config=configs/finetune.py:ViT-Demo_4,digits \
        --workdir="$out/${start}_${labels%\%}" --config.pretrained_path="$pretrained" \
        --config.pp.train="train[:$labels]" "${demo_scale[@]}"
  done
done

python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
mpp = json.load(open(f'{out}/mpp/summary.json'))
print(f"MPP pre-training: colour accuracy of corrupted patches {mpp['test_accuracy']:.4f}")
print('labels  from MPP  from scratch')
for labels in ('10', '100'):
  acc = [json.load(open(f'{out}/{s}_{labels}/summary.json'))['test_accuracy']
         for s in ('mpp', 'scratch')]
  print(f'{labels:>5}%  {acc[0]:8.4f}  {acc[1]:12.4f}')
PY

export PYTHONPATH=$PWD
for s in ddp ddp-bucketed zero1 zero2 zero3; do
  timeout 100 torchrun --nproc-per-node 1 scripts/gpu_precision.py --backend nccl --stages $s 2>/tmp/e1 >> $OUT/results.jsonl || tail -3 /tmp/e1
  timeout 100 torchrun --nproc-per-node 2 scripts/gpu_precision.py --backend gloo --stages $s 2>/tmp/e2 >> $OUT/results.jsonl || tail -3 /tmp/e2
done
wc -l $OUT/results.jsonl

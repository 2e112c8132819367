#!/usr/bin/env bash
# Issue 19's GPU runs, one device call per step (run from the repo root on the device machine; $OUT is
# the folder that comes back). Prepare here once:
#   bash ../shared/gpu-relay/split-embedded-model.sh      # .relay-a/ .relay-b/ (the embedded GGUF, two halves)
#   .whl/gguf-*.whl                                        # as in the device README (pure Python)
#
#   call 1  carry [.relay-a]               bash bench/eagle_gpu.sh relay-a
#   call 2  carry [.relay-b, .whl]         bash bench/eagle_gpu.sh distill     (right after call 1: ~30 s)
#   call 3  carry [.whl]                   bash bench/eagle_gpu.sh resume      (right after call 2)
#   any     carry [.whl]                   bash bench/eagle_gpu.sh lossless | cost
#
# distill/resume keep their state in /root/distill on the warm machine and copy the head, its logs
# and distill.json/eval.json to $OUT/smollm2-eagle after each call; `resume` also evaluates the head
# against ngram on bench/prompts/draft_acceptance.jsonl (held out: training uses the target's own
# sampled requests), temperature 0, k = 4.
set -euo pipefail
export PYTHONPATH="$PWD/services${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/out}"
GGUF=/root/relay/SmolLM2-135M-Instruct.Q4_1.gguf
HEAD=/root/distill/smollm2-eagle

wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
}

collect() {  # the head, its logs and reports: small files only (checkpoints and data stay on the machine)
  mkdir -p "$OUT/smollm2-eagle"
  for f in config.json model.safetensors distill.json eval.json distill.log; do
    [ -f "$HEAD/$f" ] && cp "$HEAD/$f" "$OUT/smollm2-eagle/"
  done
  ls -la "$OUT/smollm2-eagle"; du -b "$HEAD/model.safetensors" || true
}

# Training settings of the embedded model's head: own lm_head-free head (the target's lm_head is
# shared, frozen, not written) with a 1024-wide MLP, so the file stays under 10 MB in bf16.
DISTILL=(--target "$GGUF" --out "$HEAD" --samples 8000 --gen-tokens 256 --max-len 512 --steps 3000
         --batch-tokens 16384 --lr 5e-4 --warmup 100 --chain-steps 4 --intermediate-size 1024
         --checkpoint-every 250 --eval-every 500 --no-progress --device cuda)

case "${1:-}" in
  relay-a)
    mkdir -p /root/relay && cp .relay-a/part00 /root/relay/ && ls -la /root/relay ;;
  distill)
    cat /root/relay/part00 .relay-b/part01 > "$GGUF"
    (cd /root/relay && sha256sum -c "$OLDPWD/.relay-b/SHA256SUMS")
    wheels
    nvidia-smi --query-gpu=name,memory.total --format=csv
    python3 -m verifypd.cli distill "${DISTILL[@]}" --max-minutes 5 2>&1 | tee -a "$HEAD.log" | tail -40
    cp "$HEAD.log" "$HEAD/distill.log"; collect ;;
  resume)
    wheels
    python3 -m verifypd.cli distill "${DISTILL[@]}" --resume --max-minutes 7 \
      --eval-prompts bench/prompts/draft_acceptance.jsonl --eval-k 4 --eval-tokens 128 2>&1 | tee -a "$HEAD.log" | tail -40
    cp "$HEAD.log" "$HEAD/distill.log"; collect ;;
  lossless)
    wheels
    VERIFYPD_TEST_DEVICE=cuda python3 -m pytest -q -x tests/engine/test_engine_eagle.py \
      tests/engine/test_engine_eagle_chain.py tests/engine/test_engine_distill.py 2>&1 | tail -15 ;;
  cost)
    wheels
    python3 bench/eagle_draft_cost.py --out "$OUT/eagle_draft_cost.json" 2>&1 | tail -30 ;;
  *)
    echo "usage: bash bench/eagle_gpu.sh relay-a|distill|resume|lossless|cost" >&2; exit 2 ;;
esac

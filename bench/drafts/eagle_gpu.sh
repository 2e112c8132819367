#!/usr/bin/env bash
# The EAGLE head's GPU runs on the device machine: training, acceptance, end to end, CUDA tests and cost
# (run from the repo root there; $OUT is the folder that
# comes back). Prepare here once:
#   bash ../shared/gpu-relay/split-embedded-model.sh      # .relay-a/ .relay-b/ (the embedded GGUF, two halves)
#   .whl/gguf-*.whl                                        # as in the device README (pure Python)
#
#   call 1  carry [.relay-a]              bash bench/drafts/eagle_gpu.sh relay-a   (skipped if the GGUF is there)
#   call 2  carry [.relay-b, .whl]        bash bench/drafts/eagle_gpu.sh train     (right after call 1: ~30 s;
#                                         EAGLE_TRAIN_MINUTES=5 E2E_IF_BEFORE=0: ~6 min, no e2e)
#   call 2' carry [.relay-b, .whl]        bash bench/drafts/eagle_gpu.sh measure HEAD_DIR   (acceptance + end to end;
#                                         MIX=1: the head mixed with prompt lookup, eagle+ngram:HEAD_DIR, beside it)
#
# A run longer than one call (the full-length distill of the shipped head, services/verifypd/heads/smollm2_eagle/README.md):
#   call 2  carry [.relay-b, .whl]        EAGLE_SAMPLES=.. EAGLE_STEPS=.. bash bench/drafts/eagle_gpu.sh train-part
#                                         (data + training to EAGLE_TRAIN_MINUTES, a checkpoint; no --fit-steps:
#                                         the schedule spans the calls)
#   call 3  carry [.whl] (right after)    same variables   bash bench/drafts/eagle_gpu.sh resume
#                                         (on to the end; --fit-steps lowers the schedule's end to fit this
#                                         call's EAGLE_TRAIN_MINUTES; then the engine's acceptance, and with
#                                         E2E_IF_BEFORE=N the end-to-end bench if the call is under N s;
#                                         COMPARE_HEAD=DIR measures a second head beside it in both)
#   any     carry [.whl]                  bash bench/drafts/eagle_gpu.sh lossless | cost
#
# `train` (one call, ~9 min): `verifypd distill` for the embedded model (data, training to a time
# budget), the engine's acceptance against ngram on bench/prompts/draft_acceptance.jsonl at
# temperature 0, k = 4 (bench/drafts/eagle_acceptance.py, also the head's eval.json), then end to end
# against --no-speculation at batch 1 and 16 (one JSON) if time is left.
# The head, its logs and the JSONs land in $OUT (small files only; data and checkpoints stay in
# /root/distill on the warm machine, where `resume` continues them).
set -euo pipefail
export PYTHONPATH="$PWD/services${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
GGUF="${EAGLE_GGUF:-/root/relay/SmolLM2-135M-Instruct.Q4_1.gguf}"
HEAD="${EAGLE_HEAD:-/root/distill/smollm2-eagle}"
DEVICE="${EAGLE_DEVICE:-cuda}"
TRAIN_MINUTES="${EAGLE_TRAIN_MINUTES:-5.5}"   # data + training; the eval and the e2e bench come after
START=$SECONDS

wheels() {
  [ -d .whl ] || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
}

have_gguf() { [ -f "$GGUF" ] && (cd "$(dirname "$GGUF")" && sha256sum -c --status "$1"); }

collect() {  # the head, its logs and reports: small files only (checkpoints and data stay on the machine)
  mkdir -p "$OUT/smollm2-eagle"
  for f in config.json model.safetensors distill.json distill_part1.json eval.json distill.log; do
    [ -f "$HEAD/$f" ] && cp "$HEAD/$f" "$OUT/smollm2-eagle/"
  done
  ls -la "$OUT/smollm2-eagle"
}

# The shipped head (services/verifypd/heads/smollm2_eagle/README.md, 2.50 tokens per verify step at k = 4
# on an H200): a 1024-wide MLP over the target's whole vocabulary (its own lm_head, frozen, not written: no
# map), ~8.4 MB in bf16, trained over `train-part` (EAGLE_TRAIN_MINUTES=8.8) + `resume` (6.5: --fit-steps
# ends the schedule at the step that fits, 3,561 there).
# EAGLE_SAMPLES / EAGLE_STEPS / EAGLE_WARMUP / EAGLE_CHAIN_STEPS / EAGLE_REQUESTS / EAGLE_DRAFT_VOCAB: the
# data, the schedule, the vocabulary. Defaults: the shipped head's recipe (`--own-requests seeds` makes
# its prompts bit for bit; the held-out split also holds out every copy of a held-out prompt).
# EAGLE_DRAFT_VOCAB=N (N > 0): the N most frequent tokens of the training data over the target's frozen
# lm_head rows (a d2t map); 0 (default) = the whole vocabulary. Earlier recipes (docs/eagle_results.md):
# 8,192 tokens, EAGLE_DRAFT_VOCAB=8192 with EAGLE_STEPS=5000 over 8.6 + 4.5 minutes (2.39); own chat
# requests of 16 kinds and 8 chain steps, EAGLE_DRAFT_VOCAB=8192 EAGLE_REQUESTS=kinds EAGLE_CHAIN_STEPS=8
# EAGLE_STEPS=3200 (2.22); a 5-minute head, EAGLE_DRAFT_VOCAB=8192 EAGLE_SAMPLES=5000 EAGLE_STEPS=3000
# EAGLE_WARMUP=50 in one `train` call (1.69).
DRAFT_VOCAB="${EAGLE_DRAFT_VOCAB:-0}"
case "$DRAFT_VOCAB" in
  0) VOCAB_ARGS=() ;;
  *[!0-9]*|'') echo "EAGLE_DRAFT_VOCAB must be a whole number (0 = the whole vocabulary), got '$DRAFT_VOCAB'" >&2; exit 2 ;;
  *) VOCAB_ARGS=(--draft-vocab "$DRAFT_VOCAB" --frozen-lm-head) ;;
esac
DISTILL=(--target "$GGUF" --out "$HEAD" --samples "${EAGLE_SAMPLES:-12000}" --own-requests "${EAGLE_REQUESTS:-seeds}"
         --gen-tokens 256 --max-len 512
         --steps "${EAGLE_STEPS:-5000}" --batch-tokens 16384 --lr 8e-4 --warmup "${EAGLE_WARMUP:-100}"
         --chain-steps "${EAGLE_CHAIN_STEPS:-4}" --intermediate-size 1024
         ${VOCAB_ARGS[@]+"${VOCAB_ARGS[@]}"} --loss-rows all --checkpoint-every 250 --eval-every 500 --no-progress
         --device "$DEVICE" ${DISTILL_EXTRA:-})
EVAL=(--eval-prompts bench/prompts/draft_acceptance.jsonl --eval-k 4 --eval-tokens 128)

end_to_end() {  # the trained head against ngram and --no-speculation, batch 1 and 16, one JSON
  # E2E_K: a fixed k for every draft (default: the served adaptive policy)
  python3 bench/drafts/draft_acceptance.py --target "$GGUF" --device "$DEVICE" \
    --drafts "ngram,eagle:$1${COMPARE_HEAD:+,eagle:$COMPARE_HEAD}${MIX:+,eagle+ngram:$1}" \
    --batches "${E2E_BATCHES:-1,16}" --per-family "${E2E_PER_FAMILY:-8}" --max-tokens 128 ${E2E_K:+--k $E2E_K} \
    --out "$OUT/draft_acceptance_eagle_${DEVICE}${E2E_K:+_k$E2E_K}.json" 2>&1 | grep -v '^{' | tail -12
}

acceptance() {  # the engine's tokens per verify step, head against ngram (bench/drafts/eagle_acceptance.py)
  # COMPARE_HEAD: a second head measured in the same run (e.g. smollm2, the shipped one)
  python3 bench/drafts/eagle_acceptance.py --target "$GGUF" --head "$1" ${COMPARE_HEAD:+--head "$COMPARE_HEAD"} ${MIX:+--draft eagle+ngram:$1} \
    --device "$DEVICE" --out "$OUT/eagle_acceptance_${DEVICE}.json" ${ACCEPT_EXTRA:-} 2>&1 | grep '^|'
}  # ACCEPT_EXTRA: e.g. "--per-family 1 --max-tokens 8" for a short check of this script on the CPU

join_gguf() {
  if ! have_gguf "$PWD/.relay-b/SHA256SUMS"; then
    mkdir -p "$(dirname "$GGUF")"; cat /root/relay/part00 .relay-b/part01 > "$GGUF"
    (cd /root/relay && sha256sum -c "$OLDPWD/.relay-b/SHA256SUMS")
  fi
}

case "${1:-}" in
  relay-a)
    if [ "$(stat -c %s "$GGUF" 2>/dev/null)" = 98362432 ]; then echo "GGUF already there (train checks its sum)"; exit 0; fi
    mkdir -p /root/relay && cp .relay-a/part00 /root/relay/ && ls -la /root/relay ;;
  train)
    join_gguf
    wheels
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    mkdir -p "$(dirname "$HEAD")"
    python3 -m verifypd.cli distill "${DISTILL[@]}" --max-minutes "$TRAIN_MINUTES" --fit-steps \
      2>&1 | tee "$HEAD.log" | grep -v "it/s\]" | tail -45 || true
    cp "$HEAD.log" "$HEAD/distill.log" || true
    echo "distill: $((SECONDS - START)) s"
    acceptance "$HEAD" && cp "$OUT/eagle_acceptance_${DEVICE}.json" "$HEAD/eval.json"
    collect
    echo "distill + acceptance: $((SECONDS - START)) s"
    if [ $((SECONDS - START)) -lt "${E2E_IF_BEFORE:-470}" ]; then end_to_end "$HEAD"; else echo "no time left for the e2e bench"; fi
    echo "call: $((SECONDS - START)) s" ;;
  train-part)  # the first call of a longer run: stops at EAGLE_TRAIN_MINUTES with a checkpoint
    join_gguf
    wheels
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
    mkdir -p "$(dirname "$HEAD")"
    python3 -m verifypd.cli distill "${DISTILL[@]}" --max-minutes "$TRAIN_MINUTES" \
      2>&1 | tee "$HEAD.log" | grep -v "it/s\]" | tail -30 || true
    cp "$HEAD.log" "$HEAD/distill.log" || true
    [ -f "$HEAD/distill.json" ] && cp "$HEAD/distill.json" "$HEAD/distill_part1.json"
    collect
    echo "call: $((SECONDS - START)) s" ;;
  resume)  # on to the schedule's end (lowered to fit EAGLE_TRAIN_MINUTES), then the engine's acceptance
    wheels
    python3 -m verifypd.cli distill "${DISTILL[@]}" --resume --max-minutes "$TRAIN_MINUTES" --fit-steps \
      2>&1 | tee -a "$HEAD.log" | grep -v "it/s\]" | tail -30 || true
    cp "$HEAD.log" "$HEAD/distill.log"
    echo "distill: $((SECONDS - START)) s"
    acceptance "$HEAD" && cp "$OUT/eagle_acceptance_${DEVICE}.json" "$HEAD/eval.json"
    collect
    echo "distill + acceptance: $((SECONDS - START)) s"
    # E2E_IF_BEFORE=N: the end-to-end bench too, if the call has run less than N s by now
    if [ $((SECONDS - START)) -lt "${E2E_IF_BEFORE:-0}" ]; then end_to_end "$HEAD"; else echo "no e2e bench"; fi
    echo "call: $((SECONDS - START)) s" ;;
  collect)
    [ -f "$HEAD.log" ] && cp "$HEAD.log" "$HEAD/distill.log"; collect ;;
  measure)  # carry .relay-b right after relay-a (or find the GGUF on the warm machine)
    join_gguf; wheels
    acceptance "${2:?measure HEAD_DIR}"
    end_to_end "$2" ;;
  lossless)
    wheels
    VERIFYPD_TEST_DEVICE=cuda python3 -m pytest -q -x tests/model/test_model_eagle.py \
      tests/model/test_model_eagle_chain.py tests/distill/test_distill_training.py tests/model/test_model_greedy_lossless.py \
      2>&1 | tee "$OUT/eagle_tests_cuda.txt" | tail -15 ;;
  cost)
    wheels
    python3 bench/drafts/eagle_draft_cost.py --out "$OUT/eagle_draft_cost.json" 2>&1 | tail -30 ;;
  print-distill)  # the `verifypd distill` arguments the training calls would use (check a recipe before a GPU call)
    printf '%s\n' "${DISTILL[@]}" ;;
  *)
    echo "usage: bash bench/drafts/eagle_gpu.sh relay-a|train|train-part|resume|collect|measure HEAD|lossless|cost|print-distill" >&2; exit 2 ;;
esac

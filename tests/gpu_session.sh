#!/usr/bin/env bash
# One device call of #38's GPU checks, the most decisive first, each step under its own timeout, results
# under $OUT as they come (a step cut by its timeout keeps what it wrote). On a lent GPU (device tool,
# carry [".gpu"] after `bash tests/gpu_prepare.sh`: the shared kit, completed), from the repository root:
#
#   bash .gpu/run.sh bash tests/gpu_session.sh
#
# Dry run on the CPU first (tiny shapes): DRY=1 TOK=/tmp/tok OUT=/tmp/session bash tests/gpu_session.sh
#
# 1. papers: static and graphed passes against eager in lockstep on every shape (do graphs give static's
#    logits?), then member speeds (eager loop, core single eager / static / graphs, the floor), then SAFE
#    with every draft accepted and every-token, eager and graphed (docs/gpu.md, "At the papers' sizes").
# 2. check: sampled requests (syncs and reads per token now that the draw is made on the device; the same
#    text twice under a seed), 16 concurrent requests to 1B-class members, eager and over the graphed pool
#    (the check's other steps were measured on 2026-12-04: ../shared/gpu/seen-2026-12-04).
# Per-step limits: PAPERS_S, CHECK_S (seconds).
set -u
OUT=${OUT:?set OUT}
TOK=${TOK:-/tmp/g/tok}
PY=${PYTHON:-python3}
DRY=${DRY:+--dry}
mkdir -p "$OUT"
timeout "${PAPERS_S:-330}" "$PY" tests/gpu_papers.py --tokenizers "$TOK" --out "$OUT/papers" --tokens 64 \
  --passes static graphs --check-steps 12 --paths eager core_single \
  --only safe_threshold0_qwen0.5b_qwen7b safe_threshold0_smol135m_llama8b every_token_qwen7b_llama8b $DRY \
  > "$OUT/papers.log" 2>&1
echo "papers: rc=$?"
timeout "${CHECK_S:-200}" "$PY" tests/gpu_check.py --tokenizers "$TOK" --out "$OUT/check" --tokens 64 --reps 3 \
  --passes graphs --only transfers sampling batching batching_graphs $DRY > "$OUT/check.log" 2>&1
echo "check: rc=$?"
tail -c 3000 "$OUT/papers.log"

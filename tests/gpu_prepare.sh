#!/usr/bin/env bash
# Pack .gpu/ for a lent GPU box: the shared kit (../shared/gpu/prepare.sh), completed where it stops.
#
# Why: the kit's tokenizer step imports `ensemble_core.bundled`, which the architecture work moved to
# `ensemble_core.models.bundled`, so it stops after the wheels (ModuleNotFoundError) and leaves .gpu/
# without the tokenizers and run.sh; the kit is read-only here. This runs the kit, then packs what it did
# not: the three bundled tokenizers (`ensemble_core.testing.bundled_tokenizer`) into .gpu/tok.tar.gz and
# the kit's run.sh, and keeps .gpu/ out of git in a worktree too. Use it in place of the kit, from the
# repository root:
#
#   bash tests/gpu_prepare.sh        # then device: carry [".gpu"], bash .gpu/run.sh bash tests/gpu_session.sh
set -euo pipefail  # the kit's own failure is expected and caught below; any other step stops here
[ -f pyproject.toml ] && [ -d ensemble_core ] || { echo "run from the repository root" >&2; exit 2; }
kit=${GPU_KIT:-../shared/gpu}
py=${PYTHON:-.venv/bin/python}
PYTHON="$py" bash "$kit/prepare.sh" || echo "the kit stopped (rc=$?): completing .gpu/ here"
ls .gpu/whl/*.whl > /dev/null 2>&1 || { echo "no wheels in .gpu/whl: the kit's download failed" >&2; exit 1; }
if [ ! -f .gpu/tok.tar.gz ]; then
  rm -rf .gpu/tok && mkdir -p .gpu/tok
  "$py" - .gpu/tok <<'PY'
import sys
from pathlib import Path

from ensemble_core.testing import bundled_tokenizer  # converts the bundled model once if needed

out = Path(sys.argv[1])
for folder, alias in (("smol", "smollm2-135m-instruct"), ("gemma", "gemma3-270m"),
                      ("qwen", "qwen2.5-coder-0.5b-instruct")):
    bundled_tokenizer(alias).save_pretrained(out / folder)
PY
  tar -czf .gpu/tok.tar.gz -C .gpu tok
  rm -rf .gpu/tok
fi
[ -f .gpu/run.sh ] || cp "$kit/run.sh" .gpu/run.sh
exclude=$(git rev-parse --git-path info/exclude)  # also in a worktree, whose .git is a file (the kit's mkdir fails)
mkdir -p "$(dirname "$exclude")" && { grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"; }
du -sh .gpu
ls .gpu

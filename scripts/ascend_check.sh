#!/usr/bin/env bash
# Run the ascend backend's tests on a machine with a Huawei Ascend NPU (the CANN toolkit
# installed and its set_env.sh sourced, so that libascendcl.so is found), against the real
# runtime instead of the simulated one, and write a report.
#
#   scripts/ascend_check.sh [PYTEST_ARGS...]
#
# Uses the machine's own `python3`, which must have numpy, pytest and pytest-timeout. The
# repository is put on PYTHONPATH. SHAREDARRAYS_ASCEND_MODULE is set to "" (the library
# itself), so the conformance suite's ascend cases (named "ascend-simulated") and
# tests/backends/test_ascend.py run on the real runtime, the pid trust list included.
# Writes ascend-report.md and pytest.log under $OUT (./artifacts when OUT is unset).
# Exit status: pytest's.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-artifacts}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SHAREDARRAYS_ASCEND_MODULE=
export XDG_RUNTIME_DIR="$(mktemp -d /tmp/xdg-ascend-check.XXXX)"
chmod 711 "$XDG_RUNTIME_DIR"
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
    args=(-ra -k "ascend" tests/test_conformance.py tests/backends/test_ascend.py)
fi
python3 -c 'import sharedarrays as sa; print(sa.list_backends())' | tee "$OUT/pytest.log"
python3 -m pytest "${args[@]}" 2>&1 | tee -a "$OUT/pytest.log"
status=${PIPESTATUS[0]}
{
    echo "# ascend check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- host: $(hostname)"
    echo "- NPU: $(npu-smi info 2>/dev/null | grep -m1 -iE '910|310|Ascend' || echo unknown)"
    echo "- CANN: ${ASCEND_TOOLKIT_HOME:-unknown}"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    echo '```text'
    tail -n 40 "$OUT/pytest.log"
    echo '```'
} > "$OUT/ascend-report.md"
exit "$status"

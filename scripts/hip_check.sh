#!/usr/bin/env bash
# Run the hip-vmm and hip-pool backends' tests on a machine with an AMD GPU (ROCm and hip-python
# installed), against the real runtime instead of the simulated one, and write a report.
#
#   scripts/hip_check.sh [PYTEST_ARGS...]
#
# Uses the machine's own `python3`, which must have numpy, pytest, pytest-timeout and
# hip-python (the version matching its ROCm); CuPy's ROCm build is used where present. The
# repository is put on PYTHONPATH. SHAREDARRAYS_HIP_MODULE is set to hip.hip, so the
# conformance suite's hip cases (named "hip-vmm-simulated", "hip-pool-simulated") run on
# the real runtime.
# Writes hip-report.md and pytest.log under $OUT (./artifacts when OUT is unset).
# Exit status: pytest's.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-artifacts}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SHAREDARRAYS_HIP_MODULE=hip.hip
export XDG_RUNTIME_DIR="$(mktemp -d /tmp/xdg-hip-check.XXXX)"
chmod 711 "$XDG_RUNTIME_DIR"
args=("$@")
if [ ${#args[@]} -eq 0 ]; then
    args=(-ra -k "hip" tests/test_conformance.py tests/backends/test_hip.py)
fi
python3 -c 'import sharedarrays as sa; print(sa.list_backends())' | tee "$OUT/pytest.log"
python3 -m pytest "${args[@]}" 2>&1 | tee -a "$OUT/pytest.log"
status=${PIPESTATUS[0]}
{
    echo "# hip-vmm and hip-pool check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "- host: $(hostname)"
    echo "- GPU: $(rocm-smi --showproductname 2>/dev/null | grep -m1 -i 'card series' || echo unknown)"
    echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo
    echo '```text'
    tail -n 40 "$OUT/pytest.log"
    echo '```'
} > "$OUT/hip-report.md"
exit "$status"

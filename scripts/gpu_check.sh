#!/usr/bin/env bash
# Run the whole GPU part of the test suite on a machine with a CUDA device, in one go, and
# write a report.
#
#   scripts/gpu_check.sh [--bench] [PYTEST_ARGS...]
#
# Uses the machine's own `python3` (no virtual environment): it must already have numpy,
# cupy, cuda-bindings and pytest (torch and psutil are used where present). The repository is
# put on PYTHONPATH. The notebook tests also need nbclient, nbformat, ipykernel,
# jupyter_client and ipywidgets, which the lent H200 lacks and cannot download: make them here
# as wheels in .whl/ (ignored by git) and pass `carry: [".whl"]` to the device call; they are
# installed into a private folder:
#
#   python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl nbclient nbformat ipykernel jupyter_client ipywidgets
#   rm .whl/attrs-* .whl/packaging-* .whl/psutil-* .whl/pygments-* \
#      .whl/python_dateutil-* .whl/typing_extensions-*   # already there, keep theirs
#
# The Dask tests on the GPU (dask_cuda.LocalCUDACluster) and the NVML cross-check of `top`
# need dask-cuda and nvidia-ml-py with what they pull in, minus what the machine has:
#
#   python3 -m pip download ... -d /tmp/dw dask-cuda      # the same platform flags as above
#   for p in dask dask_cuda distributed rapids_dask_dependency pandas tzdata fsspec toolz \
#       partd locket cloudpickle click pyyaml msgpack tornado tblib zict sortedcontainers \
#       jinja2 markupsafe importlib_metadata zipp nvidia_ml_py lazy_importer; do
#     cp /tmp/dw/${p}-* .whl/; done
#
# The library-client GPU tests (tests/api/test_clients.py, marker gpu) use the machine's
# torch, numba (numba.cuda) and jax where present, and skip with the reason where not;
# array-api-compat can travel as a wheel: `python3 -m pip download --no-deps array-api-compat -d .whl`.
#
# The DLPack tests (Ascend's torch_npu path, with the machine's torch standing in) need the
# `ctypes-dlpack` wheel: `python3 -m pip download --no-deps ctypes-dlpack -d .whl`.
#
# The Vulkan semaphore tests also need the `vulkan`, `cffi` and `pycparser` wheels in .whl/
# and the Vulkan loader's .deb files in .gl/ (carry ".gl" too); tests/vulkan_helpers.py says
# how to fetch them. Without them those two tests skip with the reason.
#
# The whole call, as last run (report in docs/gpu-report.md):
#   SA_COMMIT=<the commit, written out: the device's copy has no history> SA_DIRTY= \
#       bash scripts/gpu_check.sh [--bench]      (device call with carry: [".whl", ".gl"])
#
# Runs `python3 -m pytest -m "gpu or notebook or torch" -ra tests` (or the PYTEST_ARGS given, e.g. a single test
# file), then `make demo PYTHON_ENV=system`, and with --bench `python3 benchmarks/bench.py`
# (its JSON and plot go under $OUT too).
# Writes, under $OUT (./artifacts when OUT is unset):
#   gpu-report.md   date (UTC), host, GPU and driver, package versions, pass/fail/skip
#                   counts, the end of the pytest output, the demo's (and bench's) output
#   junit.xml       pytest's JUnit XML
#   pytest.log      pytest's whole output
#   demo.log, bench.log
#
# The demo and the benchmark are each stopped after $GPU_CHECK_TIMEOUT seconds (300).
#
# Exit status: non-zero when a gpu test failed or errored, or none passed.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"

BENCH=0
PYTEST_ARGS=()
for arg in "$@"; do
    case "$arg" in
        --bench) BENCH=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
        *) PYTEST_ARGS+=("$arg") ;;
    esac
done
if [ "${#PYTEST_ARGS[@]}" -eq 0 ]; then
    PYTEST_ARGS=(tests)
fi

OUT="${OUT:-$ROOT/artifacts}"
mkdir -p "$OUT"
REPORT="$OUT/gpu-report.md"
JUNIT="$OUT/junit.xml"
PYLOG="$OUT/pytest.log"
PYTHON="${PYTHON:-python3}"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# Packages the machine lacks (the notebook tests' nbclient, ipykernel, ...) may travel as
# wheels in .whl/ (see docs/gpu-report.md for the call); they go to a private folder.
if compgen -G "$ROOT/.whl/*.whl" >/dev/null; then
    SITE="${TMPDIR:-/tmp}/sharedarrays-site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$ROOT"/.whl/*.whl && export PYTHONPATH="$PYTHONPATH:$SITE"
fi
# numba-cuda on the lent machine types no kernel with its NumPy 2.5: a NumPy it supports may
# travel in .whl-numba/ (`pip download --no-deps ... -d .whl-numba "numpy==2.4.*"`, the
# platform flags above); it goes to a folder of its own that only the numba test's child
# puts first on its path (tests/api/test_clients.py, SA_NUMBA_SITE).
if compgen -G "$ROOT/.whl-numba/*.whl" >/dev/null; then
    SA_NUMBA_SITE="${TMPDIR:-/tmp}/sharedarrays-numba-site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SA_NUMBA_SITE" "$ROOT"/.whl-numba/*.whl && export SA_NUMBA_SITE
fi
# The Vulkan loader for the external-semaphore tests may travel as .deb files in .gl/
# (see tests/vulkan_helpers.py); the driver's ICD is on the machine.
if compgen -G "$ROOT/.gl/*.deb" >/dev/null; then
    for f in "$ROOT"/.gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
    ldconfig 2>/dev/null
    ICD=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    [ -f "$ICD" ] && export VK_DRIVER_FILES="$ICD"
fi
export PYTHONUNBUFFERED=1
export PYTHONDONTWRITEBYTECODE=1

log() { printf '\n== gpu_check: %s\n' "$*"; }

# --------------------------------------------------------------------------------------------
# the tests

log "pytest -m 'gpu or notebook or torch' ${PYTEST_ARGS[*]}"
start=$(date +%s)
"$PYTHON" -m pytest -m "gpu or notebook or torch" -ra -p no:cacheprovider --durations=15 --junitxml="$JUNIT" "${PYTEST_ARGS[@]}" \
    2>&1 | tee "$PYLOG"
pytest_rc=${PIPESTATUS[0]}
pytest_s=$(( $(date +%s) - start ))

# passed failed errors skipped, from the JUnit XML (all zeros when it is missing)
read -r passed failed errors skipped < <("$PYTHON" - "$JUNIT" <<'EOF'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception:
    print(0, 0, 0, 0)
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for suite in suites:
    for key in n:
        n[key] += int(suite.get(key, 0))
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
print(passed, n["failures"], n["errors"], n["skipped"])
EOF
)

# --------------------------------------------------------------------------------------------
# the demo and the benchmark (each guarded: their failure is reported, not fatal)

run_guarded() {  # name logfile command...
    local name="$1" logfile="$2"
    shift 2
    log "$name"
    if "$PYTHON" -c 'import sharedarrays.cli' >/dev/null 2>&1; then
        timeout "${GPU_CHECK_TIMEOUT:-300}" "$@" 2>&1 | tee "$logfile"
        local rc=${PIPESTATUS[0]}
        echo "(exit status $rc)" >>"$logfile"
    else
        echo "skipped: sharedarrays.cli does not import here" | tee "$logfile"
    fi
}

# The README's own command, on this machine's python3 (no registry here, so no .venv).
run_guarded "demo" "$OUT/demo.log" \
    make -C "$ROOT" demo PYTHON_ENV=system PYTHON="$PYTHON" DEMO_ARGS=--no-progress
if [ "$BENCH" -eq 1 ]; then
    run_guarded "bench" "$OUT/bench.log" "$PYTHON" "$ROOT/benchmarks/bench.py" \
        --json "$OUT/bench.json" --plot "$OUT/bench.png"
fi

# --------------------------------------------------------------------------------------------
# the report

gpu="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    | paste -sd ';' - | sed 's/;/; /g')"  # one table cell, however many GPUs
[ -n "$gpu" ] || gpu='nvidia-smi not available'
versions="$("$PYTHON" - <<'EOF'
import platform
from importlib import metadata

print(f"- python {platform.python_version()} ({platform.python_implementation()})")
for name in ("numpy", "cupy-cuda13x", "cupy-cuda12x", "cupy", "cuda-bindings", "cuda-core",
             "torch", "numba", "numba-cuda", "jax", "array-api-compat", "pytest", "psutil",
             "hypothesis"):
    try:
        print(f"- {name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
try:
    from cuda.bindings import driver

    err, version = driver.cuDriverGetVersion()
    print(f"- CUDA driver API {version // 1000}.{version % 1000 // 10}")
except Exception as exc:
    print(f"- CUDA driver API: unknown ({type(exc).__name__})")
EOF
)"
# The device machine gets a copy of the tree without .git: the caller may pass SA_COMMIT
# (and SA_DIRTY=1) from the checkout it sent.
commit="${SA_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo 'unknown')}"
dirty="${SA_DIRTY-$(git -C "$ROOT" status --porcelain 2>/dev/null | head -1)}"

verdict="PASSED"
status=0
if [ "$failed" -gt 0 ] || [ "$errors" -gt 0 ]; then
    verdict="FAILED"
    status=1
elif [ "$passed" -eq 0 ]; then
    verdict="FAILED (no gpu test passed)"
    status=1
elif [ "$pytest_rc" -ne 0 ]; then
    verdict="FAILED (pytest exit status $pytest_rc)"
    status=1
fi

{
    echo "# GPU test report"
    echo
    echo "| | |"
    echo "| --- | --- |"
    echo "| result | **$verdict** |"
    echo "| date (UTC) | $(date -u '+%Y-%m-%d %H:%M:%S') |"
    echo "| host | $(hostname) |"
    echo "| GPU (name, driver, memory) | $gpu |"
    echo "| commit | $commit${dirty:+ (with uncommitted changes)} |"
    echo "| command | \`pytest -m 'gpu or notebook or torch' ${PYTEST_ARGS[*]}\` |"
    echo "| passed / failed / errors / skipped | $passed / $failed / $errors / $skipped |"
    echo "| pytest time | ${pytest_s} s (exit status $pytest_rc) |"
    echo
    echo "## Versions"
    echo
    echo "$versions"
    echo
    echo "## pytest (last 60 lines)"
    echo
    echo '```'
    tail -n 60 "$PYLOG"
    echo '```'
    echo
    echo "## demo"
    echo
    echo '```'
    cat "$OUT/demo.log" 2>/dev/null
    echo '```'
    if [ "$BENCH" -eq 1 ]; then
        echo
        echo "## bench"
        echo
        echo '```'
        cat "$OUT/bench.log" 2>/dev/null
        echo '```'
    fi
} >"$REPORT"

log "$verdict: $passed passed, $failed failed, $errors errors, $skipped skipped; report: $REPORT"
exit "$status"

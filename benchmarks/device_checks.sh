#!/usr/bin/env bash
# One GPU lease's checks in one call (the device tool: minutes of device time, one call at a
# time): the machine and JAX, then the tests that need an accelerator, one line per test as it
# ends (a run cut short still names what failed), then `bench_device.py`'s stages. Every part
# has its own time limit; everything lands in $OUT.
#
#   bash benchmarks/device_checks.sh                    # defaults below
#   TESTS="tests/test_drafters.py" TESTS_S=200 STAGES="drafters" BENCH_S=200 \
#       bash benchmarks/device_checks.sh
set -uo pipefail
out=${OUT:-device_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
tests=${TESTS:-tests/test_paged_attention.py tests/test_pallas_paged_dispatch.py
    tests/test_tree_attention.py::test_compiled_kernel_on_accelerator tests/test_drafters.py}

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__,
jax.devices())"; } 2>&1 | tee "$out/env.txt"

if [ "${TESTS_S:-240}" -gt 0 ]; then
    # -v: one PASSED/FAILED line per test as it ends; short tracebacks as each one fails
    # pytest's own addopts (-n auto, --dist loadfile) are replaced: -n 8 shares the tests out
    # shellcheck disable=SC2086
    timeout "${TESTS_S:-240}" python3 -m pytest -o addopts="" -p no:benchmark -p no:cacheprovider \
        -n "${WORKERS:-8}" -v --tb=short $tests > "$out/tests.log" 2>&1
    echo "tests: exit $? (124: cut at ${TESTS_S:-240} s)"
    grep -E "(PASSED|FAILED|ERROR|SKIPPED) " "$out/tests.log" \
        | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort | awk '{print $1}' | uniq -c
    grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) " "$out/tests.log" | sed -E 's/^.*(FAILED|ERROR) //'
fi

if [ "${BENCH_S:-240}" -gt 0 ]; then
    # shellcheck disable=SC2086
    timeout "${BENCH_S:-240}" python3 benchmarks/bench_device.py --stages ${STAGES:-drafters} \
        --out "$out/bench_device.json" 2>&1 | grep -v Warning | tee "$out/bench_device.log"
fi

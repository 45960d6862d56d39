#!/usr/bin/env bash
# Everything the GPU machine is for, in one device call: install the project and the wheels its image
# lacks, run the GPU tests, then the kernel benchmark; logs and JSON go under $OUT.
#   here:   bash ../shared/tools/gpu-wheels.sh --peers      (puts hydra, omegaconf, antlr, gemlite in .whl/)
#   device: run(command="bash scripts/device_run.sh", carry=[".whl"])
# GPU_TESTS=0 or BENCH=0 skips a part; GPU_TEST_ARGS picks tests (default: all of tests/; GPU_TEST_S, 420 s, bounds
# them: 483 took over 280 s on 2026-12-04); BENCH_ARGS passes
# options to scripts/bench_kernels.py; TUNE_ARGS, when set, runs scripts/tune_gemv.py with them first; CLOCK_ARGS,
# when set, runs scripts/clock_watch.py with them last (its nvidia-smi log goes to $OUT/clocks.csv); SWEEP_ARGS,
# when set, runs scripts/sweep_wgmma.py with them after the benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/mtpf-out}
mkdir -p "$OUT"
# omegaconf 2.3 loads only antlr4-python3-runtime 4.9.x ("Could not deserialize ATN with version 3 (expected 4)"
# otherwise); gpu-wheels.sh copies whatever version the machine that runs it has (2026-12-03: 4.13.2)
if ! compgen -G ".whl/antlr4_python3_runtime-4.9.*" > /dev/null || compgen -G ".whl/antlr4_python3_runtime-4.1[0-9]*" > /dev/null; then
  echo "device_run.sh: .whl needs antlr4-python3-runtime 4.9.x alone (omegaconf 2.3); here: $(ls .whl | grep antlr)." \
       "Fix: rm .whl/antlr4_python3_runtime-*; python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3" >&2
  exit 1
fi
rm -rf /tmp/site &&   # a warm machine keeps /tmp/site, and pip --target does not replace a package
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
rc=0
if [[ "${GPU_TESTS:-1}" == 1 ]]; then
  # -P: keep the checkout's mtpfactory/ off sys.path, so the installed package (with mtpfactory.kernels) is used
  timeout "${GPU_TEST_S:-420}" python3 -P -m pytest -m gpu -q -p no:cacheprovider ${GPU_TEST_ARGS:-tests} > "$OUT/gpu_tests.log" 2>&1
  rc=$?
  tail -n 25 "$OUT/gpu_tests.log"
fi
if [[ -n "${TUNE_ARGS:-}" ]]; then
  timeout "${TUNE_S:-420}" python3 -P scripts/tune_gemv.py --json "$OUT/tune.json" $TUNE_ARGS 2>&1 | tee "$OUT/tune.log"
fi
if [[ "${BENCH:-1}" == 1 ]]; then
  timeout "${BENCH_S:-420}" python3 -P scripts/bench_kernels.py --json "$OUT/gemv.json" ${BENCH_ARGS:-} 2>&1 |
    tee "$OUT/bench.log"
fi
if [[ -n "${SWEEP_ARGS:-}" ]]; then
  timeout "${SWEEP_S:-300}" python3 -P scripts/sweep_wgmma.py $SWEEP_ARGS 2>&1 | tee "$OUT/sweep.log"
fi
if [[ -n "${CLOCK_ARGS:-}" ]]; then
  timeout "${CLOCK_S:-240}" python3 -P scripts/clock_watch.py --csv "$OUT/clocks.csv" $CLOCK_ARGS 2>&1 | tee "$OUT/clock.log"
fi
exit $rc

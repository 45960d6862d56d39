#!/usr/bin/env bash
# Everything the GPU machine is for, in one device call: install the project and the wheels its image
# lacks, run the GPU tests, then the kernel benchmark; logs and JSON go under $OUT.
#   here:   bash ../shared/tools/gpu-wheels.sh --peers      (puts hydra, omegaconf, antlr, gemlite in .whl/)
#   device: run(command="bash scripts/device_run.sh", carry=[".whl"])
# GPU_TESTS=0 or BENCH=0 skips a part; GPU_TEST_ARGS picks tests (default: all of tests/; GPU_TEST_S, 420 s, bounds
# them: 483 took over 280 s on 2026-12-04; GPU_TEST_ARGS='tests -n 4' ran 641 in 184 s on an H100, with pytest-xdist
# and execnet in .whl: python3 -m pip download --no-deps -d .whl pytest-xdist execnet; -n 8 ran 641 in 151 s there
# behind tests/conftest.py's gpu_memory lock, 10 of them out of memory before it); BENCH_ARGS passes options to
# scripts/bench_kernels.py (BENCH_S, 420 s);
# TUNE_ARGS, when set, runs scripts/tune_gemv.py with them first (TUNE_S, 420 s); OPS_ARGS, when set, runs
# scripts/bench_ops.py with them after the kernel benchmark (OPS_S, 240 s; OPS_ARGS=--rounds=3 times every op);
# HEAD_ARGS, when set, runs scripts/bench_head.py with them next (HEAD_S, 300 s; HEAD_ARGS=--rounds=3 times each
# head's decode step at every batch);
# SWEEP_ARGS, when set, runs scripts/sweep_wgmma.py with them after those (SWEEP_S, 300 s); ATTN_ARGS, when set,
# runs scripts/sweep_attention.py with them next (ATTN_S, 240 s; ATTN_ARGS=--rounds=3 sweeps its defaults);
# CLOCK_ARGS, when set, runs scripts/clock_watch.py with them last (CLOCK_S, 240 s; its nvidia-smi log goes to
# $OUT/clocks.csv).
# A device call ends at 600 s, the install included, so no stage runs past CALL_S (570 s) from the script's start:
# a stage gets the lesser of its own limit and what is left. The defaults (the whole GPU suite, then every shape's
# benchmark) do not both fit in one call: run the tests alone (BENCH=0), then the benchmark alone (GPU_TESTS=0,
# or one BENCH_ARGS='--shapes ...' a call), keeping the enabled stages' limits under about 540 s together.
# Exit status: the worst of the stages' (0 when every stage passed). A stage cut at its limit exits 3 here, not
# timeout's 124, which the device tool reads as the whole call timing out; one killed by SIGKILL (137, e.g. out
# of memory) exits 9; each is named on stderr.
set -uo pipefail
OUT=${OUT:-/tmp/mtpf-out}
CALL_S=${CALL_S:-570}
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

limits=0   # the enabled stages' limits together
[[ "${GPU_TESTS:-1}" == 1 ]] && limits=$((limits + ${GPU_TEST_S:-420}))
[[ -n "${TUNE_ARGS:-}" ]] && limits=$((limits + ${TUNE_S:-420}))
[[ "${BENCH:-1}" == 1 ]] && limits=$((limits + ${BENCH_S:-420}))
[[ -n "${OPS_ARGS:-}" ]] && limits=$((limits + ${OPS_S:-240}))
[[ -n "${HEAD_ARGS:-}" ]] && limits=$((limits + ${HEAD_S:-300}))
[[ -n "${SWEEP_ARGS:-}" ]] && limits=$((limits + ${SWEEP_S:-300}))
[[ -n "${ATTN_ARGS:-}" ]] && limits=$((limits + ${ATTN_S:-240}))
[[ -n "${CLOCK_ARGS:-}" ]] && limits=$((limits + ${CLOCK_S:-240}))
if (( limits + SECONDS > CALL_S )); then
  echo "device_run.sh: the stages' limits add up to ${limits} s after ${SECONDS} s of install, past CALL_S" \
       "(${CALL_S} s): the last stages will be cut; split the call (see the header)" >&2
fi

rc=0
# stage NAME LIMIT_S LOG CMD...: CMD under timeout, its output to LOG (and to the screen, but for the tests: their
# log's tail); keeps the worst exit status in rc, an internal timeout as 3 and a SIGKILL as 9
stage() {
  local name=$1 limit=$2 log=$3 status
  shift 3
  if (( CALL_S - SECONDS < limit )); then
    limit=$((CALL_S - SECONDS))
  fi
  if (( limit <= 0 )); then
    echo "device_run.sh: $name not run: no time left before CALL_S (${CALL_S} s) (exit 3)" >&2
    (( rc > 3 )) || rc=3
    return
  fi
  if [[ $name == tests ]]; then
    timeout "$limit" "$@" > "$log" 2>&1
    status=$?
    tail -n 25 "$log"
  else
    timeout "$limit" "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
  fi
  case $status in
    0) ;;
    124) echo "device_run.sh: $name ran past its ${limit} s limit (exit 3)" >&2; status=3 ;;
    137) echo "device_run.sh: $name was killed by SIGKILL, out of memory? (exit 9)" >&2; status=9 ;;
    *) echo "device_run.sh: $name exited $status" >&2 ;;
  esac
  if (( status > rc )); then
    rc=$status
  fi
}

if [[ "${GPU_TESTS:-1}" == 1 ]]; then
  # -P: keep the checkout's mtpfactory/ off sys.path, so the installed package (with mtpfactory.kernels) is used
  stage tests "${GPU_TEST_S:-420}" "$OUT/gpu_tests.log" \
    python3 -P -m pytest -m gpu -q -p no:cacheprovider ${GPU_TEST_ARGS:-tests}
fi
if [[ -n "${TUNE_ARGS:-}" ]]; then
  stage tune_gemv "${TUNE_S:-420}" "$OUT/tune.log" python3 -P scripts/tune_gemv.py --json "$OUT/tune.json" $TUNE_ARGS
fi
if [[ "${BENCH:-1}" == 1 ]]; then
  stage bench_kernels "${BENCH_S:-420}" "$OUT/bench.log" \
    python3 -P scripts/bench_kernels.py --json "$OUT/gemv.json" --clocks "$OUT/bench_clocks.csv" ${BENCH_ARGS:-}
fi
if [[ -n "${OPS_ARGS:-}" ]]; then
  stage bench_ops "${OPS_S:-240}" "$OUT/ops.log" python3 -P scripts/bench_ops.py --json "$OUT/ops.json" --clocks "$OUT/ops_clocks.csv" $OPS_ARGS
fi
if [[ -n "${HEAD_ARGS:-}" ]]; then
  stage bench_head "${HEAD_S:-300}" "$OUT/head.log" python3 -P scripts/bench_head.py --json "$OUT/head.json" $HEAD_ARGS
fi
if [[ -n "${SWEEP_ARGS:-}" ]]; then
  stage sweep_wgmma "${SWEEP_S:-300}" "$OUT/sweep.log" python3 -P scripts/sweep_wgmma.py $SWEEP_ARGS
fi
if [[ -n "${ATTN_ARGS:-}" ]]; then
  stage sweep_attention "${ATTN_S:-240}" "$OUT/sweep_attention.log" python3 -P scripts/sweep_attention.py $ATTN_ARGS
fi
if [[ -n "${CLOCK_ARGS:-}" ]]; then
  stage clock_watch "${CLOCK_S:-240}" "$OUT/clock.log" \
    python3 -P scripts/clock_watch.py --csv "$OUT/clocks.csv" $CLOCK_ARGS
fi
exit $rc

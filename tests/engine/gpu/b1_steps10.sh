#!/usr/bin/env bash
# Session 10's batch-1 steps (docs/gpu-runs.md, "(b1)" runs), run by b1_call.sh after device_run.sh's setup:
#   CAND=_strata_cuda_b1_c1 STEPS='bash tests/engine/gpu/b1_steps10.sh' bash tests/engine/gpu/b1_call.sh
# with L (the unpacked libraries), OUT, CAND set; HEADLIB (default _strata_cuda_b1_head10) is HEAD's library,
# the baseline in the same lease. ROUND=1 (run 56's form: its knobs MV_ROWS_DENSE, MV_LB_SW / _DENSE and ROPE_PRE
# exist only with tests/engine/gpu/b1_candidates10.patch applied): the candidate's tests (batch-1 switches and kernels), every
# candidate switch's same-bits check on the bench model, one `--decode-only --lean` process of HEAD and one
# of the candidate with a batch-1 row per candidate value (defaults = HEAD's forms), and the host-time
# breakdown. ROUND=2: the candidate's tests (-k TESTS_K), BITWISE (default STRATA_GPU_ATT_V2) at VALUES
# (0,1,2) at 1, 8 and 32 sequences, ROWS (`--knob` rows) on the candidate with ENV2 (VAR=V ...) set for the
# whole process, HEAD, the candidate once more, and the host-time breakdown on HEAD. ROUND=3: ATT_V2=3's
# tests, same-bits check and rows against =1 in one process, then the host-time breakdown with the
# primary context's default scheduling and with spin.
set -u
HEADLIB=${HEADLIB:-_strata_cuda_b1_head10}
SW10="STRATA_GPU_MV_ROWS_DENSE,STRATA_GPU_MV_LB_SW,STRATA_GPU_MV_LB_DENSE,STRATA_GPU_ROPE_PRE,STRATA_GPU_ATT_V2"
bench() { # LIB, then --knob rows
    local lib=$1
    shift
    STRATA_CUDA_LIB=$L/$lib.so python3 -m bench.engine_gpu --decode-only --lean "$@" 2>&1 | grep '^decode (' |
        sed "s/^/$lib: /"
}
(python3 -m bench.engine_gpu --build-only > /tmp/model-build.log 2>&1) &
if [ "${ROUND:-1}" = 3 ]; then # ATT_V2=3's tests, bits and rows, then host time: default and spin scheduling
    STRATA_CUDA_LIB=$L/$CAND.so python3 -m pytest -q -p no:cacheprovider -o addopts='' \
        tests/engine/gpu/test_gpu_b1_knobs.py -k "vector_loads" > "$OUT/tests.log" 2>&1
    echo "tests exit $?: $(tail -1 "$OUT/tests.log")"
    grep -E '^(FAILED|ERROR)' "$OUT/tests.log" | head -20
    wait
    STRATA_CUDA_LIB=$L/$CAND.so timeout 60 python3 tests/engine/gpu/knob_bitwise.py STRATA_GPU_ATT_V2 --values 0,3 \
        --seqs 1,32 --steps 3 2>&1 | tail -2
    bench "$CAND" --knob 1:STRATA_GPU_ATT_V2=3 --knob 1:STRATA_GPU_ATT_V2=1 --knob 1:STRATA_GPU_ATT_V2=3 \
        --knob 8:STRATA_GPU_ATT_V2=3 --knob 32:STRATA_GPU_ATT_V2=3
    for sch in "" spin; do
        STRATA_CUDA_LIB=$L/$HEADLIB.so timeout 40 python3 tests/engine/gpu/b1_host_time.py --steps 128 \
            ${sch:+--sched $sch} 2>&1 | tail -5
    done
elif [ "${ROUND:-1}" = 1 ]; then
    STRATA_CUDA_LIB=$L/$CAND.so python3 -m pytest -q -p no:cacheprovider -o addopts='' \
        tests/engine/gpu/test_gpu_b1_knobs.py tests/engine/gpu/test_gpu_kernels.py > "$OUT/tests.log" 2>&1
    echo "tests exit $?: $(tail -1 "$OUT/tests.log")"
    grep -E '^(FAILED|ERROR)' "$OUT/tests.log" | head -20
    wait
    STRATA_CUDA_LIB=$L/$CAND.so timeout 120 python3 tests/engine/gpu/knob_bitwise.py $SW10 --values 0,1,2,4,8,10,12 \
        --seqs 1,2 --steps 3 2>&1 | tail -14
    bench "$HEADLIB" --knob 1:STRATA_GPU_NONE=1
    bench "$CAND" --knob 1:STRATA_GPU_MV_ROWS_DENSE=2 --knob 1:STRATA_GPU_MV_ROWS_DENSE=4 \
        --knob 1:STRATA_GPU_MV_LB_SW=10 --knob 1:STRATA_GPU_MV_LB_SW=12 --knob 1:STRATA_GPU_MV_LB_DENSE=10 \
        --knob 1:STRATA_GPU_ROPE_PRE=1 --knob 1:STRATA_GPU_ROPE_PRE=2 --knob 1:STRATA_GPU_ATT_V2=1 \
        --knob 8:STRATA_GPU_MV_ROWS_DENSE=2 --knob 8:STRATA_GPU_ATT_V2=1 --knob 1:STRATA_GPU_NONE=1
    STRATA_CUDA_LIB=$L/$HEADLIB.so timeout 60 python3 tests/engine/gpu/b1_host_time.py --steps 256 2>&1 | tail -3
else
    STRATA_CUDA_LIB=$L/$CAND.so python3 -m pytest -q -p no:cacheprovider -o addopts='' \
        tests/engine/gpu/test_gpu_b1_knobs.py tests/engine/gpu/test_gpu_kernels.py -k "${TESTS_K:-attention or b1 or knob}" \
        > "$OUT/tests.log" 2>&1
    echo "tests exit $?: $(tail -1 "$OUT/tests.log")"
    grep -E '^(FAILED|ERROR)' "$OUT/tests.log" | head -20
    wait
    STRATA_CUDA_LIB=$L/$CAND.so timeout 120 python3 tests/engine/gpu/knob_bitwise.py ${BITWISE:-STRATA_GPU_ATT_V2} \
        --values ${VALUES:-0,1,2} --seqs 1,8,32 --steps 3 2>&1 | tail -6
    # shellcheck disable=SC2086
    env ${ENV2:-STRATA_GPU_NONE=1} STRATA_CUDA_LIB=$L/$CAND.so python3 -m bench.engine_gpu --decode-only --lean \
        ${ROWS:---knob 1:STRATA_GPU_NONE=1} 2>&1 | grep '^decode (' | sed "s/^/$CAND (${ENV2:-}): /"
    bench "$HEADLIB" --knob 1:STRATA_GPU_NONE=1
    # shellcheck disable=SC2086
    env ${ENV2:-STRATA_GPU_NONE=1} STRATA_CUDA_LIB=$L/$CAND.so python3 -m bench.engine_gpu --decode-only --lean \
        ${ROWS:---knob 1:STRATA_GPU_NONE=1} 2>&1 | grep '^decode (' | sed "s/^/$CAND (${ENV2:-}) again: /"
    STRATA_CUDA_LIB=$L/$HEADLIB.so timeout 60 python3 tests/engine/gpu/b1_host_time.py --steps 128 2>&1 | tail -3
fi

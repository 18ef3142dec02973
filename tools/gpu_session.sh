#!/usr/bin/env bash
# The GPU machine's checks in phases, so a session with little device time runs them in few calls.
# Every phase writes its logs to $OUT (default /tmp/gpumem-out) and prints a short summary.
#
#   bash tools/gpu_session.sh build            # install carried wheels (.whl: tools/fetch_gpu_wheels.sh), build gpumem
#   bash tools/gpu_session.sh suite [ARGS]     # the GPU test suite, or pytest ARGS (2-GPU tests need 2 GPUs)
#   bash tools/gpu_session.sh suite-part N     # part N (1-3) of the suite, each sized for one 10-minute
#                                              # call (the whole suite does not fit one);
#                                              # LIST=1 prints the part's files only
#   bash tools/gpu_session.sh sanitizer [TESTS] # the suite (or TESTS) under compute-sanitizer memcheck, alone
#                                              # (SHARDS=N: N groups at once; SANITIZER_BUDGET_S=S: stops
#                                              # in time, lists the tests left in $OUT/cs/notrun.txt)
#   bash tools/gpu_session.sh compare          # compare_allocators, one copy per GPU, in parallel
#   bash tools/gpu_session.sh mixed            # mixed_pipeline (CuPy -> torch -> Numba), SCALE=0.5 default
#   bash tools/gpu_session.sh batch [ALLOC] [MODELS]  # batch_size_bench (MODELS: default all five; split
#                                              # as resnet,gpt,bert and gen,seqlen: each call < 8 min)
#   bash tools/gpu_session.sh ddp              # 2-rank DDP soak with gpumem on both ranks, alone
#   bash tools/gpu_session.sh soak-start       # 10-min gpumem soak (GPU 0; MINUTES=N), native reference
#                                              # (last GPU alongside; on one GPU after it)
#   bash tools/gpu_session.sh soak-collect     # waits for the soak, compares losses, copies summaries
#   bash tools/gpu_session.sh report           # gpumem.report: live training, 10^6 events; gpumem, native
#   KIT=DIR bash tools/gpu_session.sh peer     # PyTorch's allocator tests, native vs gpumem (DIR: a carried
#                                              # copy of ../shared/torch_tests)
#
# The soak outlasts one call (10 minutes of steps plus start-up), so soak-start detaches it (setsid)
# and soak-collect, in a call made while the machine is still warm, picks it up (on one GPU, where the
# reference runs after gpumem's run, it may take two soak-collect calls). compare, ddp and the
# soak run the workloads of bench/workloads.py; WORKLOADS=PATH runs another workloads file instead.
# Phases that measure speed must not share a GPU with another phase.
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
source "$(dirname "$SELF")/gpu_env.sh"  # working directory, $OUT, /tmp/site
SOAK=${SOAK:-/tmp/gpumem-soak}  # where soak-start leaves the detached runs for soak-collect
WL=${WORKLOADS:+--workloads $WORKLOADS}
gpus() { python3 -c "import torch; print(torch.cuda.device_count())"; }

case "${1:-}" in
  build)
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    fi
    python3 -m pip install --no-build-isolation -q . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
    python3 -c "import gpumem; print(gpumem.status_line())"
    ;;
  suite)
    shift
    python3 -m pytest -m gpu -p no:cacheprovider -rfEs -q "${@:-tests/gpu}" > "$OUT/gpu_tests.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/gpu_tests.log" | tail -20
    exit $rc
    ;;
  suite-part)
    # One H100 (2026-11-27, 50b5c23): part 1's files ran in 398 s (the RMM test skipped); part 2's
    # with three of batch_size_tools' tests in 470 s. Part 3 on one H100 (2026-12-06, 02588bf): 376 s,
    # 25 passed and 3 skipped (they need 2 GPUs; distributed, which runs on every GPU, took 265 s on
    # two H200s); part 2 but torch_bridge 142 s. Run parts one after the other, never two side by side
    # on a 2-GPU machine: part 1 beside part 3's tool, notebook and cleanup files (2x H100, 2026-11-28)
    # got through 44 of 47 and 11 of 14 tests in 520 s, where each alone fits 400.
    case "${2:-}" in
      1) files="dropin integrations report run" ;;
      2) files="torch_bridge stitch ends_by_page park_lent compile cuda_upstreams cleanup" ;;  # ends_by_page: ~20 s (H100)
      3) files="batch_size batch_size_tools distributed notebooks" ;;
      *) echo "suite-part needs a part: 1, 2 or 3"; exit 2 ;;
    esac
    paths=""
    for f in $files; do paths="$paths tests/gpu/test_${f}_gpu.py"; done
    if [ -n "${LIST:-}" ]; then echo $paths; exit 0; fi
    exec bash "$SELF" suite $paths
    ;;
  sanitizer)
    shift
    LOG_DIR="$OUT/cs" bash tools/compute_sanitizer.sh -m gpu -q -rfE -p no:cacheprovider "${@:-tests/gpu}" \
      > "$OUT/cs.log" 2>&1
    rc=$?
    grep -E "^(FAILED|ERROR)|passed|failed|memcheck:|\[(api|memory|other|untracked)\]" "$OUT/cs.log" | tail -20
    exit $rc
    ;;
  compare)
    n=$(gpus)
    for ((g = 0; g < n; g++)); do
      CUDA_VISIBLE_DEVICES=$g python3 bench/compare_allocators.py $WL --rounds "${ROUNDS:-2}" \
        > "$OUT/compare$g.log" 2>&1 &
    done
    wait
    for ((g = 0; g < n; g++)); do echo "GPU $g"; grep -vE "^(round|\{)" "$OUT/compare$g.log"; done
    ;;
  mixed)
    python3 bench/mixed_pipeline.py --scale "${SCALE:-0.5}" > "$OUT/mixed_pipeline.log" 2>&1
    rc=$?
    grep -v '^{' "$OUT/mixed_pipeline.log" | tail -30
    exit $rc
    ;;
  batch)
    m=${3:-resnet,gpt,bert,gen,seqlen}
    log="$OUT/batch_${2:-gpumem}_${m//,/_}.log"
    python3 bench/batch_size_bench.py --allocator "${2:-gpumem}" --models "$m" > "$log" 2>&1
    rc=$?
    grep -E "^(resnet|gpt|bert|gen|seqlen) \(|^finder|^(gpumem|lightning|accelerate)|^targets|Error" "$log"
    exit $rc
    ;;
  ddp)
    torchrun --standalone --nproc_per_node "$(gpus)" bench/soak.py --ddp --allocator gpumem --minutes 1.5 \
      $WL --out "$OUT/soak_ddp.json" > "$OUT/ddp.log" 2>&1
    rc=$?
    grep -E "^\[rank|Error" "$OUT/ddp.log" | cut -c1-400
    exit $rc
    ;;
  report)
    # tools/report_gpu_check.py with gpumem as torch's allocator, then with PyTorch's own (fewer
    # events: the native run checks the same pages, the 10^6 one is gpumem's)
    python3 tools/report_gpu_check.py --tag gpumem > "$OUT/report_gpumem.log" 2>&1
    rc=$?
    GPUMEM_DISABLE=1 python3 tools/report_gpu_check.py --tag native --events 100000 > "$OUT/report_native.log" 2>&1
    rc2=$?
    grep -E "ok  |FAIL|checks|Error|^\{|^live report|bytes$" "$OUT/report_gpumem.log" "$OUT/report_native.log" | cut -c1-600
    exit $(( rc || rc2 ))
    ;;
  peer)
    # PyTorch's own allocator tests (../shared/torch_tests, copied to $KIT and carried): every part with
    # each allocator, the two allocators on their own GPUs side by side where there are two (one H200
    # pair, 2026-11-27: 159 s for all of it), else one after the other (about 300 s on one H100).
    [ -n "${KIT:-}" ] && [ -f "$KIT/run_peer.sh" ] || {
      echo "peer needs KIT=DIR, a copy of ../shared/torch_tests in an ignored folder that the call carries"
      exit 3
    }
    python3 -m pip install -q --no-deps --no-index "$KIT"/wheels/expecttest-*.whl
    rm -rf "$OUT/peer" && mkdir -p "$OUT/peer"
    half() {  # allocator, GPU
      for p in part1 part2 part3; do
        CUDA_VISIBLE_DEVICES=$2 OUT="$OUT/peer" PEER_BUDGET=150 timeout 170 bash "$KIT/run_peer.sh" $p $1 \
          > "$OUT/peer/$1_$p.out" 2>&1
      done
    }
    if [ "$(gpus)" -ge 2 ]; then
      half gpumem 0 & half native 1 & wait
    else
      half gpumem 0; half native 0
    fi
    python3 "$KIT/compare.py" "$OUT/peer/native_part*.xml" "$OUT/peer/gpumem_part*.xml" > "$OUT/peer/compare.txt" 2>&1
    grep -A4 "REAL REGRESSIONS" "$OUT/peer/compare.txt" | head -12
    grep "PEER SUMMARY" "$OUT/peer/compare.txt"
    ;;
  soak-start)
    rm -rf "$SOAK" && mkdir -p "$SOAK"
    last=$(( $(gpus) - 1 ))
    whole=${MINUTES:-10}; whole=${whole%.*}  # MINUTES may be fractional (soak.py takes a float)
    gpumem_run="CUDA_VISIBLE_DEVICES=0 python3 bench/soak.py --allocator gpumem --minutes ${MINUTES:-10} \
        $WL --out $SOAK/soak_gpumem.json > $SOAK/soak_gpumem.log 2>&1; touch $SOAK/gpumem.done"
    # The reference for the bitwise loss comparison needs fewer steps.
    native_run="CUDA_VISIBLE_DEVICES=$last python3 bench/soak.py --allocator native --minutes ${NATIVE_MINUTES:-3} \
        $WL --out $SOAK/soak_native.json > $SOAK/soak_native.log 2>&1; touch $SOAK/native.done"
    if [ "$last" -ge 1 ]; then  # on its own GPU the reference runs alongside
      setsid bash -c "$gpumem_run" < /dev/null > /dev/null 2>&1 &
      setsid bash -c "$native_run" < /dev/null > /dev/null 2>&1 &
      minutes=$(( whole + 2 ))
    else  # one GPU: after gpumem's run (side by side, native's cache of ~60 GiB ran gpumem out of memory)
      setsid bash -c "$gpumem_run; $native_run" < /dev/null > /dev/null 2>&1 &
      minutes=$(( whole + ${NATIVE_MINUTES:-3} + 3 ))
    fi
    echo "soak started at $(date -u +%T); collect after $(date -u -d "+$minutes min" +%T)"
    ;;
  soak-collect)
    [ -d "$SOAK" ] || { echo "no soak on this machine (a fresh machine: the soak was lost)"; exit 3; }
    deadline=$(( SECONDS + ${WAIT_S:-560} ))
    while [ ! -f "$SOAK/gpumem.done" ] || [ ! -f "$SOAK/native.done" ]; do
      [ $SECONDS -ge $deadline ] && { echo "soak not finished; collect again"; tail -n 2 "$SOAK"/*.log; exit 4; }
      sleep 5
    done
    tail -n 2 "$SOAK/soak_gpumem.log" "$SOAK/soak_native.log" | cut -c1-1500
    python3 bench/soak.py --compare "$SOAK/soak_gpumem.json" "$SOAK/soak_native.json" | tee "$OUT/soak_compare.json"
    cp "$SOAK"/*.log "$OUT/"
    ;;
  *)
    awk 'NR > 1 && !/^#/ { exit } NR > 1' "$SELF"  # the header above
    exit 2
    ;;
esac

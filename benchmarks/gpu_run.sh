#!/usr/bin/env bash
# Everything the lent GPU does for this project, in one call: set-up, GPU tests, benchmarks,
# validations. Stages are named on the command line (SHIM_ARGS: extra arguments of the shim-* and
# graph-* drivers, e.g. --skip-grads); each logs to $OUT/<stage>.log and a failing
# stage does not stop the next. Usage (device tool, repo root, carry .whl and .gpu-state):
#   bash benchmarks/gpu_run.sh env tests bench-r50 bench-alexnet validate-tuner export
set -u
OUT=${OUT:-/tmp/mucudnn-out}
STATE=${STATE:-.gpu-state}           # carried between calls: the store measured so far
LOGS="$OUT/logs"                     # folded into $OUT/logs.tgz at the end (few files come back)
mkdir -p "$LOGS" "$STATE"
export PYTHONUNBUFFERED=1 MUCUDNN_STORE="$STATE/store.sqlite"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
MU="python3 -m mucudnn"

all_gpus() { nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -; }

spread() {  # spread GPUS DIR MODEL... -- CMD...: CMD --models MODEL --out DIR/MODEL for each model,
  # the models dealt round-robin over GPUS (comma-separated), one at a time per GPU, each GPU's in
  # the background (CUDA_VISIBLE_DEVICES): parallel runs never share a GPU, so timings stay apart
  local gpus=$1 dir=$2; shift 2
  local models=() ; while [ "$1" != "--" ]; do models+=("$1"); shift; done; shift
  local list=(${gpus//,/ }) i j
  for i in "${!list[@]}"; do
    ( for ((j = i; j < ${#models[@]}; j += ${#list[@]})); do
        m=${models[$j]}; mkdir -p "$dir/${m//:/_}"
        CUDA_VISIBLE_DEVICES=${list[$i]} "$@" --models "$m" --out "$dir/${m//:/_}" >"$dir/${m//:/_}.log" 2>&1
        echo "[GPU ${list[$i]}] $m rc=$?"; tail -n 8 "$dir/${m//:/_}.log"
      done ) &
  done
  wait
}

stage() {  # stage NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "    rc=$rc in $((SECONDS - t0)) s; tail:"; tail -n 6 "$LOGS/$name.log" | sed 's/^/    /'
}

for s in "$@"; do case $s in
  env) stage env 60 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv;
        python3 -c "import torch, cupy, sys; from mucudnn.cudnn import get; c = get();
print(\"python\", sys.version.split()[0]); print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda,
\"torch cudnn\", torch.backends.cudnn.version()); print(\"cupy\", cupy.__version__);
print(\"mucudnn cudnn\", c.version, c.path)"; python3 -c "import pulp; print(\"pulp\", pulp.__version__, pulp.PULP_CBC_CMD().available())"' ;;
  tests) stage tests 300 env PYTORCH_CUDA_ALLOC_CONF=${TESTS_ALLOC_CONF-expandable_segments:True} \
      python3 -m pytest -q -m gpu tests/ ;;
  bench-r50)  # tuning wall time: a fresh store, ResNet-50, powerOfTwo, 3 directions, then tune
    rm -f "$OUT/r50-fresh.sqlite"*
    stage bench-r50 420 bash -c "/usr/bin/time -f 'bench wall %e s' $MU bench resnet50 --no-progress --store $OUT/r50-fresh.sqlite &&
      /usr/bin/time -f 'tune wall %e s' $MU tune resnet50 --workspace-limit 64MiB --store $OUT/r50-fresh.sqlite -o $LOGS/r50-64MiB.plan &&
      $MU store merge $OUT/r50-fresh.sqlite"
    rm -f "$OUT/r50-fresh.sqlite"* ;;
  bench-*) net=${s#bench-}; stage "bench-$net" ${BENCH_TIMEOUT:-240} $MU bench "$net" --no-progress ;;
  validate-tuner) stage validate-tuner 400 python3 -m benchmarks.validate_tuner --store "$MUCUDNN_STORE" \
      --networks alexnet resnet50 --limits 8MiB 64MiB 512MiB --out "$LOGS/validate-tuner.json" ;;
  export) stage export 120 bash -c "$MU store export '$OUT/measurements.csv.gz' && $MU store info" ;;
  benchdiag)  # a bench that stalls: progress bar and, at the timeout, every thread's Python stack
    stage benchdiag ${DIAG_TIMEOUT:-150} env PYTHONFAULTHANDLER=1 timeout -s ABRT $((${DIAG_TIMEOUT:-150} - 5)) \
      $MU bench --recording "$DIAG_RECORD" ;;
  build-shim) stage build-shim 120 $MU build-shim --force ;;
  shimprecise-*) models=${s#shimprecise-}; stage "shimprecise-$models" ${SHIM_TIMEOUT:-500} python3 -m benchmarks.shim_pytorch driver \
      --skip-timing --precise --models ${models//+/ } --out "$LOGS/shimprecise-$models" ;;
  shimgrads-*) models=${s#shimgrads-}; stage "shimgrads-$models" ${SHIM_TIMEOUT:-500} python3 -m benchmarks.shim_pytorch driver \
      --skip-timing --models ${models//+/ } --out "$LOGS/shimgrads-$models" ;;
  census)  # engine_census.py: every heuristics configuration for the pieces of $CENSUS_PLAN
    stage census ${CENSUS_TIMEOUT:-240} python3 -m benchmarks.engine_census "$CENSUS_PLAN" \
      --config "${CENSUS_CONFIG:-vgg16}" --directions ${CENSUS_DIRECTIONS:-bwd_filter} --out "$LOGS/census.json" ;;
  captureprobe)  # graph_capture_probe.py: the pieces of $CENSUS_PLAN eager and as one CUDA graph
    stage captureprobe 240 python3 -m benchmarks.graph_capture_probe "$CENSUS_PLAN" \
      --config "${CENSUS_CONFIG:-vgg16}" --out "$LOGS/captureprobe.json" ;;
  graphsmoke) stage graphsmoke 300 python3 -m benchmarks.graph_smoke --out "$LOGS/graphsmoke" ;;
  graph-*)  # graph-MODEL+MODEL-DTYPE: PyTorch's default path, e.g. graph-resnet50+vgg16-fp32
    spec=${s#graph-}; dtype=${spec##*-}; models=${spec%-*}
    stage "graph-$spec" ${SHIM_TIMEOUT:-500} python3 -m benchmarks.shim_pytorch driver --path default \
      --dtype "$dtype" ${SHIM_ARGS:-${GRAPH_ARGS:-}} --models ${models//+/ } --out "$LOGS/graph-$spec" ;;
  f64check-*)  # float64 gradients with and without a plan that splits batches, PyTorch's default
    # path, cudnn.benchmark on, 3 forward+backward passes (the 2nd and 3rd replay CUDA graphs)
    models=${s#f64check-}; stage "f64check-$models" ${SHIM_TIMEOUT:-540} python3 -m benchmarks.shim_pytorch driver \
      --path default --skip-timing --skip-grads --double-check --double-benchmark \
      --double-limit ${F64_LIMIT:-1MiB} --double-batch ${F64_BATCH:-16} --models ${models//+/ } --out "$LOGS/f64check-$models" ;;
  f64online-*)  # benchmarks/f64_online.py: float64 gradients with online tuning active (zero set-up,
    # F64_LIMIT hard cap so points split), legacy and default paths, first run and loaded run
    models=${s#f64online-}; stage "f64online-$models" ${SHIM_TIMEOUT:-400} python3 -m benchmarks.f64_online \
      --models ${models//+/ } --limit ${F64_LIMIT:-1MiB} --batch ${F64_BATCH:-16} --out "$LOGS/f64online-$models" ;;
  torchf64-*)  # benchmarks/torch_f64.py (issue 37): float64 gradients of mucudnn.torch sessions (forced
    # offload, forced recompute, budgets until a plan mixes both, fit, VGG-16 staged) against plain
    # PyTorch's, bitwise (staged: 1e-12); torchf64-resnet50+vgg16+r3d_18. TORCHF64_TIMEOUT (560 s;
    # no budget fraction starts after 150 s less), TORCHF64_ARGS (more options, e.g. --fractions 0.8 0.5)
    models=${s#torchf64-}; limit=${TORCHF64_TIMEOUT:-560}
    stage "torchf64-$models" "$limit" python3 -m benchmarks.torch_f64 --models ${models//+/ } \
      --time-budget-s $((limit - 150)) ${TORCHF64_ARGS:-} --out "$LOGS/torchf64-$models" ;;
  neverslower-*)  # benchmarks/never_slower.py: front plans against PyTorch, then under CAPS (GiB)
    specs=${s#neverslower-}; stage "neverslower-$specs" ${SHIM_TIMEOUT:-560} python3 -m benchmarks.never_slower \
      --models ${specs//+/ } --rounds ${ROUNDS:-3} --caps ${CAPS:-} --out "$LOGS/neverslower-${specs//:/_}" ;;
  memorybudget-*)  # benchmarks/memory_budget.py: PyTorch self-capped vs mucudnn run --memory-budget (BUDGET_PLAN: --plan)
    spec=${s#memorybudget-}; stage "memorybudget-$spec" ${SHIM_TIMEOUT:-400} python3 -m benchmarks.memory_budget \
      --model ${spec%:*} --batch ${spec#*:} --budgets ${BUDGETS:-6GiB} --steps 15 --warmup 5 \
      ${BUDGET_PLAN:+--plan "$BUDGET_PLAN"} --out "$LOGS/memorybudget-${spec//:/_}" ;;
  offload)  # benchmarks/offload.py: mucudnn.torch vs save_on_cpu, on-demand offload, checkpoint
    # at OFFLOAD_BUDGET (12GiB) for OFFLOAD_MODELS (MODEL or MODEL:BATCH of benchmarks/models.py, N
    # the model's unless OFFLOAD_BATCH); OFFLOAD_METHODS (default all four; set empty: none),
    # OFFLOAD_SWEEP (mucudnn alone at these budgets, default 16GiB 8GiB; auto: from PyTorch's peak
    # down to mucudnn's minimum in OFFLOAD_SWEEP_POINTS (5) budgets; set empty: none), OFFLOAD_MIN
    # (e.g. "pytorch mucudnn": the smallest budget that trains, bisected), OFFLOAD_TIMEOUT (420 s;
    # no run starts or runs past it less 20 s), OFFLOAD_ARGS (more options). Every configuration
    # with the allocator `mucudnn run --memory-budget` sets (OFFLOAD_ALLOC_CONF; empty: PyTorch's
    # default, under which VGG-16 fails at 12 GiB with every method: fragmentation)
    limit=${OFFLOAD_TIMEOUT:-420}
    PYTORCH_CUDA_ALLOC_CONF=${OFFLOAD_ALLOC_CONF-expandable_segments:True} \
    stage offload "$limit" python3 -m benchmarks.offload driver \
      --models ${OFFLOAD_MODELS:-vgg16 resnet50} ${OFFLOAD_BATCH:+--batch $OFFLOAD_BATCH} \
      --budget ${OFFLOAD_BUDGET:-12GiB} --methods ${OFFLOAD_METHODS-mucudnn save_on_cpu ondemand checkpoint} \
      --sweep ${OFFLOAD_SWEEP-16GiB 8GiB} --sweep-points ${OFFLOAD_SWEEP_POINTS:-5} \
      --min-search ${OFFLOAD_MIN:-} --time-budget-s $((limit - 20)) ${OFFLOAD_ARGS:-} \
      --out "$OUT/offload" ;;
  hostcost)  # benchmarks/host_cost.py (issue 39 item 6): per step, the host time of the forward and
    # backward (and the thread's CPU time) against the device's step, PyTorch alone and under an
    # OffloadSession (kept-only, mixed at the case's budget, recording steps), rounds alternated;
    # HOSTCOST_CASES (MODEL:BATCH@BUDGET, default ResNet-152 N=128 @ 8 GiB and the 3-D U-Net N=2 @
    # 6 GiB), HOSTCOST_TIMEOUT (250 s; the time budget 15 s less), HOSTCOST_ARGS (e.g. --rounds 7).
    # JSON + page in $LOGS/hostcost
    limit=${HOSTCOST_TIMEOUT:-250}
    stage hostcost "$limit" python3 -m benchmarks.host_cost \
      --cases ${HOSTCOST_CASES:-resnet152:128@8GiB unet3d:2@6GiB} --time-budget-s $((limit - 15)) \
      ${HOSTCOST_ARGS:-} --out "$LOGS/hostcost" ;;
  timeline|timeline-*)  # benchmarks/plan_timeline.py (issue 39): `mucudnn run --memory-budget B
    # --offload -- python train_steps.py` as a new user runs it, first run (fresh cache) and cached
    # run, and PyTorch alone: time to the first planned step and to steady state, steps 1-20.
    # timeline-resnet152 (N=128 @ 8 GiB, 300 s), timeline-resnet50 (N=184 @ 5 GiB, 200 s),
    # timeline (both, 480 s), timeline-MODEL:BATCH@BUDGET; TIMELINE_TIMEOUT (the time budget is
    # 15 s less), TIMELINE_ARGS (e.g. --steps 80, or --detail: each step's allocator retries,
    # armed steps and host times in the logs). JSON + page + each run's log in $LOGS/$s
    case $s in
      timeline) cases="resnet152:128@8GiB resnet50:184@5GiB"; limit=${TIMELINE_TIMEOUT:-480} ;;
      timeline-resnet152) cases="resnet152:128@8GiB"; limit=${TIMELINE_TIMEOUT:-300} ;;
      timeline-resnet50) cases="resnet50:184@5GiB"; limit=${TIMELINE_TIMEOUT:-200} ;;
      *) cases=${s#timeline-}; limit=${TIMELINE_TIMEOUT:-270} ;;
    esac
    stage "${s//[:@]/_}" "$limit" python3 -m benchmarks.plan_timeline --cases $cases \
      --time-budget-s $((limit - 15)) ${TIMELINE_ARGS:-} --out "$LOGS/${s//[:@]/_}" ;;
  targets|targets-*)  # issue 39: the memory-budget targets re-measured after the restructuring,
    # reduced (the offload and pressure-minmem stages that set them run longer). targets-2d: VGG-16
    # and ResNet-50 N=256 at 12 GiB (offload.py, mucudnn.torch alone against PyTorch
    # unconstrained, 5 timed steps; VGG-16's target <= 1.25x), 220 s. targets-3d-MODEL (unet3d,
    # r3d_18): at 0.8x PyTorch's least memory through `mucudnn run --memory-budget CAP --offload`
    # (pressure.py minmem: PyTorch's least memory bisected, then the target probe alone, 10 timed
    # steps; online tuning, not session 24's front plans; target <= 1.10x), 170 s each. targets:
    # all three (~9.5 min at most: two device calls). TARGETS_2D_TIMEOUT, TARGETS_3D_TIMEOUT,
    # TARGETS_3D_SHIM (online | front: front plans bench and tune first, minutes more)
    parts=${s#targets}; parts=${parts#-}; [ -n "$parts" ] || parts="2d 3d-unet3d 3d-r3d_18"
    for part in $parts; do case $part in
      2d) limit=${TARGETS_2D_TIMEOUT:-220}
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        stage targets-2d "$limit" python3 -m benchmarks.offload driver --models vgg16 resnet50 \
          --budget 12GiB --methods mucudnn --sweep --time-budget-s $((limit - 15)) \
          --out "$LOGS/targets-2d" ;;
      3d-*) model=${part#3d-}; limit=${TARGETS_3D_TIMEOUT:-170}
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
        stage "targets-3d-$model" "$limit" python3 -m benchmarks.pressure minmem --models "$model" \
          --dtypes fp32 --benchmark off --rounds 1 --shim-mode ${TARGETS_3D_SHIM:-online} \
          --offload --offload-searches target --no-shim-search --target-steps 10 \
          --time-budget-s $((limit - 30)) --out "$LOGS/targets-3d-$model" ;;
      *) echo "unknown targets part $part (2d, 3d-unet3d, 3d-r3d_18)" ;;
    esac; done ;;
  tuningcost-*)  # benchmarks/tuning_cost.py: bench + tune wall time from an empty store, per model;
    # TUNING_GPUS=all (or 0,1,..): the models spread over the GPUs (spread), one at a time per GPU
    models=${s#tuningcost-}
    if [ -n "${TUNING_GPUS:-}" ]; then
      gpus=$TUNING_GPUS; [ "$gpus" = all ] && gpus=$(all_gpus)
      export -f spread; stage "tuningcost-$models" ${SHIM_TIMEOUT:-560} bash -c 'spread "$@"' _ "$gpus" \
        "$LOGS/tuningcost-$models" ${models//+/ } -- python3 -m benchmarks.tuning_cost ${TUNING_ARGS:-}
    else
      stage "tuningcost-$models" ${SHIM_TIMEOUT:-560} python3 -m benchmarks.tuning_cost \
        --models ${models//+/ } ${TUNING_ARGS:-} --out "$LOGS/tuningcost-$models"
    fi ;;
  pressure-*)  # benchmarks/pressure.py (issue 12): pressure-PART-MODEL+MODEL, PART ratio, minmem or
    # maxbatch. Every part writes to $PRESSURE_DIR ($STATE/pressure: kept between calls while the
    # machine stays warm, so minmem reuses ratio's uncapped runs and online tuning), copied to
    # $LOGS/pressure (without online/) after the stage; the page is pressure-GPU.md. Knobs: PRESSURE_DTYPES
    # ("fp32 bf16"; minmem/maxbatch use the first), PRESSURE_BENCHMARK ("off on"), PRESSURE_ROUNDS
    # (3), PRESSURE_SHIM (online | front), PRESSURE_TIMEOUT (570 s; the time budget is 45 s less),
    # PRESSURE_GPUS (all or 0,1,..: models in parallel, one per GPU), PRESSURE_OFFLOAD (1: minmem
    # also searches the shim + offload, `mucudnn run --memory-budget CAP --offload`; other parts
    # ignore it), PRESSURE_ARGS (more options)
    rest=${s#pressure-}; part=${rest%%-*}; models=${rest#*-}
    offload=; [ "${PRESSURE_OFFLOAD:-0}" = 1 ] && [ "$part" = minmem ] && offload=--offload
    gpus=${PRESSURE_GPUS:-}; [ "$gpus" = all ] && gpus=$(all_gpus)
    limit=${PRESSURE_TIMEOUT:-570}; dir=${PRESSURE_DIR:-$STATE/pressure}
    # PRESSURE_ALLOC_CONF: PyTorch's allocator for every run of the part (e.g. expandable_segments:True,
    # what `mucudnn run --memory-budget` sets), PyTorch's and the shim's alike
    PYTORCH_CUDA_ALLOC_CONF=${PRESSURE_ALLOC_CONF:-${PYTORCH_CUDA_ALLOC_CONF:-}} \
    stage "$s" "$limit" python3 -m benchmarks.pressure "$part" --models ${models//+/ } \
      --dtypes ${PRESSURE_DTYPES:-fp32 bf16} --benchmark ${PRESSURE_BENCHMARK:-off on} \
      --rounds ${PRESSURE_ROUNDS:-3} --shim-mode ${PRESSURE_SHIM:-online} \
      --time-budget-s $((limit - 45)) ${gpus:+--gpus $gpus} $offload ${PRESSURE_ARGS:-} --out "$dir"
    mkdir -p "$LOGS/pressure" && (cd "$dir" && tar cf - --exclude=online .) | tar xf - -C "$LOGS/pressure" ;;
  ddp-*)  # benchmarks/ddp.py on a node of N GPUs (ddp-2; ddp-2:bench or ddp-2:steps for one part):
    # DDP ResNet-50 N=256 per GPU fp32, shim/PyTorch step ratio on N GPUs vs 1, gradients across
    # ranks; bench wall time on N GPUs vs 1. DDP_ARGS: more driver options (e.g. --rounds 1)
    spec=${s#ddp-}; n=${spec%%:*}; parts=bench\ steps; [ "$spec" != "$n" ] && parts=${spec#*:}
    stage "ddp-${spec//:/_}" ${DDP_TIMEOUT:-590} python3 -m benchmarks.ddp driver --gpus "$n" \
      --model ${DDP_MODEL:-resnet50} --batch ${DDP_BATCH:-256} --parts $parts ${DDP_ARGS:-} \
      --out "$LOGS/ddp-${spec//:/_}" ;;
  batchsize-*)  # benchmarks/batch_size.py (issue 14): `mucudnn batch-size` on MODEL under BS_BUDGET
    # (24GiB), an independent measured sweep, pick/best images/s (target >= 0.97), the pick for
    # BS_LONG_STEPS (500; 0: none) steps. BS_TIMEOUT (570 s; no run starts after 30 s less), BS_ARGS
    # (more driver options, e.g. --offload, --multiple 8, --no-neighbours). Issue 40 (AccUDNN's
    # measure): BS_ARGS="--offload --against-pytorch ..." runs PyTorch alone under the budget
    # instead of the sweep, then the pick under --offload against its best. JSON + page in the logs.
    model=${s#batchsize-}; limit=${BS_TIMEOUT:-570}
    stage "batchsize-$model" "$limit" python3 -m benchmarks.batch_size driver --model "$model" \
      --memory-budget ${BS_BUDGET:-24GiB} --long-steps ${BS_LONG_STEPS:-500} \
      --time-budget-s $((limit - 30)) ${BS_ARGS:-} --out "$LOGS/batchsize-$model" ;;
  wslimit-*)  # benchmarks/workspace_limit.py: wslimit-MODEL+MODEL, the shim's workspace limit under a cap
    # (uncapped cost, offload at WSLIMIT_CAPS); WSLIMIT_ARGS: more options (e.g. --limits none 64MiB)
    models=${s#wslimit-}
    PYTORCH_CUDA_ALLOC_CONF=${PRESSURE_ALLOC_CONF:-expandable_segments:True} \
    stage "$s" ${WSLIMIT_TIMEOUT:-560} python3 -m benchmarks.workspace_limit --models ${models//+/ } \
      --caps ${WSLIMIT_CAPS:-unet3d=7.0 r3d_18=4.5} --time-budget-s $((${WSLIMIT_TIMEOUT:-560} - 40)) \
      ${WSLIMIT_ARGS:-} --out "$LOGS/$s" ;;
  accuracy-*)  # predicted against measured (issue 40, item 3): accuracy-MODEL:BATCH@BUDGET[+...]
    # runs PyTorch alone and `mucudnn run --memory-budget B --offload` on train_steps.py --detail
    # (each step's peak, reserved, the allocator's retries, the plan's prediction), the step
    # ACCURACY_TRACE traced (default 25); ACCURACY_STEPS (30), ACCURACY_TIMEOUT (a case, 200 s);
    # the session's profiles in $LOGS/accuracy (MUCUDNN_OFFLOAD_PROFILE), no plan cache.
    # MODEL:BATCH@BUDGET~LIMIT: the mucudnn run only, with MUCUDNN_WORKSPACE_LIMIT=LIMIT (its
    # PyTorch run is the same case's without ~ in the same call)
    mkdir -p "$LOGS/accuracy"
    for spec in $(echo "${s#accuracy-}" | tr '+' ' '); do
      limit=; case $spec in *~*) limit=${spec#*~}; spec=${spec%~*} ;; esac
      model=${spec%%:*}; rest=${spec#*:}; batch=${rest%@*}; budget=${rest#*@}; tag="${model}-${batch}-${budget}"
      args="--model $model --batch $batch --steps ${ACCURACY_STEPS:-30} --detail --trace-step ${ACCURACY_TRACE:-25} --cprofile-step ${ACCURACY_CPROFILE:-22} --snapshot-step ${ACCURACY_SNAPSHOT:-24} --memory-history-step ${ACCURACY_HISTORY:-26}"
      [ -z "$limit" ] && stage "accuracy-$tag-pytorch" 120 python3 -m benchmarks.train_steps $args
      [ -n "$limit" ] && tag="$tag-ws$limit"
      ( [ -n "$limit" ] && export MUCUDNN_WORKSPACE_LIMIT=$limit
        MUCUDNN_PLAN_CACHE=off MUCUDNN_OFFLOAD_PROFILE="$LOGS/accuracy/$tag.json" \
        stage "accuracy-$tag" ${ACCURACY_TIMEOUT:-200} $MU run --memory-budget "$budget" --offload -- \
        python3 -m benchmarks.train_steps $args )
    done ;;
  exposure-*)  # benchmarks/exposure.py: exposure-MODEL@BUDGET, where offloading's time goes at a
    # cap (the allocator's flushes, copies in flight); JSON + page in the logs
    spec=${s#exposure-}; model=${spec%@*}; budget=${spec#*@}
    stage "exposure-${model//:/_}" ${EXPOSURE_TIMEOUT:-300} python3 -m benchmarks.exposure \
      --model "$model" --budget "$budget" --out "$LOGS/exposure-${model//:/_}" ;;
  shim-*) models=${s#shim-}; stage "shim-$models" ${SHIM_TIMEOUT:-500} python3 -m benchmarks.shim_pytorch driver \
      ${SHIM_ARGS:-} --models ${models//+/ } --out "$LOGS/shim-$models" ;;
  *) echo "unknown stage $s" ;;
esac; done
# The store is in WAL mode: a stage killed at its timeout leaves committed rows in store.sqlite-wal.
# Fold them into the file before it is copied, or they stay behind on the device.
$MU store checkpoint && gzip -c "$MUCUDNN_STORE" >"$OUT/store.sqlite.gz"  # raw, it outgrew what $OUT returns
# A second call with the same OUT adds its logs to the first's (the folder went into the archive)
[ -f "$OUT/logs.tgz" ] && tar xzf "$OUT/logs.tgz" -C "$OUT" --skip-old-files
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$LOGS"
ls -la "$OUT"

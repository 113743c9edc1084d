#!/usr/bin/env bash
# GPU benchmark suite: every strategy on the same model, data and fault schedule, on whatever
# GPUs the machine has (4 if present, else 2, else 1: the count is printed and recorded).
#
#   bash benchmarks/gpu_suite.sh SUITE [OUT_DIR]
#   SUITE: smoke | probe | recovery | efficiency | goodput | goodput-half | goodput-product | recovery+efficiency | all
#          | spare | matrix-1b, matrix-1b-full (MODEL_SIZE=1b) | call1 .. call11 (what fits one 10-minute device call each;
#            call4 wants OLD_TREE=.old holding the previous commit's tree)
#          | fault-matrix | spare (a killed rank through ft_launcher: cold workers, then warm spares)
#          | restart-profile (short: where each layer's restart time goes; exit_teardown.py first)
#          | format-compare (efficiency of the checkpoint format of an older tree in OLD_TREE against
#            this one, interleaved, same model and intervals: OLD_TREE=.old holds `git archive REV
#            resilient_training components pipelines`)
#   (all: recovery, efficiency, then goodput-half; what fits one 10-minute device call on 2 GPUs)
#
# Needs NVRx 0.7.0 wheels in .whl/ (../shared/device/nvrx-wheels.sh downloads them) on a machine
# whose python3 has CUDA PyTorch. Writes each run's event log (the source of every number) to
# OUT_DIR/events-SUITE.tar.gz; `python benchmarks/report_gpu.py` turns them into tables.
set -euo pipefail
suite=${1:?suite: smoke | recovery | efficiency | goodput}
out=${2:-${OUT:-/tmp/gpu-out}}
mkdir -p "$out"
cd "$(dirname "$0")/.."
# The package as installed (pyproject maps components/ and pipelines/ into it), without pip:
# the training commands run from /tmp so the source tree's partial package does not shadow it.
rm -rf /tmp/rt && mkdir -p /tmp/rt && cp -r resilient_training /tmp/rt/
ln -s "$PWD/components" /tmp/rt/resilient_training/components
ln -s "$PWD/pipelines" /tmp/rt/resilient_training/pipelines
if [ -d .whl ]; then
  # Once per machine (the combined suites call this script again for each part).
  [ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
  export PYTHONPATH=/tmp/site:/tmp/rt PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=/tmp/rt
fi
site=${PYTHONPATH%/tmp/rt}
if [ -n "${OLD_TREE:-}" ]; then  # the same layout for the older tree, selected per run through PYTHONPATH
  rm -rf /tmp/rt-old && mkdir -p /tmp/rt-old && cp -r "$OLD_TREE/resilient_training" /tmp/rt-old/
  ln -s "$PWD/$OLD_TREE/components" /tmp/rt-old/resilient_training/components
  ln -s "$PWD/$OLD_TREE/pipelines" /tmp/rt-old/resilient_training/pipelines
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nproc=$(( gpus >= 4 ? 4 : (gpus >= 2 ? 2 : 1) ))
r1=$(( nproc > 1 ? 1 : 0 ))  # "rank 1" in the fault schedules; rank 0 on a single GPU
runs=/tmp/gpu-runs/$suite
rm -rf "$runs" && mkdir -p "$runs"
{
  echo "suite=$suite gpus=$gpus nproc=$nproc date=$(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, importlib.metadata as m; print("torch", torch.__version__, "nvrx", m.version("nvidia-resiliency-ext"), "python", __import__("sys").version.split()[0])'
  df -h /tmp | tail -1
} | tee "$runs/machine.txt"

# ~268M parameters (the size of the raw-NVRx measurement in NVRX_NOTES.md): 3.2 GB checkpoints.
MODEL=(--model-vocab-size 32000 --model-d-model 1024 --model-n-layers 16 --model-n-heads 16
       --model-seq-len 1024 --batch-size 8 --lr 3e-4)
# ~1.3B parameters (MODEL_SIZE=1b): 24 layers of d_model 2048; 16 GB checkpoints.
if [ "${MODEL_SIZE:-}" = 1b ]; then
  MODEL=(--model-vocab-size 32000 --model-d-model 2048 --model-n-layers 24 --model-n-heads 16
         --model-seq-len 1024 --batch-size 8 --lr 3e-4)
fi
# The product's own timeouts: hangs are caught by the calibrated progress guard (seconds), and on
# NCCL the collective timeout is raised above the in-process and heartbeat timeouts by the trainer.
TIMEOUTS=()
# This VM's idle GPU reports ~3.9 GB in use: a tolerance above that lets ft_launcher see the
# dead worker's memory freed instead of waiting out the timeout on every restart (with
# --no-worker-gpu-reclaim; by default the new worker waits instead and the timeout bounds that).
TIMEOUTS+=(--gpu-reclaim-timeout 10 --gpu-reclaim-tolerance-mb 6144)

run() {  # run NAME ARGS...: one training run; keep its events and launcher log, drop its checkpoints
  local name=$1; shift
  local dir=$runs/$name start=$SECONDS rc=0
  # RUN_TIMEOUT (seconds; 0: none) ends a run that would outlast the device call, so its events are still kept.
  (cd /tmp && exec timeout --kill-after=20 "${RUN_TIMEOUT:-0}" python3 -m resilient_training.cli train --nproc "$nproc" \
      --run-dir "$dir" "${MODEL[@]}" "${TIMEOUTS[@]}" "$@") \
    > "$runs/$name.out" 2>&1 || rc=$?
  echo "== $name rc=$rc $((SECONDS - start))s: $(grep -E '^(done|FAILED)' "$runs/$name.out" | tail -1)"
  [ $rc -eq 0 ] || tail -25 "$dir/logs/launcher.log" 2>/dev/null || tail -25 "$runs/$name.out" || true
  mkdir -p "$dir" && echo "$*" > "$dir/args.txt"
  rm -rf "$dir/checkpoints" /dev/shm/resilient-training
  tar czf "$out/events-$suite.tar.gz" -C /tmp/gpu-runs "$suite"  # after every run: a timeout keeps the rest
}

killed_1b() {  # killed_1b SUFFIX TIMEOUT: the 1.3B killed rank (pin-1b, sigkill@140:0), its events as events-pin-1b-SUFFIX
  MODEL_SIZE=1b RUN_TIMEOUT=$2 FAULTS=sigkill@140:0 RUN_NAME=pin_1b_auto "$0" pin-1b "$out"
  mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-$1.tar.gz"
}

probe() {  # what start-up and checkpoint I/O cost on this machine: import times, write paths
  (cd /tmp && python3 -X importtime -c 'import torch, resilient_training.runtime.worker, resilient_training.runtime.trainer, torch.distributed.fsdp, nvidia_resiliency_ext.fault_tolerance, nvidia_resiliency_ext.inprocess') \
    2> "$runs/importtime.txt" || true
  sort -t'|' -k2 -n -r "$runs/importtime.txt" > "$runs/importtime-sorted.txt" || true
  sed -n 1,25p "$runs/importtime-sorted.txt"
  python3 benchmarks/probe_io.py --gb 1.6 --dirs /dev/shm /tmp || true
}

disk() {  # sequential write+fsync and read speed of the disk the checkpoints go to
  dd if=/dev/zero of=/tmp/gpu-runs/dd.bin bs=8M count=256 conv=fsync 2>&1 | tail -1
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true
  dd if=/tmp/gpu-runs/dd.bin of=/dev/null bs=8M 2>&1 | tail -1
  rm -f /tmp/gpu-runs/dd.bin
}

case $suite in
  smoke)
    run smoke --steps 60 --checkpoint-every 20 --faults "exception@30:0,sigkill@45:0"
    ;;
  probe)
    disk | tee -a "$runs/machine.txt"
    probe 2>&1 | tee "$runs/probe.txt"
    tar czf "$out/events-$suite.tar.gz" -C /tmp/gpu-runs "$suite"
    ;;
  recovery)  # fault -> first step after restore, per layer, plus a cold relaunch baseline
    run inprocess --steps 200 --checkpoint-every 100 --local-checkpoint-every 20 --faults "exception@150:0"
    run ft_launcher --steps 200 --checkpoint-every 100 --local-checkpoint-every 20 --no-inprocess --faults "sigkill@150:0"
    run cold_relaunch --steps 200 --checkpoint-every 100 --no-inprocess --no-ft-launcher --no-async-checkpoint \
        --faults "sigkill@150:0"
    ;;
  efficiency)  # no faults: wall with checkpoints vs without, sync vs async, roomy vs tight interval
    # roomy: a save every 50 steps (~5 s) against a ~2 s write; tight: every 20 steps (~2 s), about
    # as long as one write. sync_roomy only with FULL=1 (the 10-minute call limit).
    run no_ckpt --steps 200 --checkpoint-every 100000
    run async_roomy --steps 200 --checkpoint-every 50
    run async_tight --steps 200 --checkpoint-every 20
    [ "${EFF_SHORT:-0}" = 1 ] || run async_roomy_memory --steps 200 --checkpoint-every 50 --memory-snapshot-every 5  # what the snapshots cost
    # EFF_SHORT=1: no_ckpt and the two async intervals only
    [ "${EFF_SHORT:-0}" = 1 ] || run sync_tight --steps 200 --checkpoint-every 20 --no-async-checkpoint
    if [ "${FULL:-0}" = 1 ]; then run sync_roomy --steps 200 --checkpoint-every 50 --no-async-checkpoint; fi
    ;;
  goodput)  # the reference schedule shape: 2000 steps, persistent save every 500, 5 faults
    faults="exception@300:0,sigkill@700:0,nan@1100:0,exception@1500:0,sigkill@1800:0"
    run product --steps 2000 --checkpoint-every 500 --local-checkpoint-every 25 --faults "$faults"
    run baseline_sync_launcher --steps 2000 --checkpoint-every 500 --no-async-checkpoint --no-inprocess \
        --faults "$faults"
    ;;
  goodput-half)  # the same shape at half length (device-time budget): 1000 steps, save every 250
    faults="exception@150:0,sigkill@350:0,nan@550:0,exception@750:0,sigkill@900:0"
    run product --steps 1000 --checkpoint-every 250 --local-checkpoint-every 25 --faults "$faults"
    if [ "${PRODUCT_ONLY:-0}" != 1 ]; then  # PRODUCT_ONLY=1: the device call had room for one strategy
      run baseline_sync_launcher --steps 1000 --checkpoint-every 250 --no-async-checkpoint --no-inprocess \
          --faults "$faults"
    fi
    ;;
  format-compare)  # older tree (OLD_TREE) vs this one, interleaved so drift hits both alike
    specs=("no_ckpt:--checkpoint-every 100000" "async_roomy:--checkpoint-every 50" "async_tight:--checkpoint-every 20")
    if [ "${FULL:-0}" = 1 ]; then specs+=("sync_tight:--checkpoint-every 20 --no-async-checkpoint"); fi
    for spec in "${specs[@]}"; do
      name=${spec%%:*}; read -r -a extra <<< "${spec#*:}"
      PYTHONPATH=${site}/tmp/rt-old run "old_$name" --steps "${FC_STEPS:-200}" "${extra[@]}"
      PYTHONPATH=${site}/tmp/rt run "dcp_$name" --steps "${FC_STEPS:-200}" "${extra[@]}"
    done
    ;;
  fault-matrix)  # every fault type once, in one run: layer, fault -> first step, root cause (report_gpu.py)
    run matrix --steps "${FM_STEPS:-450}" --checkpoint-every 50 --local-checkpoint-every 25 ${SPARE:+--warm-spare} \
        ${MEM:+--memory-snapshot-every 5} \
        --faults "exception@60:0,sigkill@110:$r1,oom@160:$r1,nan@210:0,ckpt-kill@250:$r1,hang@300:$r1,writer-kill@350:0,ckpt-hang@400:$r1,exception@420:0,load-hang@401:$r1"
    ;;
  call26)  # one device call (1 GPU or more): every fault type once with warm spares and the memory
    # snapshot, then the reference goodput schedule with the product's defaults (a regression check)
    SPARE=1 MEM=1 "$0" fault-matrix "$out"
    SPARE=1 "$0" goodput-product "$out"
    ;;
  call27)  # one device call (1 GPU or more): call26's fault matrix again (load-hang in a memory
    # restore), the killed-rank restart cold and from a warm spare, then call8 (--host-snapshot)
    SPARE=1 MEM=1 "$0" fault-matrix "$out"
    "$0" spare "$out"
    "$0" call8 "$out"
    ;;
  call28)  # one device call (1 GPU or more): the fault matrix after a memory restore got its own
    # budget (a load-hang there), then the reference schedule with the product's defaults
    SPARE=1 MEM=1 "$0" fault-matrix "$out"
    SPARE=1 "$0" goodput-product "$out"
    ;;
  restart-profile)  # short: where each layer's restart time goes (NVRx's phases, the agent's phases),
    # with the product's defaults: two killed ranks (launcher, warm spare) around an exception; then
    # how long a killed process with GPU and page-locked memory takes to be gone
    [ -n "${NO_EXIT_TEARDOWN:-}" ] || python3 benchmarks/exit_teardown.py 2>&1 | tee "$out/exit-teardown.txt" || true
    run restart_profile --steps 400 --checkpoint-every 200 --local-checkpoint-every 25 --memory-snapshot-every 5 \
        --warm-spare --faults "sigkill@150:0,exception@250:0,sigkill@350:0"
    ;;
  spare)  # the launcher path for a killed rank, twice: workers started cold, then taken from warm spares
    run spare_off --steps 200 --checkpoint-every 100 --local-checkpoint-every 20 --no-inprocess \
        --faults "sigkill@150:0"
    run spare_on --steps 200 --checkpoint-every 100 --local-checkpoint-every 20 --no-inprocess --warm-spare \
        --faults "sigkill@150:0"
    ;;
  matrix-1b)  # the in-process and launcher rows on the ~1.3B model (run with MODEL_SIZE=1b)
    # One GPU holds all 16 GB of a save (weights + AdamW): no node-local tier in /dev/shm then, and
    # one checkpoint kept (3 kept + the one in flight filled the 64 GB disk: 2026-11-30, call5).
    local=(--keep-last 1); [ "$nproc" -gt 1 ] && local=(--local-checkpoint-every 20)
    run matrix_1b --steps "${FM_STEPS:-220}" --checkpoint-every 40 "${local[@]}" --warm-spare --memory-snapshot-every 5 \
        --faults "exception@50:0,sigkill@90:$r1,hang@130:$r1,oom@160:$r1,nan@190:0"
    ;;
  matrix-1b-full)  # every fault type once (fault-matrix's schedule) on the ~1.3B model (run with MODEL_SIZE=1b),
    # with warm spares and memory snapshots; as matrix-1b, one checkpoint kept and, on one GPU, no node-local tier
    local=(--keep-last 1); [ "$nproc" -gt 1 ] && local=(--local-checkpoint-every 25)
    run matrix_1b_full --steps "${FM_STEPS:-450}" --checkpoint-every 50 "${local[@]}" --warm-spare --memory-snapshot-every 5 \
        ${SPARE_WRITER:+--spare-writer} \
        --faults "exception@60:0,sigkill@110:$r1,oom@160:$r1,nan@210:0,ckpt-kill@250:$r1,hang@300:$r1,writer-kill@350:0,ckpt-hang@400:$r1,exception@420:0,load-hang@401:$r1"
    ;;
  call29)  # one device call: matrix-1b-full (each run ended by 540 s so that its events are kept)
    MODEL_SIZE=1b RUN_TIMEOUT=540 "$0" matrix-1b-full "$out"
    ;;
  verify)  # the writer layer, a hang inside a save and a plain hang, after this round's fixes (short)
    # Spaced so that each is over before the next: a writer-kill tears the file only once the
    # shard is written (3.2 GB: ~5 s on one GPU).
    run verify --steps 260 --checkpoint-every 50 --local-checkpoint-every 25 --memory-snapshot-every 5 \
        --faults "writer-kill@100:0,ckpt-hang@200:$r1,hang@240:$r1"
    ;;
  call5)  # one device call: the 1.3B rows, then the verify run
    MODEL_SIZE=1b "$0" matrix-1b "$out"
    "$0" verify "$out"
    ;;
  call1)  # one device call: the spare pair, the fault matrix with spares, the 1.3B rows
    "$0" spare "$out"
    SPARE=1 "$0" fault-matrix "$out"
    MODEL_SIZE=1b "$0" matrix-1b "$out"
    ;;
  call2)  # one device call: the reference goodput schedule with spares, then async efficiency
    SPARE=1 "$0" goodput-product "$out"
    "$0" efficiency "$out"
    ;;
  goodput-product)  # the reference schedule, the product's strategy only (OLD_TREE: that tree's, for before/after)
    faults="exception@300:0,sigkill@700:0,nan@1100:0,exception@1500:0,sigkill@1800:0"
    if [ -n "${OLD_TREE:-}" ]; then
      PYTHONPATH=${site}/tmp/rt-old run product_before --steps 2000 --checkpoint-every 500 --local-checkpoint-every 25 \
          ${SPARE:+--warm-spare} --faults "$faults"
    else
      # LOCAL_EVERY / WRITE_THREADS: the node-local interval and write threads (what a launcher restart rolls back to)
      run "${RUN_NAME:-product}" --steps 2000 --checkpoint-every 500 --local-checkpoint-every "${LOCAL_EVERY:-25}" \
          --memory-snapshot-every "${MEM_EVERY:-5}" ${WRITE_THREADS:+--checkpoint-write-threads "$WRITE_THREADS"} \
          ${SPARE:+--warm-spare} ${HOST:+--host-snapshot} ${SPARE_WRITER:+--spare-writer} --faults "$faults"
    fi
    ;;
  call8)  # one device call: the reference goodput schedule with spares and --host-snapshot (a killed
    # rank resumes from the newest memory snapshot, kept in host shared memory)
    SPARE=1 HOST=1 RUN_NAME=product_host "$0" goodput-product "$out"
    ;;
  pair)  # one device call: call8 (--host-snapshot), then the product's defaults with spares
    "$0" call8 "$out"
    mv "$out/events-goodput-product.tar.gz" "$out/events-host.tar.gz"  # the next run reuses the suite's folder
    SPARE=1 "$0" goodput-product "$out"
    ;;
  spare-context)  # A/B, alternating: killed-rank restarts from warm spares without and with the CUDA
    # context made ahead (600 steps, two SIGKILLs each, node-local every 25, memory snapshot every 5)
    for i in 1 2; do
      for arm in off on; do
        flag=--spare-cuda-context; [ "$arm" = off ] && flag=--no-spare-cuda-context
        run "ctx_${arm}_$i" --steps 600 --checkpoint-every 500 --local-checkpoint-every 25 --memory-snapshot-every 5 \
            --warm-spare "$flag" --faults sigkill@210:0,sigkill@420:0
      done
    done
    ;;
  call9)  # one device call: the host snapshot's read-back on the GPU (mapped and pageable, against read
    # through page-locked buffers; 3.2 GB like the 268M model's), then call8
    python3 benchmarks/host_snapshot_read.py --device cuda --gb 3.2 --repeat 3 2>&1 | tee "$out/host-snapshot-read.txt"
    "$0" call8 "$out"
    ;;
  call31)  # one device call: how fast 16 GB of staging buffers can be page-locked (1, 2, 4 threads), and a
    # pageable save copy instead, alone and beside training (the 1.3B first-save deferral), then 3.2 GB
    python3 benchmarks/pin_rate.py --gb 16 2>&1 | tee "$out/pin-rate-16gb.txt" || true
    python3 benchmarks/pin_rate.py --gb 3.2 2>&1 | tee "$out/pin-rate-3gb.txt" || true
    ;;
  pin-1b)  # the 1.3B model: how long a new process's 16 GB of staging buffers take to page-lock, whether
    # the first save waits for them, and a killed rank's restart once a checkpoint is committed
    # WRITE_THREADS: DCP files per rank (a restore reads them in parallel)
    run "${RUN_NAME:-pin_1b}" --steps "${FM_STEPS:-200}" --checkpoint-every "${CKPT_EVERY:-50}" --keep-last 1 --warm-spare --memory-snapshot-every 5 \
        ${WRITE_THREADS:+--checkpoint-write-threads "$WRITE_THREADS"} ${HOST:+--host-snapshot} \
        ${LOCAL_EVERY:+--local-checkpoint-every "$LOCAL_EVERY"} ${SPARE_WRITER:+--spare-writer} --faults "${FAULTS:-sigkill@120:0}"
    ;;
  call32)  # one device call: pin-1b (staging buffers page-locked from one thread, no thread per call)
    MODEL_SIZE=1b RUN_TIMEOUT=500 "$0" pin-1b "$out"
    ;;
  call33)  # one device call: pin_rate.py with the ways of making the buffers, then pin-1b (staging buffers
    # made in shared memory directly, no private copy)
    python3 benchmarks/pin_rate.py --gb 16 2>&1 | tee "$out/pin-rate-16gb.txt" || true
    MODEL_SIZE=1b RUN_TIMEOUT=400 "$0" pin-1b "$out"
    ;;
  call34)  # one device call: pin-1b with the staging buffers' pages written before they are page-locked
    MODEL_SIZE=1b RUN_TIMEOUT=400 "$0" pin-1b "$out"
    ;;
  call35)  # one device call: pin-1b with the staging buffers' pages written from several threads first
    MODEL_SIZE=1b RUN_TIMEOUT=400 "$0" pin-1b "$out"
    ;;
  call38)  # one device call: pin-1b with 16 DCP files per rank (a 1.3B restore read 16 GB from 4 files
    # in 5.3 s), then the reference schedule with the node-local tier every 10 steps instead of 25
    MODEL_SIZE=1b RUN_TIMEOUT=200 WRITE_THREADS=16 RUN_NAME=pin_1b_16 "$0" pin-1b "$out"
    SPARE=1 LOCAL_EVERY=10 RUN_NAME=product_local10 RUN_TIMEOUT=330 "$0" goodput-product "$out"
    ;;
  call39)  # one device call, A/B on one machine (call38's ran 1.8x faster steps than call36's): the 1.3B
    # restart with the default files per rank (now 16 at 1.3B) and with 4, then the reference schedule with
    # the node-local tier every 25 and every 10 steps (the last only while the call has time for it)
    MODEL_SIZE=1b RUN_TIMEOUT=200 RUN_NAME=pin_1b_auto "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-auto.tar.gz"
    MODEL_SIZE=1b RUN_TIMEOUT=200 WRITE_THREADS=4 RUN_NAME=pin_1b_4 "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-4.tar.gz"
    SPARE=1 RUN_TIMEOUT=$(( 560 - SECONDS )) "$0" goodput-product "$out"
    mv "$out/events-goodput-product.tar.gz" "$out/events-product-local25.tar.gz"
    if [ $(( 560 - SECONDS )) -gt 150 ]; then
      SPARE=1 LOCAL_EVERY=10 RUN_NAME=product_local10 RUN_TIMEOUT=$(( 560 - SECONDS )) "$0" goodput-product "$out"
    fi
    ;;
  call40)  # one device call: call39's A/B again with the kill at step 140 (on call39's machine the write of
    # step 50 took 10-12 s and was still running at 120, so both restarts began at step 0), then node-local every 10
    killed_1b auto 200
    MODEL_SIZE=1b RUN_TIMEOUT=200 FAULTS=sigkill@140:0 WRITE_THREADS=4 RUN_NAME=pin_1b_4 "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-4.tar.gz"
    if [ $(( 560 - SECONDS )) -gt 150 ]; then
      SPARE=1 LOCAL_EVERY=10 RUN_NAME=product_local10 RUN_TIMEOUT=$(( 560 - SECONDS )) "$0" goodput-product "$out"
    fi
    ;;
  call41)  # one device call: the 1.3B killed rank with --host-snapshot (restored from host shared memory
    # instead of 16 GB from disk: call40 read it in 4.9 s), then the reference schedule with --host-snapshot
    # on another machine than call37's (2.23 s lost per fault)
    df -h /dev/shm | tee "$out/shm.txt" || true
    MODEL_SIZE=1b RUN_TIMEOUT=200 HOST=1 LOCAL_EVERY=25 FAULTS=sigkill@140:0 RUN_NAME=pin_1b_host "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-host.tar.gz"
    if [ $(( 560 - SECONDS )) -gt 150 ]; then
      SPARE=1 HOST=1 RUN_NAME=product_host RUN_TIMEOUT=$(( 560 - SECONDS )) "$0" goodput-product "$out"
    fi
    ;;
  call42)  # one device call: call41's 1.3B run (it lacked the node-local tier --host-snapshot needs), then
    # the same run without --host-snapshot on the same machine (the restore read from disk)
    MODEL_SIZE=1b RUN_TIMEOUT=200 HOST=1 LOCAL_EVERY=25 FAULTS=sigkill@140:0 RUN_NAME=pin_1b_host "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-host.tar.gz"
    killed_1b auto 200
    ;;
  call43)  # one device call: the 1.3B killed rank restored from the node-local tier (/dev/shm, every 50
    # steps; persistent saves only at the end) instead of from disk, then from disk on the same machine
    MODEL_SIZE=1b RUN_TIMEOUT=200 CKPT_EVERY=500 LOCAL_EVERY=50 FAULTS=sigkill@140:0 RUN_NAME=pin_1b_local "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-local.tar.gz"
    killed_1b auto 200
    ;;
  call44)  # one device call: call42's --host-snapshot run and call43's node-local run again, after the two
    # fixes they called for (a hang reported after the last commit; one at the second step after a restart)
    MODEL_SIZE=1b RUN_TIMEOUT=200 HOST=1 LOCAL_EVERY=25 FAULTS=sigkill@140:0 RUN_NAME=pin_1b_host "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-host.tar.gz"
    MODEL_SIZE=1b RUN_TIMEOUT=200 CKPT_EVERY=500 LOCAL_EVERY=50 FAULTS=sigkill@140:0 RUN_NAME=pin_1b_local "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-local.tar.gz"
    ;;
  call45)  # one device call: the 1.3B killed rank restored by the direct DCP reader (chunks read straight
    # into the GPU state through page-locked buffers; call43 read 16 GB in 5.68 s), then how fast a new
    # process reads 16 GB of DCP files each way (DCP's reader, the per-file reader before, direct x4/8/16)
    killed_1b auto 200
    timeout $(( 575 - SECONDS )) python3 benchmarks/dcp_read.py --gb 16 --files 16 --dir /tmp --repeat 2 \
        --ways dcp:1,per-file:8,direct:8,direct:16,direct:4,layout:8 2>&1 | tee "$out/dcp-read.txt" || true
    ;;
  call46)  # one device call: the reference schedule with the product's defaults and spares on the direct
    # reader (call39: 3.41 s lost per fault), then the 1.3B killed rank again on this machine
    SPARE=1 RUN_TIMEOUT=330 "$0" goodput-product "$out"
    if [ $(( 570 - SECONDS )) -gt 170 ]; then
      killed_1b auto $(( 570 - SECONDS ))
    fi
    ;;
  call47)  # one device call: the 1.3B killed rank with the load split into load_prepare (DCP's state dict,
    # the optimizer's state made) / load_read / load_checkpoint (set_state_dict): call45's read 16 GB in
    # 1.5 s in dcp_read.py, yet its load took 5.68 s
    killed_1b auto ${RUN_TIMEOUT:-160}
    ;;
  call48)  # one device call: the 1.3B killed rank after call47 (7.01 s: 1.02 s the teardown waiting for
    # the dead worker's exit, 0.98 s the first step): the teardown no longer waits for an exiting
    # process and spares warm their kernels; then the reference schedule with the defaults (call46:
    # 3.19 s lost per fault), then the 1.3B again if the call has room
    killed_1b auto 150
    SPARE=1 RUN_TIMEOUT=$(( 560 - SECONDS )) "$0" goodput-product "$out"
    if [ $(( 570 - SECONDS )) -gt 140 ]; then
      MODEL_SIZE=1b RUN_TIMEOUT=$(( 570 - SECONDS )) FAULTS=sigkill@140:0 RUN_NAME=pin_1b_auto2 "$0" pin-1b "$out"
      mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-auto2.tar.gz"
    fi
    ;;
  call49)  # one device call: after call48 (1.3B killed rank 6.56/6.68 s, the reference schedule 3.49 s lost
    # per fault) the ranks agree through the store before a restore and the communicator is built
    # on a thread while the checkpoint loads: the 1.3B killed rank, then the reference schedule
    killed_1b auto 150
    SPARE=1 RUN_TIMEOUT=$(( 570 - SECONDS )) "$0" goodput-product "$out"
    ;;
  call50)  # one device call (short): call49's in-process restarts took 1.38-1.46 s (call48: 1.06-1.20),
    # find_checkpoint 0.39 s without the communicator's set-up: find_restorable now laps find_settle and
    # find_scan. Two exceptions and a killed rank, 500 steps, the reference schedule's saves
    run product_short --steps 500 --checkpoint-every 500 --local-checkpoint-every 25 --memory-snapshot-every 5 \
        --warm-spare --faults exception@150:0,exception@300:0,sigkill@400:0
    ;;
  call76)  # the end of a session's device time (~300 s): the 1.3B writer-kill alone with --spare-writer
    # (call73 without: 4.91 s death -> new writer; call75: 6.60), then a hang in the 1.3B's final save, which is
    # now restored from its memory snapshot and written again (call74/75 replayed 50 and 100 steps)
    # (Each run's tarball renamed: both are pin-1b's. call76 itself lost the first run's so, and
    # call77 ran it again.)
    SPARE_WRITER=1 MODEL_SIZE=1b RUN_TIMEOUT=150 FM_STEPS=160 FAULTS=writer-kill@100:0 RUN_NAME=writer_1b_spare \
      "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-writer-1b-spare.tar.gz"
    MODEL_SIZE=1b RUN_TIMEOUT=150 FM_STEPS=150 FAULTS=ckpt-hang@150:0 RUN_NAME=final_hang_1b "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-final-hang-1b.tar.gz"
    ;;
  call80)  # (run at 1a8c933: both runs recovered all 5 faults, then hit RUN_TIMEOUT before their end: this host's
    # steps took 0.111-0.114 s, not 0.088; give the second run 300 s next time)
    # one device call: call79's reference schedule stopped at its first launcher restart (at world size 1 a
    # node-local step's manifest names no ranks: the restore took it for a persistent one the event log never
    # committed, and refused it; fixed), so again with --spare-writer, then without it on the same code
    SPARE=1 SPARE_WRITER=1 RUN_NAME=product_spare_writer RUN_TIMEOUT=280 "$0" goodput-product "$out"
    mv "$out/events-goodput-product.tar.gz" "$out/events-product-spare-writer.tar.gz"
    if (( 570 - SECONDS >= 230 )); then
      SPARE=1 RUN_TIMEOUT=$(( 570 - SECONDS )) "$0" goodput-product "$out"
    fi
    ;;
  call79)  # one device call (run: it stopped at the first launcher restart, see call80): what --spare-writer costs where there is no writer death, to decide its
    # default on GPUs: the reference schedule with it (call70/72/75 without: 89.2-89.9 % training, 2.44-2.68 s per
    # fault), then the 1.3B matrix with it (call74/75 without: the writer row 4.91-6.60 s)
    SPARE=1 SPARE_WRITER=1 RUN_NAME=product_spare_writer RUN_TIMEOUT=300 "$0" goodput-product "$out"
    if (( 570 - SECONDS >= 200 )); then
      SPARE_WRITER=1 MODEL_SIZE=1b RUN_TIMEOUT=$(( 570 - SECONDS )) "$0" matrix-1b-full "$out"
    fi
    ;;
  call78)  # the end of a session's device time (~200 s): --spare-writer's steady state during training (in call77
    # the writer died after the last step): the same run, 260 steps
    SPARE_WRITER=1 MODEL_SIZE=1b RUN_TIMEOUT=170 FM_STEPS=260 FAULTS=writer-kill@100:0 RUN_NAME=writer_1b_spare \
      "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-writer-1b-spare.tar.gz"
    ;;
  call77)  # call76's first run again (its events were overwritten by the second's)
    SPARE_WRITER=1 MODEL_SIZE=1b RUN_TIMEOUT=150 FM_STEPS=160 FAULTS=writer-kill@100:0 RUN_NAME=writer_1b_spare \
      "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-writer-1b-spare.tar.gz"
    ;;
  call75)  # one device call: call71's restore_check_cost.py again (its "read" way raced in call71; fixed in f6bcf9e),
    # then the 1.3B matrix a second time with carried saves (call74), then the reference schedule if room
    "$0" call71 "$out"
    MODEL_SIZE=1b RUN_TIMEOUT=240 "$0" matrix-1b-full "$out"
    if (( 570 - SECONDS >= 150 )); then
      SPARE=1 RUN_TIMEOUT=$(( 570 - SECONDS < 300 ? 570 - SECONDS : 300 )) "$0" goodput-product "$out"
    fi
    ;;
  call74)  # one device call: call72 again (the 1.3B matrix, then the reference schedule) with saves in flight at an
    # in-process restart carried (call72 dropped them: its launcher restarts restored 0 and 50, rolling back 109 and
    # 201 steps); report_gpu.py's "Restores and carried saves" table shows each restore's step
    "$0" call72 "$out"
    ;;
  call73)  # the end of a session's device time (~200 s): the 1.3B writer-kill alone (in call72's matrix the
    # writer died ~10 s after the save of step 400 began, inside exception@420's in-process restart)
    MODEL_SIZE=1b RUN_TIMEOUT=150 FM_STEPS=160 FAULTS=writer-kill@100:0 RUN_NAME=writer_1b "$0" pin-1b "$out"
    ;;
  call72)  # one device call: every fault type once on the 1.3B again (last: call29c, fourteenth round, older code),
    # then the reference schedule a second time on this code (call70: 2.68 s lost per fault)
    MODEL_SIZE=1b RUN_TIMEOUT=300 "$0" matrix-1b-full "$out"
    if (( 570 - SECONDS >= 150 )); then
      SPARE=1 RUN_TIMEOUT=$(( 570 - SECONDS < 300 ? 570 - SECONDS : 300 )) "$0" goodput-product "$out"
    fi
    ;;
  call71)  # one device call (short): call70's 268M steps overlapping the restore check took 0.16-0.18 s against
    # 0.096 s (1.3B: 0.18-0.19 against 0.18). restore_check_cost.py: the check as the product does it, ways around
    # it, the staging preparation alone and both at once (as after a launcher restart), at 3.2 and 16 GB
    timeout 150 python3 benchmarks/restore_check_cost.py --gb 3.2 --files 8 --tensors 200 --repeat 2 2>&1 \
      | tee "$out/restore-check-cost.txt" || true
    timeout 200 python3 benchmarks/restore_check_cost.py --gb 16 --files 8 --tensors 879 --repeat 1 2>&1 \
      | tee "$out/restore-check-cost-16.txt" || true
    ;;
  call70)  # one device call: call68 measured the staging allocation outside the GIL (the 1.3B's second step after
    # a restart 0.19-0.20 s, was 1.4-3.1 s); the reference schedule with it (lost/fault 1.97-2.87 s in call64/65),
    # then the 1.3B killed rank again if the call has room
    SPARE=1 RUN_TIMEOUT=300 "$0" goodput-product "$out"
    if (( 560 - SECONDS >= 115 )); then
      killed_1b auto3 $(( 560 - SECONDS ))
    fi
    ;;
  call69)  # the end of a session's device time (~180 s): staging_prepare.py once each way, nothing else
    timeout 100 python3 benchmarks/staging_prepare.py --gb 16 --tensors 879 --repeat 1 --ways none,memset,product 2>&1 \
      | tee "$out/staging-prepare.txt" || true
    ;;
  call68)  # one device call: call67 found the stall in allocating the storages (torch's _new_shared holds
    # the GIL: one 16 GB storage held one step 1.5-3.2 s); shared_empty now allocates outside it. staging_prepare.py
    # before/now, then the 1.3B killed rank (second step after the restart: 1.4-3.1 s in call61-67), twice if room
    timeout 120 python3 benchmarks/staging_prepare.py --gb 16 --tensors 879 --repeat 2 --ways none,memset,product 2>&1 \
      | tee "$out/staging-prepare.txt" || true
    killed_1b auto 200
    if (( 540 - SECONDS >= 115 )); then
      killed_1b auto2 $(( 540 - SECONDS ))
    fi
    ;;
  call67)  # one device call (at 6755c53, one storage for all the buffers, since reverted): call66 found the step
    # held while the 879 shared storages were made; was it their number? staging_prepare.py per-buffer vs one
    # storage ("slab"; the script's ways have changed since), then the 1.3B killed rank (second step 1.4-3.1 s)
    timeout 120 python3 benchmarks/staging_prepare.py --gb 16 --tensors 879 --repeat 2 --ways none,memset,slab 2>&1 \
      | tee "$out/staging-prepare.txt" || true
    killed_1b auto 200
    if (( 540 - SECONDS >= 115 )); then
      killed_1b auto2 $(( 540 - SECONDS ))
    fi
    ;;
  call66)  # one device call (short): call65's staging_prepare.py found one step of 1.0-1.4 s while the 16 GB
    # were made, with memset as with zero_: which part of the preparation it overlapped, and without page-locking
    timeout 150 python3 benchmarks/staging_prepare.py --gb 16 --tensors 879 --repeat 2 \
      --ways none,memset,nolock,zero_ 2>&1 | tee "$out/staging-prepare.txt" || true
    ;;
  call65)  # one device call: the step after a restored process's first step took 2.1-3.1 s on the 1.3B
    # (0.5-0.85 s on the 268M) while its staging buffers' pages were written (Tensor.zero_ on PyTorch's
    # intra-op threads, eight pieces at once); now one memset a piece. staging_prepare.py both ways, then
    # call63's runs (the 1.3B killed rank, the reference schedule, the 1.3B again if the call has room)
    timeout 90 python3 benchmarks/staging_prepare.py --gb 16 --tensors 879 --repeat 2 2>&1 \
      | tee "$out/staging-prepare.txt" || true
    killed_1b auto 200
    SPARE=1 RUN_TIMEOUT=$(( 575 - SECONDS < 300 ? 575 - SECONDS : 300 )) "$0" goodput-product "$out"
    if (( 575 - SECONDS >= 115 )); then
      killed_1b auto2 $(( 575 - SECONDS ))
    fi
    ;;
  call64)  # one device call: call63 again with the check begun after the first step (RestoreCheck.POLLS_BEFORE;
    # begun at the restore it held the first step back: 0.52-0.77 s against 0.38-0.58 s)
    "$0" call63 "$out"
    ;;
  call63)  # one device call: each restore from storage is now hashed behind it (RestoreCheck, 4 threads a
    # rank, commits wait for it): call61's runs again, for the check's seconds (16 GB on the 1.3B) and the
    # steps trained meanwhile, and fault -> first step with it (call61: 3.65-4.67 s; 2.12-2.66 s)
    killed_1b auto 200
    SPARE=1 RUN_TIMEOUT=300 "$0" goodput-product "$out"
    if (( 575 - SECONDS >= 115 )); then
      killed_1b auto2 $(( 575 - SECONDS ))
    fi
    ;;
  call62)  # one device call (~490 s of budget left): the restore reads each file's bytes as soon as its chunks
    # are placed (pipelined), where before every file's layout came first (0.40 s of a 1.5 s read of 16 GB
    # in call45): dcp_read.py direct vs layout-first, then the 1.3B killed rank (call59/61: 3.65-4.67 s)
    python3 benchmarks/dcp_read.py --gb 16 --files 16 --repeat 2 --ways direct:8,layout-first:8,layout:8 2>&1 \
      | tee "$out/dcp-read.txt" || true
    MODEL_SIZE=1b RUN_TIMEOUT=$(( 560 - SECONDS < 200 ? 560 - SECONDS : 200 )) FAULTS=sigkill@140:0 \
      RUN_NAME=pin_1b_auto "$0" pin-1b "$out"
    mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-auto.tar.gz"
    ;;
  call61)  # one device call: call59's 1.3B killed rank and call60's reference schedule again (read buffers
    # made by the spare: 3.65 s, and 2.12/2.20 s killed ranks, one run each), then the 1.3B a third time if
    # the call has room
    killed_1b auto 200
    SPARE=1 RUN_TIMEOUT=300 "$0" goodput-product "$out"
    if (( 575 - SECONDS >= 115 )); then
      killed_1b auto2 $(( 575 - SECONDS ))
    fi
    ;;
  call60)  # one device call: the reference schedule with spares whose read buffers are made (call57/58:
    # killed ranks 2.43-2.68 s, load_read 1.09-1.11 s for 3.2 GB; 2.75/2.87 s lost per fault)
    SPARE=1 RUN_TIMEOUT=${RUN_TIMEOUT:-300} "$0" goodput-product "$out"
    grep -h "spare for local rank" /tmp/gpu-runs/goodput-product/*/logs/spare-pool-*.log 2>/dev/null | head -4 || true
    ;;
  call59)  # one device call: a warm spare also makes the restore's page-locked read buffers
    # (tensor_read.warm_buffers; a fresh process's first read of 3.2 GB took 0.90 s against 0.4 s once they
    # existed): first_step.py base vs buffers (load, host_allocs, host_alloc_s), then the 1.3B killed rank
    # (call57: load_read 2.67 s of 4.95 s)
    python3 benchmarks/first_step.py --variants base,buffers --repeat 2 2>&1 | tee "$out/first-step.txt" || true
    killed_1b auto 200
    grep -h "spare for local rank" /tmp/gpu-runs/pin-1b/*/logs/spare-pool-*.log 2>/dev/null | head -4 || true
    ;;
  call58)  # one device call (~400 s of budget left): call57's reference schedule again (2.75 s lost per fault)
    SPARE=1 RUN_TIMEOUT=${RUN_TIMEOUT:-300} "$0" goodput-product "$out"
    ;;
  call57)  # one device call: a warm spare warms the run's first optimizer step on fake tensors before it
    # has work (step_warmup; call56: that step took 0.83 s of a restored 1.3B's first step, 0.03 s once
    # warmed): the 1.3B killed rank (call52-54: 4.93-7.32 s), then the reference schedule (2.78-3.44 s/fault)
    killed_1b auto 200
    grep -h "spare for local rank" /tmp/gpu-runs/pin-1b/*/logs/spare-pool-*.log 2>/dev/null | head -4 || true
    SPARE=1 RUN_TIMEOUT=$(( 560 - SECONDS )) "$0" goodput-product "$out"
    grep -h "spare for local rank" /tmp/gpu-runs/goodput-product/*/logs/spare-pool-*.log 2>/dev/null | head -4 || true
    ;;
  call56)  # one device call: the first step warmed up on fake tensors while the checkpoint is read (a
    # trainer change measured here and reverted: 6.10 s against 4.93-5.15; first_step.py's warm_step is that
    # code; call55: the first step after a 1.3B restore took 1.06 s against 0.17 s, and it was not memory):
    # the 1.3B killed rank, then first_step.py's base, warm and warm_serial
    killed_1b auto 200
    python3 benchmarks/first_step.py --variants base,warm,warm_serial --repeat 2 2>&1 | tee "$out/first-step.txt" || true
    ;;
  call55)  # one device call: where a restored 1.3B rank's first step goes (1.1-1.8 s against 0.18 s steady)
    # and what takes it off the critical path (first_step.py: victim killed, warm restorer, four variants)
    python3 benchmarks/first_step.py --repeat 3 2>&1 | tee "$out/first-step.txt" || true
    ;;
  call54)  # one device call with ~310 s of budget left: the 1.3B killed rank a third time (call52: 5.15 s,
    # call53: 4.93 s), capped so that the run ends inside the call
    killed_1b auto ${RUN_TIMEOUT:-120}
    ;;
  call53)  # one device call: call52 again (the 1.3B killed rank: 5.15 s; the reference schedule: 3.05 s lost
    # per fault), then the 1.3B once more if the call has room; the device time left was ~630 s
    killed_1b auto 200
    SPARE=1 RUN_TIMEOUT=$(( 420 - SECONDS )) "$0" goodput-product "$out"
    if [ $(( 440 - SECONDS )) -gt 120 ]; then
      MODEL_SIZE=1b RUN_TIMEOUT=$(( 440 - SECONDS )) FAULTS=sigkill@140:0 RUN_NAME=pin_1b_again "$0" pin-1b "$out"
      mv "$out/events-pin-1b.tar.gz" "$out/events-pin-1b-again.tar.gz"
    fi
    ;;
  call52)  # one device call: the optimizer's state made without DCP's zero step (optim_init.py, both ways
    # in fresh processes), the 1.3B killed rank with it (call49: 6.34 s, call51: 6.75 s), then the
    # reference schedule again (call51: 2.78 s lost per fault, one run)
    python3 benchmarks/optim_init.py --repeat 2 2>&1 | tee "$out/optim-init.txt" || true
    killed_1b auto 200
    if [ $(( 570 - SECONDS )) -gt 240 ]; then
      SPARE=1 RUN_TIMEOUT=$(( 570 - SECONDS )) "$0" goodput-product "$out"
    fi
    ;;
  call51)  # one device call: what call49/50 left unmeasured: the reference schedule with the gathers of a
    # world of one skipping the store (d84dfaf; find_scan was 0.20 s in every restart), then the 1.3B
    # killed rank (call49: 6.34 s) if the call has room
    SPARE=1 RUN_TIMEOUT=420 "$0" goodput-product "$out"
    if [ $(( 570 - SECONDS )) -gt 140 ]; then
      killed_1b auto $(( 570 - SECONDS ))
    fi
    ;;
  call10)  # one device call: page-locking beside training (back to back against paused), the host
    # snapshot's read-back on the GPU, then call8 (the reference schedule with --host-snapshot)
    python3 benchmarks/pin_contention.py 2>&1 | tee "$out/pin-contention.txt"
    python3 benchmarks/host_snapshot_read.py --device cuda --gb 3.2 --repeat 3 2>&1 | tee "$out/host-snapshot-read.txt" || true
    "$0" call8 "$out"
    ;;
  call11)  # one device call: the reference goodput schedule with spares (the product's defaults), then
    # the short efficiency set (no checkpoints, async every 50, async every 20)
    SPARE=1 "$0" goodput-product "$out"
    EFF_SHORT=1 "$0" efficiency "$out"
    ;;
  call7)  # one device call: the reference goodput schedule with spares twice: node-local every 25 (4 write
    # threads), then every 10 with 8 threads (a launcher restart rolls back to the newest node-local step)
    SPARE=1 "$0" goodput-product "$out"
    mv "$out/events-goodput-product.tar.gz" "$out/events-goodput-product-local25.tar.gz"  # the next run reuses the name
    SPARE=1 LOCAL_EVERY=10 WRITE_THREADS=8 RUN_NAME=product_local10 "$0" goodput-product "$out"
    ;;
  call3)  # one device call (1 GPU or more): the verify run, then the reference goodput schedule with spares
    "$0" verify "$out"
    SPARE=1 "$0" goodput-product "$out"
    ;;
  call4)  # one device call: the same schedule on the previous tree (OLD_TREE), then async efficiency
    SPARE=1 "$0" goodput-product "$out"
    OLD_TREE= "$0" efficiency "$out"
    ;;
  call6)  # one device call: the reference goodput schedule with spares (parallel checkpoint writes),
    # the write rates by thread count, then the short efficiency set
    SPARE=1 "$0" goodput-product "$out"
    "$0" probe "$out"
    EFF_SHORT=1 "$0" efficiency "$out"
    ;;
  recovery+efficiency)
    "$0" recovery "$out"
    "$0" efficiency "$out"
    ;;
  recovery+goodput-half)
    "$0" recovery "$out"
    "$0" goodput-half "$out"
    ;;
  all)
    "$0" recovery "$out"
    "$0" efficiency "$out"
    "$0" goodput-half "$out"
    ;;
  *) echo "unknown suite $suite" >&2; exit 2 ;;
esac
ls -la "$out"

#!/usr/bin/env bash
# Everything a GPU machine is asked to check, in parts that each fit one 10-minute device command.
# Run from the repository root on the GPU machine (its python3 has CUDA PyTorch; towerflow runs
# from the working tree, never installed). Results go under $OUT (default ./gpu-results).
#
#   bash benchmarks/gpu_session.sh tests    # the gpu-marked tests, verbose, with skip reasons
#   bash benchmarks/gpu_session.sh suite    # the whole suite, gpu tests included, 8 workers
#   bash benchmarks/gpu_session.sh bench    # training vs plain PyTorch, prefetch, smi vs nvidia-smi, Pi, ps on GPU
#   bash benchmarks/gpu_session.sh all      # the three in turn (over 10 minutes: not for one device command)
#   bash benchmarks/gpu_session.sh short    # the three in one 10-minute command: each part and command bounded,
#                                           # the suite without the real schedulers (no package registry there)
#   bash benchmarks/gpu_session.sh check    # one 10-minute command: the gpu tests beside the rest of the suite
#                                           # (16 cores hold both), then smi and the sparse ps, GPU against CPU,
#                                           # each with 10 steps of its workers profiled
#   bash benchmarks/gpu_session.sh profile  # the sparse ps's workers under torch.profiler, on the GPU then the
#                                           # CPU (10 steps each from global step 200; tables in $OUT/profile-*)
#   bash benchmarks/gpu_session.sh replicas # CPU only: what --ps-replicas 2 costs the small MLP job with the
#                                           # machine's cores, then with 2 of them (taskset), as on the 2-core VMs
#
# Every failure's report is written to $OUT/failures-PID.log as it happens (benchmarks/_failures_now.py), so a
# part cut short by its bound still says why each test it ran failed.
# The MNIST tests and the ps run need the digits at ../shared/data/mnist-t10k; MNIST_DIR=DIR points
# elsewhere and is copied there (the device tool carries an ignored folder of the checkout, not ../shared).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # keeps a carried site folder
PY=${PY:-python3}
if [ -n "${MNIST_DIR:-}" ] && [ ! -d ../shared/data/mnist-t10k ]; then
    mkdir -p ../shared/data && cp -r "$MNIST_DIR" ../shared/data/mnist-t10k
fi

environment() {
    { date -u; nvidia-smi; $PY -c 'import torch, sys; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda,
"gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")'; nproc; free -g; } \
        > "$OUT/environment.txt" 2>&1
}

tests() {
    $PY -m pytest -m gpu -v -rfEs -p no:cacheprovider -p _failures_now --timeout 120 --durations=0 tests 2>&1 | tee "$OUT/gpu_tests.log"
}

# verbose into the log, so a run cut short still names every test that failed; the summary on the terminal
suite() {
    $PY -m pytest -v -rfE -p no:cacheprovider -p no:benchmark -p _failures_now --timeout 100 -n 8 --dist loadgroup --durations=20 \
        "$@" tests > "$OUT/suite.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/suite.log" | tail -60
}

# every command of `bench` under a bound of its own in `short`, so one that hangs costs only its share
T=${T:-}
HUNG=strategies/test_gpu.py::test_training_copies_show_in_the_placement_log

bench() {
    {
        echo "== training on one GPU against plain PyTorch (items 3, 4)"
        $T $PY benchmarks/gpu_train.py --json "$OUT/gpu_train.json"
        echo "== towerflow smi against nvidia-smi (item 6)"
        $T $PY benchmarks/gpu_smi.py --json "$OUT/gpu_smi.json"
        echo "== GPU memory options (item 2): examples/gpu_memory.py"
        $T $PY examples/gpu_memory.py --fraction 0.4
        $T $PY examples/gpu_memory.py --fraction 0.2 --no-growth
        echo "== Pi (item 7): the GPU, then the CPU split in four logical devices"
        $T $PY examples/pi_multi_device.py --samples 20000000      # warms CUDA up
        $T $PY examples/pi_multi_device.py --samples 400000000
        CUDA_VISIBLE_DEVICES= $T $PY examples/pi_multi_device.py --samples 40000000
        if [ -d ../shared/data/mnist-t10k ]; then
            echo "== ps: 1 ps + 2 workers on the GPU, then the same on the CPU (item 5)"
            $T $PY -m towerflow launch --ps 1 --workers 2 examples/mnist_ps.py --data ../shared/data/mnist-t10k --steps 2000
            CUDA_VISIBLE_DEVICES= $T $PY -m towerflow launch --ps 1 --workers 2 examples/mnist_ps.py --data ../shared/data/mnist-t10k --steps 2000
        else
            echo "== ps: skipped, no ../shared/data/mnist-t10k (set MNIST_DIR)"
        fi
        echo "== ps with sparse embedding tables: 2 ps + 2 workers, GPU workers then CPU workers (item 5)"
        $T $PY -m towerflow launch --ps 2 --workers 2 examples/ctr_ps.py --rows 100000 --steps 300
        CUDA_VISIBLE_DEVICES= $T $PY -m towerflow launch --ps 2 --workers 2 examples/ctr_ps.py --rows 100000 --steps 300
    } 2>&1 | tee "$OUT/bench.log"
}

environment
case "${1:-all}" in
    tests) tests ;;
    suite) suite ;;
    bench) bench ;;
    all) tests; suite; bench ;;
    short)
        timeout 240 bash -c "$(declare -f tests); PY=$PY OUT=$OUT tests"
        T="timeout 60" bench
        timeout "${SUITE_SECONDS:-200}" bash -c "$(declare -f suite); PY=$PY OUT=$OUT suite --ignore=tests/schedulers -n 14"
        grep -E "FAILED|ERROR" "$OUT/suite.log" | head -60 ;;
    check)
        # the placement log of a training step hung its process twice on the H200: alone, with every thread's stack
        # dumped when its bound runs out, so the log says where
        timeout 80 $PY -m pytest -p no:cacheprovider -p no:xdist -s --timeout 60 "tests/$HUNG" > "$OUT/hung_test.log" 2>&1 &
        timeout "${GPU_SECONDS:-300}" $PY -m pytest -m gpu -v -rfEs -p no:cacheprovider -p no:benchmark -p _failures_now --timeout 120 \
            -n 3 --dist loadfile --durations=0 --deselect "tests/$HUNG" tests > "$OUT/gpu_tests.log" 2>&1 &
        timeout "${SUITE_SECONDS:-380}" bash -c "$(declare -f suite); PY=$PY OUT=$OUT suite -m 'not gpu' --ignore=tests/schedulers -n 12"
        wait
        grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests.log" | tail -40
        grep -E "FAILED|ERROR" "$OUT/suite.log" | head -60
        {
            echo "== towerflow smi against nvidia-smi"
            timeout 45 $PY benchmarks/gpu_smi.py --json "$OUT/gpu_smi.json"
            echo "== ps with sparse tables, 600 steps: GPU workers, then CPU workers (steps 200-210 profiled)"
            timeout 45 $PY -m towerflow launch --ps 2 --workers 2 --profile-steps 200 --logdir "$OUT/profile-gpu" \
                examples/ctr_ps.py --rows 100000 --steps 600
            CUDA_VISIBLE_DEVICES= timeout 45 $PY -m towerflow launch --ps 2 --workers 2 --profile-steps 200 \
                --logdir "$OUT/profile-cpu" examples/ctr_ps.py --rows 100000 --steps 600
            head -25 "$OUT"/profile-*/profile/worker0-*.txt
        } 2>&1 | tee "$OUT/bench.log" ;;
    profile)
        # why the sparse ps's GPU workers make 0.38x the samples/s of CPU workers: each worker's own ops, ranked
        for where in gpu cpu; do
            rm -rf "$OUT/profile-$where"
            if [ $where = cpu ]; then export CUDA_VISIBLE_DEVICES=; fi
            timeout 120 $PY -m towerflow launch --ps 2 --workers 2 --profile-steps 200 --logdir "$OUT/profile-$where" \
                examples/ctr_ps.py --rows 100000 --steps 600 2>&1 | tail -6
            head -30 "$OUT/profile-$where"/profile/worker0-*.txt
        done 2>&1 | tee "$OUT/profile.log" ;;
    replicas)
        # whether replication's cost on the 2-core machines (docs/benchmarks.md) is the cores': the same job with
        # every core of this machine, then held to two
        for cores in all 0-1; do
            pin=""
            if [ $cores != all ]; then pin="taskset -c $cores"; fi
            echo "== cores: $cores"
            CUDA_VISIBLE_DEVICES= timeout 280 $pin $PY benchmarks/ps_replicas.py --jobs mlp --settings 1,2 --launches 3 \
                --mlp-steps 4000 --out "$OUT/ps_replicas_cores_$cores.json"
        done 2>&1 | tee "$OUT/replicas.log" ;;
    *) echo "usage: $0 tests|suite|bench|all|short|check|profile|replicas" >&2; exit 2 ;;
esac

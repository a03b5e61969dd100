#!/usr/bin/env bash
# towerflow's checks and benchmarks on a CUDA machine: the GPU tests, the rest of the suite, and the GPU
# figures of docs/benchmarks.md ("GPU: one H200"), in parts.
#
# Usage: bash benchmarks/gpu_session.sh PART [OUT_DIR]
#
# Needs: a clone of towerflow; `make setup` run in it (it builds .venv with a CUDA build of PyTorch when
# nvidia-smi finds a GPU), or any Python with CUDA PyTorch and towerflow's dependencies named as PY=...;
# nvidia-smi on the PATH. towerflow runs from the clone's src/ (PYTHONPATH), installed or not.
# Optional: the MNIST-t10k folder (the MNIST tests and the ps run look for it at ../shared/data/mnist-t10k,
# beside the clone; MNIST_DIR=DIR copies it there).
#
# Results go to OUT_DIR, else $OUT, else benchmarks/results/gpu-YYYY-MM-DD (created): environment.txt (the
# GPU, driver, torch and Python), then each part's log. Every failing test's report is written to
# OUT_DIR/failures-PID.log as it happens (benchmarks/_failures_now.py), so a part cut short by its time
# bound still says why each test it ran failed.
#
# Parts (short, check, profile and replicas bound their commands to end within about ten minutes):
#   tests     the gpu-marked tests, verbose, with skip reasons (gpu_tests.log)
#   suite     the whole suite, gpu tests included, 8 pytest workers (suite.log)
#   bench     training against plain PyTorch, the pinned prefetch, `towerflow smi` against nvidia-smi, the
#             memory options, Pi on the GPU and on 4 logical CPUs, the ps on GPU and CPU workers (bench.log,
#             gpu_train.json, gpu_smi.json)
#   all       tests, suite and bench in turn (over ten minutes)
#   short     the three, each command bounded; the suite without tests/schedulers (the real schedulers'
#             tests need the Debian packages of tools/install_schedulers.sh) and bounded by SUITE_SECONDS (200)
#   check     the gpu tests (bounded by GPU_SECONDS, 300) beside the rest of the suite (SUITE_SECONDS, 380;
#             about 16 cores hold both), then `towerflow smi` and the sparse ps on GPU then CPU workers, 10 of
#             their steps profiled (profile-gpu/, profile-cpu/); the test of the placement log of a training
#             step runs alone, its threads' stacks dumped if it hangs (hung_test.log)
#   profile   the sparse ps's workers under torch.profiler, on the GPU then the CPU (10 steps each from
#             global step 200; each worker's ops ranked in profile-gpu/ and profile-cpu/)
#   replicas  CPU only: what --ps-replicas 2 costs the small MLP job with all of the machine's cores, then
#             held to 2 of them (taskset), against the 2-core figures of docs/benchmarks.md
#   hybrid    the CTR example on 2 ps + 2 workers, hybrid (--dense allreduce: NCCL among GPU workers, gloo among
#             CPU ones) and ps-only, each on GPU workers then CPU workers, twice in turn (hybrid.log); the goal:
#             hybrid on GPU workers at least 1.5x the samples/s of CPU workers (about five minutes)
set -uo pipefail
part=${1:-}
case "$part" in
    tests|suite|bench|all|short|check|profile|replicas) ;;
    *) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${2:-${OUT:-$root/benchmarks/results/gpu-$(date +%F)}}  # a relative OUT_DIR is the caller's
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
export OUT  # benchmarks/_failures_now.py writes there too
cd "$root"
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v nvidia-smi >/dev/null 2>&1 || echo "gpu_session: nvidia-smi not found; the GPU parts will skip or fail" >&2
echo "gpu_session: $part, results in $OUT, Python $PY" >&2
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # keeps a site folder of the caller's
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
        echo "== training on one GPU against plain PyTorch"
        $T $PY benchmarks/gpu_train.py --json "$OUT/gpu_train.json"
        echo "== towerflow smi against nvidia-smi"
        $T $PY benchmarks/gpu_smi.py --json "$OUT/gpu_smi.json"
        echo "== GPU memory options: examples/gpu_memory.py"
        $T $PY examples/gpu_memory.py --fraction 0.4
        $T $PY examples/gpu_memory.py --fraction 0.2 --no-growth
        echo "== Pi: the GPU, then the CPU split in four logical devices"
        $T $PY examples/pi_multi_device.py --samples 20000000      # warms CUDA up
        $T $PY examples/pi_multi_device.py --samples 400000000
        CUDA_VISIBLE_DEVICES= $T $PY examples/pi_multi_device.py --samples 40000000
        if [ -d ../shared/data/mnist-t10k ]; then
            echo "== ps: 1 ps + 2 workers on the GPU, then the same on the CPU"
            $T $PY -m towerflow launch --ps 1 --workers 2 examples/mnist_ps.py --data ../shared/data/mnist-t10k --steps 2000
            CUDA_VISIBLE_DEVICES= $T $PY -m towerflow launch --ps 1 --workers 2 examples/mnist_ps.py --data ../shared/data/mnist-t10k --steps 2000
        else
            echo "== ps: skipped, no ../shared/data/mnist-t10k (set MNIST_DIR)"
        fi
        echo "== ps with sparse embedding tables: 2 ps + 2 workers, GPU workers then CPU workers"
        $T $PY -m towerflow launch --ps 2 --workers 2 examples/ctr_ps.py --rows 100000 --steps 300
        CUDA_VISIBLE_DEVICES= $T $PY -m towerflow launch --ps 2 --workers 2 examples/ctr_ps.py --rows 100000 --steps 300
    } 2>&1 | tee "$OUT/bench.log"
}

environment
case "$part" in
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
        # the placement log of a training step once hung its process on a GPU: alone, with every thread's stack
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
    hybrid)
        {
            for round in 1 2; do
                for dense in allreduce ps; do
                    flags=(); [ $dense = allreduce ] && flags=(--dense allreduce)
                    for where in gpu cpu; do
                        echo "== round $round: ${flags[*]:-ps only}, $where workers"
                        ( [ $where = cpu ] && export CUDA_VISIBLE_DEVICES=
                          timeout 120 $PY -m towerflow launch --ps 2 --workers 2 "${flags[@]}" examples/ctr_ps.py \
                              --rows 100000 --steps 600 2>&1 | grep -E "samples/s|test auc|wire:|Error|error" )
                    done
                done
            done
        } 2>&1 | tee "$OUT/hybrid.log" ;;
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
esac

#!/bin/bash
# Every benchmark, one after the other, with the settings docs/benchmarks.md reports.
# Each runs as python bench/X.py (python -m bench.X works as well) and takes the lock, so that
# nothing else this repository starts competes for the cores.
# Usage: bash bench/run_all.sh   (about 160 minutes on 2 cores; results in bench/results, plots in docs/bench)
set -u
cd "$(dirname "$0")/.."
run() { echo "== python bench/$*"; flock /tmp/tmrun-bench.lock python "bench/$@" || echo "!! bench/$1 failed"; }
run steady_state.py --sizes 5M --repeats 6 --drains 2
run standby_cost.py --params 5M --window 30 --pairs 4
run agent_cpu.py --params 1M --window 60 --repeats 2
run agent_loop_stall.py --repeats 3
run kill_teardown.py --repeats 5
run planned_migration.py --sizes 5M,50M
run unplanned_failure.py --sizes 5M,50M
run transfer_limit.py --sizes 5M,50M
run control_plane.py
run rebalancing.py --size 5M --period 30 --rounds 4
run etcd_failure.py
run elastic.py
run pull.py
run native.py --params 50M --steps 30 --at 15 --every 5 --torchrun
run native.py --hsdp --params 50M --steps 30 --at 15 --torchrun
run native.py --steady-repeats 3 --every 10 --params 50M --steps 83
run restart_mode.py
run link_event.py --cuts 3
run control_plane_scale.py

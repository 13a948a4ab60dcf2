#!/usr/bin/env bash
# Session 65, second device call: the whole GPU suite with ONE_WAVE_PDL on by default (captured
# calls behind a one-wave Gluon body attend the FP16 part in a programmatic dependent finish
# kernel), 7 shards on an 80 GB H100 (11 on an H200), the int32-offset tests alone after them.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
TEST_S=420 DETAILS=gpu_suite_s65.txt bash benchmarks/probes/run_gpu_suite_sharded.sh

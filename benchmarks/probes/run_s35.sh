# Session 35, first device call: does the TMA ring's body run faster with more programs per SM
# (probes/occupancy_ab.py: the library kernel at 8, 6, 4 per SM; the keys-only kernel at 16
# down to 4), before any rewrite that would raise the residency.
export PYTHONPATH=src PYTHONUNBUFFERED=1
timeout -s INT ${OCC_S:-420} python3 benchmarks/probes/occupancy_ab.py ${ROWS:-} 2>&1 \
  | grep -v -i -E "warn|nanobind|leaked|skipped|refleak|likely caused" > "$OUT/occupancy_ab_s35.log"
cat "$OUT/occupancy_ab_s35.log"

# Session 34, third device call: with one wave of body programs filling every SM, where do the
# captured call's FP16 splits and finish go? The call's kernel timeline, the side stream's order
# (before / after the body / serial), and the FP16 part inline in the finish kernel.
export PYTHONPATH=src PYTHONUNBUFFERED=1
R=8:32:8:32768:kivi-2,8:32:8:32768:uniform-int4,8:32:8:32768:kivi-4,16:32:8:32768:kivi-2
timeout -s INT 90 python3 benchmarks/probes/graph_call_timeline.py 8:32:8:32768:kivi-2,8:32:8:131072:kivi-2 \
  2>&1 | grep -v -i warn > "$OUT/graph_call_timeline_s34.log"
cat "$OUT/graph_call_timeline_s34.log"
timeout -s INT 120 python3 benchmarks/probes/side_order_ab.py $R \
  2>&1 | grep -v -i warn > "$OUT/side_order_ab_s34.log"
cat "$OUT/side_order_ab_s34.log"
VARIANTS=split,inline,split+stream timeout -s INT 150 python3 benchmarks/probes/finish_pdl_ab.py $R \
  2>&1 | grep -v -i warn > "$OUT/finish_ab_s34.log"
cat "$OUT/finish_ab_s34.log"

"""Parts of scripts/bench_rl.py: what is compared (comparison), the two sides' timed runs (moe_gspo_side, trl_side)
and the summary table and JSON (report). Run the benchmark with scripts/bench_rl.py."""

"""A benchmarks.worker stand-in for tests: writes one finished row for the spec's first batch size, then hangs
(as a real worker can while it frees a large pinned host store)."""
import json
import sys
import time

from benchmarks.common import row

spec = json.load(open(sys.argv[1]))
with open(spec["rows_out"], "a") as f:
    f.write(json.dumps(row(system=spec["system"], model=spec["model"], gpu_cap_gib=spec["gpu_cap_gib"],
                           batch_size=spec["batch_sizes"][0], seq_len=spec["seq_len"], status="ok",
                           step_s_median=1.0)) + "\n")
time.sleep(120)

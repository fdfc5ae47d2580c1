"""Under torchrun: run one `moe-gspo` command through cli.main, then record whether any process group is still
alive in REPORT_DIR/rank_<R>.json (one file per rank: ranks share torchrun's stdout, where their lines can
interleave).

    torchrun --nproc-per-node 2 tests/dist/cli_exit_worker.py REPORT_DIR train-lm --config ... [a.b=v ...]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from moe_gspo import cli

if __name__ == "__main__":
    report_dir = Path(sys.argv[1])
    rc = cli.main(sys.argv[2:])
    tmp = report_dir / f".rank_{os.environ['RANK']}.json"
    tmp.write_text(json.dumps({"rc": rc, "process_group_alive": dist.is_initialized()}))
    tmp.replace(report_dir / f"rank_{os.environ['RANK']}.json")
    sys.exit(rc)

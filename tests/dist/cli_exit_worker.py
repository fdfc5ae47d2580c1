"""Under torchrun: run one `moe-gspo` command through cli.main, then report whether any process group is still
alive, as `rank R process_group_alive=B` on stdout."""
from __future__ import annotations

import os
import sys

import torch.distributed as dist

from moe_gspo import cli

if __name__ == "__main__":
    rc = cli.main(sys.argv[1:])
    print(f"rank {os.environ['RANK']} rc={rc} process_group_alive={dist.is_initialized()}", flush=True)
    sys.exit(rc)

#!/usr/bin/env python3
"""torchrun (torch.distributed.run), usable with a Python torch built without libuv.

torchrun's agent hosts its TCPStore with libuv, and no option or variable turns that off:
with Debian 13's python3-torch 2.6 (built without libuv) it stops at "use_libuv was
requested but PyTorch was build without libuv support". This runs the unchanged torchrun
with the store's libuv off where libuv is missing; elsewhere it is plain torchrun.

    python3 tools/torchrun.py --nproc-per-node 2 --no-python build/trainer/train_decoder ...
"""

import sys

import torch.distributed as dist


def libuv_available() -> bool:
    try:
        dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True)
    except RuntimeError as error:
        if "without libuv" in str(error):
            return False
        raise
    return True


if not libuv_available():

    class TCPStore(dist.TCPStore):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("use_libuv", False)
            super().__init__(*args, **kwargs)

    # Before torchrun's modules import the name.
    dist.TCPStore = TCPStore

from torch.distributed.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

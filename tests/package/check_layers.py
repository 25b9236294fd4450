#!/usr/bin/env python3
"""The library's folders form layers: a file in src/<folder>/ includes only headers of its
own folder or of lower ones, directly ("../lower/x.h") or through the public header a lower
folder implements ("hyperparallel/x.h"); public headers follow the same order. Prints each
include that points upwards; exit 1 if there is one. Usage: check_layers.py SOURCE_DIR"""

import pathlib
import re
import sys

# Lowest first; docs/architecture.md explains each.
LAYERS = [
    "distributed",
    "trace",
    "deferred_init",
    "recompute",
    "activation_swap",
    "fsdp",
    "parallel",
    "materialize",
    "checkpoint",
    "clip_grad",
    "optim",
]
# The folder implementing each public header.
PUBLIC = {
    "process_group": "distributed",
    "comm_handle": "distributed",
    "collectives": "distributed",
    "comm_codec": "distributed",
    "quantized_collectives": "distributed",
    "mesh": "distributed",
    "launch_env": "distributed",
    "parallel_slice": "distributed",
    "trace": "trace",
    "deferred_init": "deferred_init",
    "detail/deferred_init_recording": "deferred_init",
    "recompute": "recompute",
    "activation_swap": "activation_swap",
    "fully_shard": "fsdp",
    "policy": "fsdp",
    "placement": "fsdp",
    "sharded_parameter": "fsdp",
    "detail/sharded_forward": "fsdp",
    "tensor_parallel": "parallel",
    "context_parallel": "parallel",
    "expert_parallel": "parallel",
    "pipeline": "parallel",
    "materialize": "materialize",
    "state_dict": "checkpoint",
    "sharded_checkpoint": "checkpoint",
    "async_checkpoint": "checkpoint",
    "clip_grad": "clip_grad",
    "fused_optimizers": "optim",
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def main() -> int:
    root = pathlib.Path(sys.argv[1])
    problems = []
    public_dir = root / "include" / "hyperparallel"
    for header in public_dir.rglob("*.h"):
        name = header.relative_to(public_dir).with_suffix("").as_posix()
        if name not in PUBLIC:
            problems.append(f"{header}: public header not assigned to a folder in {__file__}")
            continue
        for target in INCLUDE.findall(header.read_text()):
            owner = PUBLIC.get(target[len("hyperparallel/") : -len(".h")])
            if owner and LAYERS.index(owner) > LAYERS.index(PUBLIC[name]):
                problems.append(
                    f"{header.relative_to(root)}: includes {target} of {owner}, "
                    f"a layer above {PUBLIC[name]}"
                )
    for folder in LAYERS:
        level = LAYERS.index(folder)
        for path in sorted((root / "src" / folder).glob("*")):
            for target in INCLUDE.findall(path.read_text()):
                if target.startswith("hyperparallel/"):
                    owner = PUBLIC.get(target[len("hyperparallel/") : -len(".h")])
                else:
                    resolved = (path.parent / target).resolve()
                    owner = (
                        resolved.parent.name
                        if resolved.parent.parent == (root / "src").resolve()
                        else None
                    )
                if owner is None or owner not in LAYERS:
                    if owner is None and target.startswith("hyperparallel/"):
                        problems.append(f"{path}: includes unknown public header {target}")
                    continue
                if LAYERS.index(owner) > level:
                    problems.append(
                        f"{path.relative_to(root)}: includes {target} of {owner}, "
                        f"a layer above {folder}"
                    )
    for problem in problems:
        print(problem)
    print(f"{len(problems)} include(s) against the layer order {' < '.join(LAYERS)}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

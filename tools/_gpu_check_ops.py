#!/usr/bin/env python3
"""Build every ds-ops op here (JIT, into $TORCH_EXTENSIONS_DIR) and time each build; `gpu_check.py`'s build_ops step.

Each op is asked `is_compatible()` first; a compatible op is loaded (compiled unless cached) and
its wall time recorded, an incompatible one is recorded with the reasons. With `--require-cuda`
(the GPU run) a CUDA op that does not build is a failure: that is what the check is for.

    python tools/_gpu_check_ops.py --json build_ops.json [--require-cuda]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="where the per-op records go")
    parser.add_argument("--require-cuda", action="store_true", help="fail when a CUDA op cannot be built and loaded")
    args = parser.parse_args()

    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from ds_ops.op_builder import ALL_OPS, CUDAOpBuilder, extensions_root

    print(f"JIT cache: {extensions_root()}", flush=True)
    records: dict[str, dict[str, object]] = {}
    failed = []
    # CUDA ops first: their build is the figure this step is for, and the likeliest to fail.
    order = sorted(ALL_OPS.items(), key=lambda item: not issubclass(item[1], CUDAOpBuilder))
    for name, builder_class in order:
        builder = builder_class()
        is_cuda = isinstance(builder, CUDAOpBuilder)
        record: dict[str, object] = {"cuda": is_cuda}
        compatibility = builder.is_compatible()
        if not compatibility:
            record.update(status="incompatible", reasons=list(compatibility.reasons))
            if is_cuda and args.require_cuda:
                failed.append(name)
        else:
            record["notes"] = list(compatibility.notes)
            started = time.perf_counter()
            try:
                builder.load(verbose=True)
            except Exception as err:  # noqa: BLE001 - a build failure is the record, the next op still builds
                record.update(status="failed", error=str(err)[-4000:])
                failed.append(name)
            else:
                record.update(status="ok", loaded_from=builder.loaded_from)
            record["seconds"] = round(time.perf_counter() - started, 2)
            if is_cuda:
                record["archs"] = builder.cuda_archs()
        records[name] = record
        print(
            f"{name:<12} {record['status']:<12} {record.get('seconds', '')} "
            f"{record.get('loaded_from', '')} {'; '.join(record.get('reasons', []))}",
            flush=True,
        )
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    if failed:
        print(f"not built: {', '.join(failed)}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

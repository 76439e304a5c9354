"""A stand-in for a training script under the autotuner: it reads its ds_config and acts as an engine would.

With `autotuning.enabled` it writes the metrics file (a throughput from a fixed table of ZeRO stage and
micro-batch size) or, at micro-batch 8 and above, fails as an out-of-memory run does. Without it (the
`--autotuning run` job) it writes the config it was given to `--done_file`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

#: samples/s by (stage, micro-batch size): stage 1 at micro-batch 4 is the best
TABLE = {(0, 2): 100.0, (0, 4): 150.0, (1, 2): 120.0, (1, 4): 180.0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--done_file", default="")
    parser.add_argument("--mbs_arg", type=int, default=0)
    args = parser.parse_args()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    at = config.get("autotuning", {})
    mbs = config["train_micro_batch_size_per_gpu"]
    if at.get("enabled"):
        if args.mbs_arg != mbs:
            sys.exit(f"error: --mbs_arg {args.mbs_arg} does not carry the micro-batch size {mbs}")
        if mbs >= 8:
            sys.exit("RuntimeError: out of memory")
        if os.environ.get("RANK", "0") == "0":
            stage = config["zero_optimization"]["stage"]
            with open(at["metric_path"], "w") as f:
                json.dump({"throughput": TABLE[(stage, mbs)], "latency": 1000.0 / TABLE[(stage, mbs)]}, f)
        return
    with open(args.done_file, "w") as f:
        json.dump(config, f)


if __name__ == "__main__":
    main()

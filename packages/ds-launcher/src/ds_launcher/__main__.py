"""`python -m ds_launcher ...` is the `deepspeed` command."""

from __future__ import annotations

import sys

from ds_launcher.runner import cli

if __name__ == "__main__":
    sys.exit(cli())

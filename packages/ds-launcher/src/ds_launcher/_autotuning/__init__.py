"""The autotuner behind `deepspeed --autotuning tune|run`: settings, search space, tuners, experiments."""

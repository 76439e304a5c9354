"""The hybrid engine (training + generation) built on DeepSpeedEngine."""

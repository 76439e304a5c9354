"""Which optimizer and learning-rate schedule: torch and ds optimizers, Muon, schedule names."""

"""Values decided before anything is built: the plan read from the config, the distributed view."""

"""`initialize()`: the recipe that builds the engine from the config and the model."""

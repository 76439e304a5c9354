"""How one step happens: steppers, mixed precision, autocast, loss scaling, data-parallel reduce, norms."""

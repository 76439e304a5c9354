"""What the user sees: timers, the step reporter, memory and flops reports."""

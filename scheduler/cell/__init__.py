"""The cell runtime: the scheduler actor of one cell, its decisions (coordinator), handoffs, bursts,
clocks."""

"""What transitions requests: the decode loop, the scheduler (pure policy),
request intake and validation, the assembly of an engine's parts, counters."""

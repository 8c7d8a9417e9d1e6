"""`kvlife` and its subcommands, and the built-in workload of `kvlife run`."""

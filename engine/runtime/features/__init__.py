"""Features that install themselves: each returns its hooks, pools, observers and runner
parts, and `engine.runtime.assembly` folds over the installs (see `base.py`)."""

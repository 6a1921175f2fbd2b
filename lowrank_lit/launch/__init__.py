"""Run directories, offline sweeps and SLURM submission (they sit on top of the CLI)."""
